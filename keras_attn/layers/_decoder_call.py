"""One `TransformerDecoder` call: its arguments, with the padding masks
resolved, and what the decoder accepts, checked once."""

import dataclasses
from typing import Any

from keras_attn._checks import (
    check_bool,
    check_broadcastable,
    check_float,
    check_index,
    check_mask,
    check_positions,
    check_rank,
    check_segment_ids_call,
    check_width,
    dims_differ,
)
from keras_attn.layers._attention_cache import cache_length, check_cache
from keras_attn.layers._block import first_mask


@dataclasses.dataclass
class DecoderCall:
    """The arguments of a `TransformerDecoder` call, in `call`'s order, with
    its padding masks resolved (`decoder_padding`, `encoder_padding`):
    explicit masks take precedence over the inputs' Keras masks, and with a
    self-attention cache the keys are the cache's positions (the decoder
    input's mask covers only the new tokens)."""

    decoder_sequence: Any
    encoder_sequence: Any = None
    decoder_padding_mask: Any = None
    decoder_attention_mask: Any = None
    encoder_padding_mask: Any = None
    encoder_attention_mask: Any = None
    self_attention_cache: Any = None
    self_attention_cache_update_index: Any = None
    cross_attention_cache: Any = None
    cross_attention_cache_update_index: Any = None
    use_causal_mask: bool = True
    training: Any = None
    return_attention_scores: bool = False
    decoder_attention_bias: Any = None
    encoder_attention_bias: Any = None
    positions: Any = None
    segment_ids: Any = None
    mask: Any = None
    decoder_sequence_mask: Any = None
    encoder_sequence_mask: Any = None
    decoder_padding: Any = dataclasses.field(init=False)
    encoder_padding: Any = dataclasses.field(init=False)

    def __post_init__(self):
        self.decoder_padding = self.decoder_padding_mask
        if self.self_attention_cache is None:
            self.decoder_padding = first_mask(
                self.decoder_padding_mask, self.decoder_sequence_mask, self.mask
            )
        self.encoder_padding = first_mask(
            self.encoder_padding_mask, self.encoder_sequence_mask
        )


def check_decoder_call(layer, args):
    """Every argument of a call of the built decoder `layer`, before anything
    is computed."""
    layer._check_sequence(
        "decoder_sequence", args.decoder_sequence, args.return_attention_scores
    )
    check_bool("use_causal_mask", args.use_causal_mask)
    batch, target = args.decoder_sequence.shape[:2]
    keys = _check_self_attention_cache(layer, args, batch, target)
    check_mask("decoder_padding_mask", args.decoder_padding_mask, (batch, keys))
    check_mask(
        "decoder_attention_mask", args.decoder_attention_mask, (batch, target, keys)
    )
    check_broadcastable(
        "decoder_attention_bias",
        args.decoder_attention_bias,
        (batch, layer.num_heads, target, keys),
        "(batch, num_heads, target_length, key_length)",
    )
    wavelength = layer.self_attention.rope_max_wavelength  # the block's, or its own
    check_positions(args.positions, batch, target, wavelength)
    _check_segment_ids(args, batch, target)
    if layer._has_cross_attention:
        _check_cross_attention(layer, args, batch, target)
    else:
        _check_no_cross_attention(layer, args)


def _check_segment_ids(args, batch, target):
    """Segment ids `(batch, target_length)`, for a call without a cache or
    cross-attention: the decoder tokens would attend to every encoder
    document (it would need the encoder's ids, which this release does not
    take)."""
    conflict = None
    if args.self_attention_cache is not None:
        conflict = "a `self_attention_cache`"
    elif args.encoder_sequence is not None or args.cross_attention_cache is not None:
        given = (
            "n `encoder_sequence`"
            if args.encoder_sequence is not None
            else (" `cross_attention_cache`")
        )
        conflict = (
            f"a{given} (cross-attention would need the encoder's segment ids, "
            "which this release does not take)"
        )
    check_segment_ids_call(args.segment_ids, (batch, target), conflict)


def _check_self_attention_cache(layer, args, batch, target):
    """Check the cache and its index; return the number of keys."""
    cache, index = args.self_attention_cache, args.self_attention_cache_update_index
    if (cache is None) != (index is None):
        raise ValueError(
            "`self_attention_cache` and `self_attention_cache_update_index` "
            f"go together. Received: self_attention_cache={_described(cache)}, "
            f"self_attention_cache_update_index={index}."
        )
    if cache is None:
        return target
    own_check = getattr(layer.self_attention, "check_cache", None)  # its own cache
    if own_check is not None:
        own_check(cache, batch, "self_attention_cache")
    else:
        check_cache(layer.self_attention, cache, batch, "self_attention_cache")
    length = cache_length(cache)
    check_index("self_attention_cache_update_index", index, target, length)
    return length


