"""One `MultiHeadAttention` call: its arguments resolved, and what the layer
accepts, checked once (at the call the user made, not again in a block's
sublayer)."""

import dataclasses
from typing import Any

from keras import ops

from keras_attn._checks import (
    check_bool,
    check_broadcastable,
    check_float,
    check_heads_divide,
    check_index,
    check_mask,
    check_positions,
    check_rank,
    check_segment_ids_call,
    check_width,
    dims_differ,
)
from keras_attn.layers._attention_axes import AttentionAxes
from keras_attn.layers._attention_cache import cache_length, check_cache
from keras_attn.ops.dtypes import int32
from keras_attn.ops.masks import (
    causal,
    merge_attention_masks,
    sink_keys,
    window_band,
)
from keras_attn.ops.plan import fused_limits, refuse_flash
from keras_attn.ops.positions import positions_in_runs, segment_runs


@dataclasses.dataclass
class AttentionCall:
    """The arguments of a `MultiHeadAttention` call, in `call`'s order.

    Resolved on creation: `value` defaults to the query, `key` to `value`; in
    self-attention the query's padding mask masks the keys (unless they come
    from a cache). Self-attention is no `value`, or Keras' `layer(x, x)`:
    `value` the query tensor itself.
    """

    query: Any
    value: Any = None
    key: Any = None
    query_mask: Any = None
    value_mask: Any = None
    key_mask: Any = None
    attention_mask: Any = None
    return_attention_scores: bool = False
    training: Any = None
    use_causal_mask: bool = False
    attention_bias: Any = None
    cache: Any = None
    cache_update_index: Any = None
    positions: Any = None
    segment_ids: Any = None
    mask: Any = None
    self_attention: bool = dataclasses.field(init=False)
    _segments: Any = dataclasses.field(default=None, init=False, repr=False)
    _segment_positions: Any = dataclasses.field(default=None, init=False, repr=False)

    def __post_init__(self):
        # Identity, not `in`: `key in (None, query)` compares tensors by value.
        self.self_attention = self.value is None or (
            self.value is self.query and (self.key is None or self.key is self.query)
        )
        if self.value is None:
            self.value = self.query
            if self.value_mask is None and self.cache is None:
                self.value_mask = (
                    self.query_mask if self.query_mask is not None else self.mask
                )
        if self.key is None:
            self.key = self.value

    # Not `functools.cached_property`: on Python 3.11 it takes an `RLock`,
    # which `torch.compile` cannot trace (a graph break in every call).
    @property
    def segments(self):
        """The segments of `segment_ids` `(B, T)` (their runs, numbered from
        1), to compare in the attention, or `None`; computed once a call."""
        if self._segments is None and self.segment_ids is not None:
            self._segments = segment_runs(self.segment_ids)
        return self._segments

    @property
    def segment_positions(self):
        """Each token's position in its segment `(B, T)`, or `None`; computed
        once a call (for the rotary positions and the sinks)."""
        if self._segment_positions is None and self.segment_ids is not None:
            self._segment_positions = positions_in_runs(self.segments)
        return self._segment_positions

    @property
    def projects_keys(self):
        """Keys and values are projected (not read from a precomputed cache)."""
        return self.cache is None or self.cache_update_index is not None

    def scores_shape(self, attention_axes, num_heads):
        """The shape of the weights the call returns (`return_attention_scores`):
        over the cache's slots where it reads a cache."""
        key_shape = self.key.shape
        if self.cache is not None:
            key_shape = (key_shape[0], cache_length(self.cache))
        axes = AttentionAxes(attention_axes, len(self.query.shape))
        return axes.scores_shape(self.query.shape, key_shape, num_heads)

    def rope_positions(self):
        """The rotary positions of the queries and of the keys projected in
        this call.

        Queries sit at `positions`, by default `cache_update_index` (or 0)
        onwards, or with `segment_ids` at each segment's positions from 0
        (`positions` win over them). In self-attention the new keys are the
        queries' tokens, at the same positions; the keys of another sequence
        count from the index (or 0) on their own.
        """
        index = self.cache_update_index
        start = 0 if index is None else int32(index)
        positions = self.positions
        if positions is None:
            positions = self.segment_positions  # (B, T), or None
        if positions is None:
            positions = ops.arange(0, ops.shape(self.query)[1], dtype="int32") + start
        if self.self_attention:
            return positions, positions
        return positions, ops.arange(0, ops.shape(self.key)[1], dtype="int32") + start

    def merged_mask(self, axes, sliding_window, lengths, sinks=None):
        """The merged boolean mask (or `None`), and whether attention is
        causal from the first key (`is_causal` of `dot_product_attention`,
        whose plan decides its form).

        With a cache the queries sit at the cache index, an offset that
        `is_causal` cannot say: the causal mask is built here. `lengths`
        counts the (folded) queries and the keys (the cache's positions with a
        cache). `sinks`: the attention sinks beside the sliding window.
        """
        fold = axes.fold
        padding = [
            ops.expand_dims(fold(ops.cast(m, "bool"), trailing=0), 1)  # (B, 1, S)
            for m in (self.value_mask, self.key_mask)
            if m is not None
        ]
        attention_mask = axes.fold_attention_mask(
            self.attention_mask, self.query, self.key
        )
        written, band = self._position_masks(sliding_window, *lengths)
        if sinks:  # the window's band, widened to the sinks
            band = self._sink_band(band, sinks, lengths[1], padding)
        mask = merge_attention_masks(*padding, attention_mask, written, band)
        return mask, self.use_causal_mask and self.cache_update_index is None

    def key_band(self, sliding_window, sinks=None):
        """`(sliding_window, sinks)`, the band by position, where the keys'
        positions alone give it (no cache offset; sinks not moved by padding
        or segments), else `None`. The layer then passes it to `attend`
        rather than to `merged_mask`: the chunked path builds it chunk by
        chunk and skips the keys outside it."""
        moved = self.segment_ids is not None or (
            self.value_mask is not None or self.key_mask is not None
        )
        if sliding_window is None or self.cache is not None or (sinks and moved):
            return None
        return sliding_window, sinks or 0

    def _position_masks(self, sliding_window, query_length, key_length):
        """The masks by position, `(written, band)`, each `None` where it
        has none: from the cache index, where the queries sit, the causal
        mask (or, without it, the keys written so far); the sliding window's
        band."""
        offset, written, band = 0, None, None
        if self.cache_update_index is not None:  # queries at index, index + 1, ...
            offset = int32(self.cache_update_index)
            # One new token of self-attention (a decoding step) sees every
            # key written so far: that is its causal mask, built for less.
            one_token = (  # a length known when traced (not a TF tensor)
                self.self_attention
                and isinstance(query_length, int)
                and query_length == 1
            )
            if self.use_causal_mask and not one_token:
                written = causal(query_length, key_length, offset)
            else:  # every key written so far: up to the last new one's
                keys = ops.arange(0, key_length, dtype="int32")
                last = offset if one_token else offset + ops.shape(self.key)[1] - 1
                written = ops.expand_dims(keys <= last, 0)
        if sliding_window is not None:
            band = window_band(query_length, key_length, sliding_window, offset)
        return written, band

    def _sink_band(self, band, sinks, key_length, padding):
        """The window's `band` `(T, S)` widened to the first `sinks` keys: of
        each packed segment with `segment_ids` (as if each ran alone), else of
        each row after its left padding where keys are padded, `(B, T, S)`."""
        if self.segment_ids is not None:  # (B, 1, S): each segment's first keys
            first = self.segment_positions < sinks
            return ops.logical_or(band, ops.expand_dims(first, 1))
        real = None
        if padding:  # each `(B, 1, S)`
            real = padding[0] if len(padding) == 1 else ops.logical_and(*padding)
            real = real[:, 0]  # (B, S)
        return ops.logical_or(band, sink_keys(key_length, sinks, real))


