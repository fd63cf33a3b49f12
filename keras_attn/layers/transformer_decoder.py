"""The Transformer decoder block: masked self-attention, cross-attention, FFN."""

import dataclasses
from typing import Any

import keras

from keras_attn._checks import (
    call_checks_skipped,
    check_bool,
    check_broadcastable,
    check_float,
    check_index,
    check_mask,
    check_positions,
    check_rank,
    check_width,
)
from keras_attn.layers._attention_call import check_cache
from keras_attn.layers._block import TransformerBlock, first_mask, to_bool


@keras.saving.register_keras_serializable(package="keras_attn")
class TransformerDecoder(TransformerBlock):
    """One Transformer decoder block, encoder-decoder or decoder-only.

    Called with `encoder_sequence`, it is the decoder block of Vaswani et al.
    (2017): causal self-attention, cross-attention into the encoder output, and
    a feed-forward network, each with a residual and a layer norm (post-norm by
    default, pre-norm with `normalize_first=True`, as in
    `torch.nn.TransformerDecoderLayer`). Called without it, it is a GPT-style
    decoder-only block (no cross-attention). The first call decides which: a
    layer built one way raises a `ValueError` when called the other way.

    Sublayers: `self_attention`, `self_attention_layer_norm`, with an encoder
    `cross_attention` and `cross_attention_layer_norm`, then
    `feedforward_intermediate_dense`, (`feedforward_gate_dense` with
    `gated_feedforward`), `feedforward_output_dense`, `feedforward_layer_norm`.
    The norms are `RMSNormalization`s with `normalization="rms_norm"`; each
    attention has `query_norm` and `key_norm` with `normalize_qk`.

    Args:
        intermediate_dim: int. Hidden width of the feed-forward network.
        num_heads: int. Number of attention heads; must divide the input width
            unless `key_dim` is given.
        dropout: float in [0, 1). Dropout on the attention weights, the
            feed-forward hidden units and each residual branch. Defaults to `0.0`.
        activation: activation of the feed-forward network. Defaults to `"relu"`.
        layer_norm_epsilon: float > 0. Defaults to `1e-5`.
        kernel_initializer: initializer of all kernels. Defaults to
            `"glorot_uniform"`.
        bias_initializer: initializer of all biases. Defaults to `"zeros"`.
        normalize_first: bool. Pre-norm instead of post-norm. Defaults to
            `False`.
        key_dim: int, keyword only. Per-head width. Defaults to width //
            `num_heads`.
        num_key_value_heads: int, keyword only. Key/value heads for
            grouped-query attention; must divide `num_heads`. Defaults to
            `num_heads`.
        flash_attention: `None`, `True` or `False`, keyword only; see
            `keras_attn.MultiHeadAttention`. Defaults to `None`.
        use_gate: bool, keyword only. A sigmoid gate on each attention output;
            see `keras_attn.MultiHeadAttention`. Defaults to `False`.
        sliding_window: int, keyword only. In self-attention, each position
            attends only to positions less than `sliding_window` away (with
            the causal mask: itself and the `sliding_window - 1` before it).
            Defaults to `None`.
        normalization: `"layer_norm"` (Keras' `LayerNormalization`) or
            `"rms_norm"` (Keras' `RMSNormalization`, as in LLaMA), keyword
            only. Defaults to `"layer_norm"`.
        gated_feedforward: bool, keyword only. The gated network
            `W_2 (activation(W_g x) * W_1 x)` (`feedforward_gate_dense` is
            `W_g`): SwiGLU with `activation="silu"`, GeGLU with `"gelu"`.
            Defaults to `False`.
        use_bias: bool, keyword only. `False` drops every bias: the
            projections', the feed-forward matrices' and the layer norms'
            offsets (as LLaMA). Defaults to `True`.
        normalize_qk: bool, keyword only. RMS-normalize queries and keys per
            head before the dot product (Gemma 3), with
            `layer_norm_epsilon`. Defaults to `False`.
        logit_soft_cap: float, keyword only. Soft-cap the attention logits to
            `cap * tanh(logits / cap)` (Gemma 2). Defaults to `None`.
        rope_max_wavelength: float, keyword only. Rotary position embeddings
            (Su et al. 2021) in self-attention, with this base; see
            `keras_attn.ops.rotary_embedding`. Defaults to `None` (none).
        rope_scaling_factor: float, keyword only. Positions are divided by it
            (linear position interpolation). Defaults to `1.0`.
        **kwargs: Base layer arguments (`name`, `dtype`, ...).

    Call arguments (keras-hub's order; the ones after `use_causal_mask`,
    `training` and `return_attention_scores` are keras_attn's own):
        decoder_sequence: float tensor `(batch, target_length, width)`.
        encoder_sequence: float tensor `(batch, source_length, source_width)`,
            for an encoder-decoder block; `None` for decoder-only.
        decoder_padding_mask: optional bool `(batch, target_length)`, True for
            real tokens; takes precedence over the decoder input's Keras mask.
        decoder_attention_mask: optional bool
            `(batch, target_length, target_length)` for self-attention.
        encoder_padding_mask: optional bool `(batch, source_length)`; takes
            precedence over the encoder input's Keras mask.
        encoder_attention_mask: optional bool
            `(batch, target_length, source_length)` for cross-attention.
        self_attention_cache: optional self-attention key/value cache
            `(batch, 2, num_key_value_heads, max_length, key_dim)` (heads-major;
            see `get_empty_self_attention_cache`); goes with
            `self_attention_cache_update_index`, the position of the first new
            token. The keys are then the cache's positions: a
            `decoder_padding_mask` covers `(batch, max_length)`.
        self_attention_cache_update_index: int or scalar int tensor.
        cross_attention_cache: optional cross-attention cache
            `(batch, 2, num_key_value_heads, source_length, key_dim)`: with no
            `cross_attention_cache_update_index`, precomputed keys and values
            (`compute_cross_attention_cache`); with one, the encoder sequence's
            keys and values are written into it there (keras-hub's way).
        cross_attention_cache_update_index: int or scalar int tensor.
        use_causal_mask: bool. Position `i` attends only to positions `<= i` in
            self-attention. Defaults to `True`.
        training: bool. Whether dropout is active.
        return_attention_scores: bool. Also return the attention weights.
            Defaults to `False`.
        decoder_attention_bias: optional float tensor broadcastable to
            `(batch, num_heads, target_length, target_length)` (or the cache's
            length), added to the self-attention logits.
        encoder_attention_bias: optional float tensor broadcastable to
            `(batch, num_heads, target_length, source_length)`, added to the
            cross-attention logits.
        positions: optional int tensor `(target_length,)` or
            `(batch, target_length)`: the rotary positions of the decoder
            tokens (with `rope_max_wavelength`), e.g. per row for left-padded
            prompts. Defaults to `self_attention_cache_update_index` (or 0)
            onwards.
        mask, decoder_sequence_mask, encoder_sequence_mask: filled in by Keras
            with the inputs' Keras masks; not passed by hand.

    Returns:
        Tensor of the decoder input's shape, carrying its mask. With
        `return_attention_scores=True`, `self_attention_scores` follow (and
        `cross_attention_scores` with an encoder), each
        `(batch, num_heads, target_length, key_length)`. With a
        `self_attention_cache`, the updated `self_attention_cache` follows last
        (and the `cross_attention_cache` with an encoder, computed if none was
        passed): e.g. `(outputs, self_attention_cache, cross_attention_cache)`.

    Example:
    >>> decoder = keras_attn.TransformerDecoder(intermediate_dim=64, num_heads=2)
    >>> target, source = np.zeros((2, 4, 16)), np.zeros((2, 6, 16))
    >>> tuple(decoder(target, source).shape)
    (2, 4, 16)
    >>> gpt_block = keras_attn.TransformerDecoder(intermediate_dim=64, num_heads=2)
    >>> tuple(gpt_block(target).shape)
    (2, 4, 16)
    """

    def build(self, decoder_sequence_shape, encoder_sequence_shape=None):
        self._check_width("decoder_sequence", decoder_sequence_shape)
        self.self_attention, self.self_attention_layer_norm = self._build_attention(
            "self_attention", decoder_sequence_shape, window=self.sliding_window
        )
        self._has_cross_attention = encoder_sequence_shape is not None
        if self._has_cross_attention:
            self.cross_attention, self.cross_attention_layer_norm = (
                self._build_attention(
                    "cross_attention", decoder_sequence_shape, encoder_sequence_shape
                )
            )
        self._build_feedforward(decoder_sequence_shape, norm_first=False)
        self.built = True

    def call(
        self,
        decoder_sequence,
        encoder_sequence=None,
        decoder_padding_mask=None,
        decoder_attention_mask=None,
        encoder_padding_mask=None,
        encoder_attention_mask=None,
        self_attention_cache=None,
        self_attention_cache_update_index=None,
        cross_attention_cache=None,
        cross_attention_cache_update_index=None,
        use_causal_mask=True,
        training=None,
        return_attention_scores=False,
        decoder_attention_bias=None,
        encoder_attention_bias=None,
        positions=None,
        mask=None,
        decoder_sequence_mask=None,
        encoder_sequence_mask=None,
    ):
        args = DecoderCall(
            decoder_sequence, encoder_sequence, decoder_padding_mask,
            decoder_attention_mask, encoder_padding_mask, encoder_attention_mask,
            self_attention_cache, self_attention_cache_update_index,
            cross_attention_cache, cross_attention_cache_update_index,
            use_causal_mask, training, return_attention_scores,
            decoder_attention_bias, encoder_attention_bias, positions, mask,
            decoder_sequence_mask, encoder_sequence_mask,
        )  # fmt: skip
        if not call_checks_skipped():
            self._check_call(args)
        x, self_scores, self_attention_cache = self._attention_residual(
            decoder_sequence,
            self.self_attention,
            self.self_attention_layer_norm,
            training,
            return_attention_scores,
            value_mask=to_bool(args.decoder_padding),
            attention_mask=decoder_attention_mask,
            attention_bias=decoder_attention_bias,
            use_causal_mask=use_causal_mask,
            cache=self_attention_cache,
            cache_update_index=self_attention_cache_update_index,
            positions=positions,
        )
        scores, caches = (self_scores,), (self_attention_cache,)
        if self._has_cross_attention:
            x, cross_scores, cross_attention_cache = self._cross_attention_residual(
                x, args
            )
            scores, caches = scores + (cross_scores,), caches + (cross_attention_cache,)
        x = self._feedforward_residual(x, training)
        outputs = (x,) + (scores if return_attention_scores else ())
        outputs += caches if self_attention_cache is not None else ()
        return outputs[0] if len(outputs) == 1 else outputs

    def _cross_attention_residual(self, x, args):
        """Cross-attention into the encoder sequence, or into its cache."""
        cache = args.cross_attention_cache
        if args.self_attention_cache is not None and cache is None:
            cache = self.cross_attention._project_cache(args.encoder_sequence)
        precomputed = (
            cache is not None and args.cross_attention_cache_update_index is None
        )
        return self._attention_residual(
            x,
            self.cross_attention,
            self.cross_attention_layer_norm,
            args.training,
            args.return_attention_scores,
            value=None if precomputed else args.encoder_sequence,
            value_mask=to_bool(args.encoder_padding),
            attention_mask=args.encoder_attention_mask,
            attention_bias=args.encoder_attention_bias,
            cache=cache,
            cache_update_index=args.cross_attention_cache_update_index,
        )

    def get_empty_self_attention_cache(self, batch_size, max_length, dtype=None):
        """An all-zeros self-attention cache for step-by-step decoding.

        Args:
            batch_size: int. Batch size.
            max_length: int. Number of positions the cache holds.
            dtype: dtype of the cache. Defaults to the compute dtype.

        Returns:
            Zeros `(batch_size, 2, num_key_value_heads, max_length, key_dim)`;
            see `keras_attn.MultiHeadAttention.get_empty_cache`.

        Example:
        >>> decoder = keras_attn.TransformerDecoder(intermediate_dim=32, num_heads=2)
        >>> x = np.random.rand(1, 4, 8).astype("float32")
        >>> full = keras.ops.convert_to_numpy(decoder(x))
        >>> cache = decoder.get_empty_self_attention_cache(1, max_length=4)
        >>> last, cache = decoder(x[:, :3], self_attention_cache=cache,
        ...                       self_attention_cache_update_index=0)
        >>> step, cache = decoder(x[:, 3:], self_attention_cache=cache,
        ...                       self_attention_cache_update_index=3)
        >>> bool(np.allclose(keras.ops.convert_to_numpy(step), full[:, 3:], atol=1e-5))
        True
        """
        if not self.built:
            raise ValueError(
                f"{self.name} must be built (called once) before it makes a cache."
            )
        return self.self_attention.get_empty_cache(batch_size, max_length, dtype)

    def compute_cross_attention_cache(self, encoder_sequence):
        """The cross-attention keys and values of `encoder_sequence`, computed once.

        Args:
            encoder_sequence: float tensor `(batch, source_length, source_width)`.

        Returns:
            Tensor `(batch, 2, num_key_value_heads, source_length, key_dim)`, to
            pass as `cross_attention_cache` at every step.

        Example:
        >>> decoder = keras_attn.TransformerDecoder(intermediate_dim=32, num_heads=2)
        >>> source = np.random.rand(1, 6, 8).astype("float32")
        >>> _ = decoder(np.zeros((1, 2, 8)), source)
        >>> tuple(decoder.compute_cross_attention_cache(source).shape)
        (1, 2, 2, 6, 4)
        """
        if not self.built or not self._has_cross_attention:
            raise ValueError(
                f"{self.name} has no cross-attention: it must first be called "
                "with an `encoder_sequence`."
            )
        return self.cross_attention.compute_cache(encoder_sequence)

    def _attention_layers(self):
        cross = [self.cross_attention] if self._has_cross_attention else []
        return [self.self_attention] + cross

    # --- Checks ---------------------------------------------------------------

    def _check_call(self, args):
        """Every argument of a call, before anything is computed."""
        self._check_sequence(
            "decoder_sequence", args.decoder_sequence, args.return_attention_scores
        )
        check_bool("use_causal_mask", args.use_causal_mask)
        batch, target = args.decoder_sequence.shape[:2]
        keys = self._check_self_attention_cache(args, batch, target)
        check_mask("decoder_padding_mask", args.decoder_padding_mask, (batch, keys))
        check_mask(
            "decoder_attention_mask", args.decoder_attention_mask, (batch, target, keys)
        )
        check_broadcastable(
            "decoder_attention_bias",
            args.decoder_attention_bias,
            (batch, self.num_heads, target, keys),
            "(batch, num_heads, target_length, key_length)",
        )
        check_positions(args.positions, batch, target, self.rope_max_wavelength)
        if self._has_cross_attention:
            self._check_cross_attention(args, batch, target)
        else:
            self._check_no_cross_attention(args)

    def _check_self_attention_cache(self, args, batch, target):
        """Check the cache and its index; return the number of keys."""
        cache, index = args.self_attention_cache, args.self_attention_cache_update_index
        if (cache is None) != (index is None):
            raise ValueError(
                "`self_attention_cache` and `self_attention_cache_update_index` "
                f"go together. Received: self_attention_cache={_describe(cache)}, "
                f"self_attention_cache_update_index={index}."
            )
        if cache is None:
            return target
        check_cache(self.self_attention, cache, batch, "self_attention_cache")
        check_index("self_attention_cache_update_index", index, target, cache.shape[3])
        return cache.shape[3]

    def _check_cross_attention(self, args, batch, target):
        cache, index = (
            args.cross_attention_cache,
            args.cross_attention_cache_update_index,
        )
        sequence = args.encoder_sequence
        if sequence is None and (cache is None or index is not None):
            raise ValueError(
                f"{self.name} was built with cross-attention (its first call "
                "had an `encoder_sequence`), so every call needs one: call it "
                "as `decoder(decoder_sequence, encoder_sequence)`. "
                "Received: encoder_sequence=None."
            )
        if sequence is not None:
            check_rank("encoder_sequence", sequence.shape, 3, "(batch, length, width)")
            check_float("encoder_sequence", sequence)
            check_width(
                "encoder_sequence",
                sequence.shape,
                self.cross_attention._widths["value"],
            )
        source = None if sequence is None else sequence.shape[1]
        if index is not None and cache is None:
            raise ValueError(
                "`cross_attention_cache_update_index` needs a "
                "`cross_attention_cache`. Received: cross_attention_cache=None, "
                f"cross_attention_cache_update_index={index}."
            )
        if cache is not None:
            check_cache(self.cross_attention, cache, batch, "cross_attention_cache")
            if index is not None:
                check_index(
                    "cross_attention_cache_update_index", index, source, cache.shape[3]
                )
            source = cache.shape[3]
        check_mask("encoder_padding_mask", args.encoder_padding_mask, (batch, source))
        check_mask(
            "encoder_attention_mask",
            args.encoder_attention_mask,
            (batch, target, source),
        )
        check_broadcastable(
            "encoder_attention_bias",
            args.encoder_attention_bias,
            (batch, self.num_heads, target, source),
            "(batch, num_heads, target_length, source_length)",
        )

    def _check_no_cross_attention(self, args):
        if args.encoder_sequence is not None:
            raise ValueError(
                f"{self.name} was built as a decoder-only block (its first call "
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
                    f"block has none. Received: {name}={_describe(value)}."
                )

    # --- Keras machinery ------------------------------------------------------

    def compute_output_shape(self, decoder_sequence_shape, encoder_sequence_shape=None):
        return tuple(decoder_sequence_shape)

    def compute_output_spec(self, *args, **kwargs):
        args = DecoderCall(*args, **kwargs)  # the arguments of `call`
        self._check_call(args)
        decoder_sequence = args.decoder_sequence
        self_attention_cache = args.self_attention_cache
        dtype = self.compute_dtype
        batch, target = decoder_sequence.shape[:2]
        keys = target if self_attention_cache is None else self_attention_cache.shape[3]
        scores = [(batch, self.num_heads, target, keys)]
        caches = [self_attention_cache]
        if self._has_cross_attention:
            source, cross = self._cross_spec(args, batch)
            scores.append((batch, self.num_heads, target, source))
            caches.append(cross)
        outputs = [keras.KerasTensor(decoder_sequence.shape, dtype=dtype)]
        if args.return_attention_scores:
            outputs += [keras.KerasTensor(shape, dtype=dtype) for shape in scores]
        if self_attention_cache is not None:
            outputs += [keras.KerasTensor(c.shape, dtype=c.dtype) for c in caches]
        return outputs[0] if len(outputs) == 1 else tuple(outputs)

    def _cross_spec(self, args, batch):
        """The number of cross-attention keys and the cross cache's spec."""
        cache = args.cross_attention_cache
        if cache is not None:
            return cache.shape[3], cache
        source = args.encoder_sequence.shape[1]
        attention = self.cross_attention
        shape = (batch, 2, attention._kv_heads, source, attention._head_dim)
        return source, keras.KerasTensor(shape, dtype=self.compute_dtype)


_CROSS_ATTENTION_ARGUMENTS = (
    "encoder_padding_mask",
    "encoder_attention_mask",
    "encoder_attention_bias",
    "cross_attention_cache",
    "cross_attention_cache_update_index",
)


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


def _describe(value):
    return "None" if value is None else f"tensor of shape {tuple(value.shape)}"