def _check_cross_attention(layer, args, batch, target):
    """The encoder side of a decoder with cross-attention."""
    source = _check_encoder_sequence(layer, args)
    source = _check_cross_attention_cache(layer, args, batch, source)
    check_mask("encoder_padding_mask", args.encoder_padding_mask, (batch, source))
    check_mask(
        "encoder_attention_mask",
        args.encoder_attention_mask,
        (batch, target, source),
    )
    check_broadcastable(
        "encoder_attention_bias",
        args.encoder_attention_bias,
        (batch, layer.num_heads, target, source),
        "(batch, num_heads, target_length, source_length)",
    )


def check_encoder_batch(decoder_sequence_shape, encoder_sequence_shape):
    """Raise unless the encoder sequence has the decoder input's batch size
    (where both are known): each decoder row attends to its own source."""
    got, want = encoder_sequence_shape[0], decoder_sequence_shape[0]
    if dims_differ(got, want):
        raise ValueError(
            "`encoder_sequence` must have the batch size of `decoder_sequence`: "
            "each decoder row attends to the encoder row of the same index. "
            f"Received: encoder_sequence.shape={tuple(encoder_sequence_shape)}, "
            f"decoder_sequence.shape={tuple(decoder_sequence_shape)}."
        )


def _check_encoder_sequence(layer, args):
    """The encoder sequence, needed unless a precomputed cache stands in for
    it; returns its length (`None` without one)."""
    sequence, cache = args.encoder_sequence, args.cross_attention_cache
    if sequence is None and (
        cache is None or args.cross_attention_cache_update_index is not None
    ):
        raise ValueError(
            f"{layer.name} was built with cross-attention (its first call "
            "had an `encoder_sequence`), so every call needs one: call it "
            "as `decoder(decoder_sequence, encoder_sequence)`. "
            "Received: encoder_sequence=None."
        )
    if sequence is None:
        return None
    check_rank("encoder_sequence", sequence.shape, 3, "(batch, length, width)")
    check_encoder_batch(args.decoder_sequence.shape, sequence.shape)
    check_float("encoder_sequence", sequence)
    check_width(
        "encoder_sequence", sequence.shape, layer.cross_attention._widths["value"]
    )
    return sequence.shape[1]


def _check_cross_attention_cache(layer, args, batch, source):
    """The cross-attention cache and its index; returns the number of keys."""
    cache, index = args.cross_attention_cache, args.cross_attention_cache_update_index
    if index is not None and cache is None:
        raise ValueError(
            "`cross_attention_cache_update_index` needs a "
            "`cross_attention_cache`. Received: cross_attention_cache=None, "
            f"cross_attention_cache_update_index={index}."
        )
    if cache is None:
        return source
    check_cache(layer.cross_attention, cache, batch, "cross_attention_cache")
    if index is not None:
        length = cache_length(cache)
        check_index("cross_attention_cache_update_index", index, source, length)
    return cache_length(cache)


def _check_no_cross_attention(layer, args):
    if args.encoder_sequence is not None:
        raise ValueError(
            f"{layer.name} was built as a decoder-only block (its first call "
            "had no `encoder_sequence`), so it has no cross-attention: call "
            "it as `decoder(decoder_sequence)`, or use a new layer for an "
            "encoder-decoder model. Received: encoder_sequence.shape="
            f"{tuple(args.encoder_sequence.shape)}."
        )
    for name in _CROSS_ATTENTION_ARGUMENTS:
        value = getattr(args, name)
        if value is not None:
            raise ValueError(
                f"`{name}` needs cross-attention, and this decoder-only "
                f"block has none. Received: {name}={_described(value)}."
            )


_CROSS_ATTENTION_ARGUMENTS = (
    "encoder_padding_mask",
    "encoder_attention_mask",
    "encoder_attention_bias",
    "cross_attention_cache",
    "cross_attention_cache_update_index",
)


def _described(value):
    if value is None:
        return "None"
    if isinstance(value, tuple):  # a `keras_attn.cache` object
        return f"a {type(value).__name__} of {value.length} positions"
    return f"tensor of shape {tuple(value.shape)}"