def check_shapes(layer, query_shape, value_shape, key_shape):
    """Raise unless the shapes fit together and `layer`; return their
    `AttentionAxes`."""
    rank = len(query_shape)
    if rank < 3:
        raise ValueError(
            "`query` must have rank 3 or more, (batch, length, width) or "
            "(batch, *axes, width). "
            f"Received: query.shape={tuple(query_shape)}."
        )
    for name, shape in (("value", value_shape), ("key", key_shape)):
        check_rank(name, shape, rank, "the rank of `query`")
    _check_key_value_agree(key_shape, value_shape)
    for name, shape in (
        ("query", query_shape),
        ("value", value_shape),
        ("key", key_shape),
    ):
        if shape[-1] is None:
            raise ValueError(
                f"The {name} width (last dimension) must be known. "
                f"Received: {name}_shape={tuple(shape)}."
            )
    axes = AttentionAxes(layer.attention_axes, rank)
    _check_batch_axes(axes, query_shape, value_shape)
    return axes


def _check_key_value_agree(key_shape, value_shape):
    """Raise unless `key` and `value` agree on every dimension but the last."""
    if any(
        dims_differ(a, b) for a, b in zip(key_shape[:-1], value_shape[:-1], strict=True)
    ):
        raise ValueError(
            "`key` and `value` must have the same length and batch size: all "
            "dimensions but the last one must be equal (as in Keras). "
            f"Received: key.shape={tuple(key_shape)}, "
            f"value.shape={tuple(value_shape)}."
        )


