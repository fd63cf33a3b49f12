"""The Transformer decoder block: masked self-attention, cross-attention, FFN."""

import keras

from keras_attn.layers._block import TransformerBlock, first_mask, to_bool
from keras_attn.layers._utils import (
    check_float,
    check_index,
    check_mask,
    check_rank,
    check_width,
)


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
    `feedforward_intermediate_dense`, `feedforward_output_dense`,
    `feedforward_layer_norm`.

    Args:
        intermediate_dim: int. Hidden width of the feed-forward network.
        num_heads: int. Number of attention heads; must divide the input width
            unless `key_dim` is given.
        dropout: float in [0, 1). Dropout on the attention weights, the
            feed-forward hidden units and each residual branch. Defaults to `0.0`.
        activation: activation of the feed-forward network. Defaults to `"relu"`.
        layer_norm_epsilon: float > 0. Defaults to `1e-5`.
        normalize_first: bool. Pre-norm instead of post-norm. Defaults to
            `False`.
        key_dim: int. Per-head width. Defaults to width // `num_heads`.
        num_key_value_heads: int. Key/value heads for grouped-query attention;
            must divide `num_heads`. Defaults to `num_heads`.
        kernel_initializer: initializer of all kernels. Defaults to
            `"glorot_uniform"`.
        bias_initializer: initializer of all biases. Defaults to `"zeros"`.
        flash_attention: `None`, `True` or `False`; see
            `keras_attn.MultiHeadAttention`. Defaults to `None`.
        **kwargs: Base layer arguments (`name`, `dtype`, ...).

    Call arguments:
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
        use_causal_mask: bool. Position `i` attends only to positions `<= i` in
            self-attention. Defaults to `True`.
        training: bool. Whether dropout is active.
        return_attention_scores: bool. Also return the attention weights.
            Defaults to `False`.
        mask, decoder_sequence_mask, encoder_sequence_mask: filled in by Keras
            with the inputs' Keras masks; not passed by hand.

    Returns:
        Tensor of the decoder input's shape, carrying its mask. With
        `return_attention_scores=True`, a tuple `(outputs, self_attention_scores)`
        for a decoder-only block, or `(outputs, self_attention_scores,
        cross_attention_scores)` with an encoder; scores are
        `(batch, num_heads, target_length, key_length)`.

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
            "self_attention", decoder_sequence_shape
        )
        self._has_cross_attention = encoder_sequence_shape is not None
        if self._has_cross_attention:
            self.cross_attention, self.cross_attention_layer_norm = (
                self._build_attention(
                    "cross_attention", decoder_sequence_shape, encoder_sequence_shape
                )
            )
        self._build_feedforward(decoder_sequence_shape)
        self.built = True

    def call(
        self,
        decoder_sequence,
        encoder_sequence=None,
        decoder_padding_mask=None,
        decoder_attention_mask=None,
        encoder_padding_mask=None,
        encoder_attention_mask=None,
        use_causal_mask=True,
        training=None,
        return_attention_scores=False,
        self_attention_cache=None,
        self_attention_cache_update_index=None,
        cross_attention_cache=None,
        mask=None,
        decoder_sequence_mask=None,
        encoder_sequence_mask=None,
    ):
        self._check_call(
            decoder_sequence,
            encoder_sequence,
            decoder_padding_mask,
            decoder_attention_mask,
            encoder_padding_mask,
            encoder_attention_mask,
            self_attention_cache,
            self_attention_cache_update_index,
            cross_attention_cache,
        )
        if self_attention_cache is None:  # With a cache, keys are its positions.
            decoder_padding_mask = first_mask(
                decoder_padding_mask, decoder_sequence_mask, mask
            )
        x, self_scores, self_attention_cache = self._attention_residual(
            decoder_sequence,
            self.self_attention,
            self.self_attention_layer_norm,
            training,
            return_attention_scores,
            value_mask=to_bool(decoder_padding_mask),
            attention_mask=decoder_attention_mask,
            use_causal_mask=use_causal_mask,
            cache=self_attention_cache,
            cache_update_index=self_attention_cache_update_index,
        )
        scores, caches = (self_scores,), (self_attention_cache,)
        if self._has_cross_attention:
            if self_attention_cache is not None and cross_attention_cache is None:
                cross_attention_cache = self.cross_attention.compute_cache(
                    encoder_sequence
                )
            x, cross_scores, cross_attention_cache = self._attention_residual(
                x,
                self.cross_attention,
                self.cross_attention_layer_norm,
                training,
                return_attention_scores,
                value=None if cross_attention_cache is not None else encoder_sequence,
                value_mask=to_bool(
                    first_mask(encoder_padding_mask, encoder_sequence_mask)
                ),
                attention_mask=encoder_attention_mask,
                cache=cross_attention_cache,
            )
            scores, caches = scores + (cross_scores,), caches + (cross_attention_cache,)
        x = self._feedforward_residual(x, training)
        outputs = (x,) + (scores if return_attention_scores else ())
        outputs += caches if self_attention_cache is not None else ()
        return outputs[0] if len(outputs) == 1 else outputs

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
        >>> _ = decoder(np.zeros((1, 1, 8)), source)
        >>> tuple(decoder.compute_cross_attention_cache(source).shape)
        (1, 2, 2, 6, 4)
        """
        if not self.built or not self._has_cross_attention:
            raise ValueError(
                f"{self.name} has no cross-attention: it must first be called "
                "with an `encoder_sequence`."
            )
        return self.cross_attention.compute_cache(encoder_sequence)

    def _check_call(
        self,
        decoder_sequence,
        encoder_sequence,
        decoder_padding_mask,
        decoder_attention_mask,
        encoder_padding_mask,
        encoder_attention_mask,
        self_attention_cache,
        self_attention_cache_update_index,
        cross_attention_cache,
    ):
        self._check_width("decoder_sequence", decoder_sequence.shape)
        check_float("decoder_sequence", decoder_sequence)
        self._check_encoder_sequence(encoder_sequence, cross_attention_cache)
        batch, target = decoder_sequence.shape[0], decoder_sequence.shape[1]
        keys = target
        if self_attention_cache is not None:
            self.self_attention._check_cache(
                self_attention_cache, batch, "self_attention_cache"
            )
            keys = self_attention_cache.shape[3]
            if self_attention_cache_update_index is not None:
                check_index(
                    "self_attention_cache_update_index",
                    self_attention_cache_update_index,
                    target,
                    keys,
                )
        if (self_attention_cache is None) != (
            self_attention_cache_update_index is None
        ):
            raise ValueError(
                "`self_attention_cache` and `self_attention_cache_update_index` "
                "go together. Received: self_attention_cache="
                f"{_describe(self_attention_cache)}, "
                f"self_attention_cache_update_index={self_attention_cache_update_index}."
            )
        check_mask("decoder_padding_mask", decoder_padding_mask, (batch, keys))
        check_mask(
            "decoder_attention_mask", decoder_attention_mask, (batch, target, keys)
        )
        if not self._has_cross_attention:
            for name, value in (
                ("encoder_padding_mask", encoder_padding_mask),
                ("encoder_attention_mask", encoder_attention_mask),
                ("cross_attention_cache", cross_attention_cache),
            ):
                if value is not None:
                    raise ValueError(
                        f"`{name}` needs cross-attention, and this decoder-only "
                        f"block has none. Received: {name}={_describe(value)}."
                    )
            return
        if cross_attention_cache is not None:
            self.cross_attention._check_cache(
                cross_attention_cache, batch, "cross_attention_cache"
            )
            source = cross_attention_cache.shape[3]
        else:
            source = encoder_sequence.shape[1]
        check_mask("encoder_padding_mask", encoder_padding_mask, (batch, source))
        check_mask(
            "encoder_attention_mask", encoder_attention_mask, (batch, target, source)
        )

    def _check_encoder_sequence(self, encoder_sequence, cross_attention_cache):
        if self._has_cross_attention:
            if encoder_sequence is None and cross_attention_cache is None:
                raise ValueError(
                    f"{self.name} was built with cross-attention (its first call "
                    "had an `encoder_sequence`), so every call needs one: call it "
                    "as `decoder(decoder_sequence, encoder_sequence)`. "
                    "Received: encoder_sequence=None."
                )
            if encoder_sequence is not None:
                check_rank(
                    "encoder_sequence",
                    encoder_sequence.shape,
                    3,
                    "(batch, length, width)",
                )
                check_float("encoder_sequence", encoder_sequence)
                check_width(
                    "encoder_sequence",
                    encoder_sequence.shape,
                    self.cross_attention.value_kernel.shape[0],
                )
        elif encoder_sequence is not None:
            raise ValueError(
                f"{self.name} was built as a decoder-only block (its first call "
                "had no `encoder_sequence`), so it has no cross-attention: call "
                "it as `decoder(decoder_sequence)`, or use a new layer for an "
                "encoder-decoder model. Received: encoder_sequence.shape="
                f"{tuple(encoder_sequence.shape)}."
            )


def _describe(value):
    return "None" if value is None else f"tensor of shape {tuple(value.shape)}"