def _check_batch_axes(axes, query_shape, value_shape):
    """Raise unless `query` and `value` agree on the batch axis and on the
    other axes attention does not run over (static dims only: a batch of
    `None` is not read from the tensors)."""
    if any(dims_differ(query_shape[a], value_shape[a]) for a in (0, *axes.batch)):
        others = f" and size on axes {list(axes.batch)}" if axes.batch else ""
        raise ValueError(
            f"`query` and `value` must have the same batch size{others} (the "
            "axes attention does not run over). "
            f"Received: query.shape={tuple(query_shape)}, "
            f"value.shape={tuple(value_shape)}."
        )


def check_heads(layer, rank, query_width):
    """The head width: `key_dim`, or one that `num_heads` divides the query
    width into; even with rotary positions."""
    check_heads_divide(layer.num_heads, layer.key_dim, query_width, "query")
    key_dim = layer.key_dim or query_width // layer.num_heads
    if layer.rope_max_wavelength is not None and (rank != 3 or key_dim % 2):
        raise ValueError(
            "Rotary position embeddings (`rope_max_wavelength`) need inputs "
            "of rank 3, (batch, length, width), and an even `key_dim` "
            f"(channels rotate in pairs). Received: inputs of rank {rank}, "
            f"key_dim={key_dim}."
        )


def check_scores_allowed(flash_attention, return_attention_scores, kind="layer"):
    """Raise unless `return_attention_scores` is a bool that the layer's
    `flash_attention` allows (a fused kernel returns no weights)."""
    check_bool("return_attention_scores", return_attention_scores)
    if return_attention_scores and flash_attention:
        refuse_flash(
            fused_limits(return_scores=True),
            "return_attention_scores=True",
            asked="return_attention_scores=True",
            advice=f"Create the {kind} with flash_attention=None to get the scores.",
        )


def check_call(layer, call):
    """Every argument of `call` to the built `layer`, before anything is
    computed."""
    check_bool("use_causal_mask", call.use_causal_mask)
    check_scores_allowed(layer.flash_attention, call.return_attention_scores)
    query, key = call.query, call.key
    _check_inputs(layer, query, call.value, key, call.projects_keys)
    inner = tuple(query.shape[:-1])
    check_mask("query_mask", call.query_mask, inner)
    check_mask("mask", call.mask, inner)
    key_inner = _check_cache_arguments(layer, call, tuple(key.shape[:-1]))
    check_mask("value_mask", call.value_mask, key_inner)
    check_mask("key_mask", call.key_mask, key_inner)
    _check_attention_mask(layer, call.attention_mask, inner, key_inner)
    _check_attention_bias(layer, call.attention_bias, inner, key_inner)
    check_positions(call.positions, *inner[:2], layer.rope_max_wavelength)
    _check_rotary_call(layer, call)
    _check_segment_ids(layer, call, inner)


def _check_segment_ids(layer, call, inner):
    """Segment ids `(batch, length)` of a self-attention without a cache."""
    conflict = None
    if call.cache is not None:
        conflict = "a `cache`"
    elif not call.self_attention:
        conflict = "a separate `value` or `key`"
    elif layer._axes.rank != 3:
        conflict = f"inputs of rank {layer._axes.rank}"
    check_segment_ids_call(call.segment_ids, inner[:2], conflict)


def _check_rotary_call(layer, call):
    if call.positions is not None and not call.self_attention:
        raise ValueError(
            "`positions` are the rotary positions of a self-attention's "
            "tokens; call it as `layer(query)` (or with `value` the very "
            "query tensor). Keys of another sequence sit at 0, 1, ... "
            "Received: positions with a separate `value`."
        )
    if (
        layer.rope_max_wavelength is not None
        and not call.projects_keys
        and call.positions is None
    ):
        raise ValueError(
            "With rotary positions, a precomputed `cache` (no "
            "`cache_update_index`) needs the queries' `positions`: nothing "
            "else tells where they sit. Received: positions=None."
        )


def _check_cache_arguments(layer, call, key_inner):
    """Check `cache` and `cache_update_index`; return the keys' inner shape."""
    cache, index = call.cache, call.cache_update_index
    if cache is None:
        if index is not None:
            raise ValueError(
                "`cache_update_index` needs a `cache`. Received: cache=None, "
                f"cache_update_index={index}."
            )
        return key_inner
    check_cache(layer, cache, call.query.shape[0])
    if index is not None:  # the new keys are written from there
        check_index("cache_update_index", index, key_inner[1], cache_length(cache))
    return (key_inner[0], cache_length(cache))


def _check_inputs(layer, query, value, key, projected):
    """Float inputs of the rank and the widths built for."""
    rank = layer._axes.rank
    layout = "(batch, length, width)" if rank == 3 else "(batch, *axes, width)"
    for name, tensor in (("query", query), ("value", value), ("key", key)):
        check_rank(name, tensor.shape, rank, layout)
        check_float(name, tensor)
        if name == "query" or projected:
            check_width(name, tensor.shape, layer._widths[name])
    _check_key_value_agree(key.shape, value.shape)
    _check_batch_axes(layer._axes, query.shape, value.shape)


def _check_attention_mask(layer, attention_mask, inner, key_inner):
    axes = layer._axes
    if axes.rank == 3:
        batch, query_length, key_length = inner[0], inner[1], key_inner[1]
        shapes = {
            2: (query_length, key_length),
            3: (batch, query_length, key_length),
            4: (batch, layer.num_heads, query_length, key_length),
        }
    else:  # (B, *batch axes, *query attention axes, *key attention axes)
        shape = (inner[0], *(inner[a] for a in axes.batch))
        shape += tuple(inner[a] for a in axes.attention)
        shape += tuple(key_inner[a] for a in axes.attention)
        shapes = {len(shape): shape}
    check_mask("attention_mask", attention_mask, shapes, broadcast=True)


def _check_attention_bias(layer, bias, inner, key_inner):
    if bias is not None and layer._axes.rank != 3:
        raise ValueError(
            "`attention_bias` needs inputs of rank 3, (batch, length, width). "
            f"{layer.name} was built for inputs of rank {layer._axes.rank}."
        )
    full = (inner[0], layer.num_heads, inner[1], key_inner[1])
    check_broadcastable(
        "attention_bias",
        bias,
        full,
        "(batch, num_heads, query_length, key_length)",
    )
