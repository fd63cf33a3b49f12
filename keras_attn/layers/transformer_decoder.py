"""The Transformer decoder block: masked self-attention, cross-attention, FFN."""

import keras

from keras_attn.layers import _attention_cache, _self_attention
from keras_attn.layers._attention_cache import cache_length
from keras_attn.layers._block import TransformerBlock, to_bool
from keras_attn.layers._decoder_call import (
    DecoderCall,
    check_decoder_call,
    check_encoder_batch,
)
from keras_attn.layers._docs import shared_docs
from keras_attn.layers._lean_call import call_sublayer


@keras.saving.register_keras_serializable(package="keras_attn")
@shared_docs
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
    With `normalize_sublayer_outputs`, the norms of the sublayers' outputs
    follow their own: `self_attention_output_norm` after
    `self_attention_layer_norm`, `cross_attention_output_norm` after
    `cross_attention_layer_norm`, and `feedforward_output_norm` last. The
    norms are `RMSNormalization`s with `normalization="rms_norm"`; each
    attention has `query_norm` and `key_norm` with `normalize_qk`.

    Args:
        {block_arguments}
        use_gate: bool, keyword only. A sigmoid gate on each attention output;
            see `keras_attn.MultiHeadAttention`. Defaults to `False`.
        sliding_window: int, keyword only. In self-attention, each position
            attends only to positions less than `sliding_window` away (with
            the causal mask: itself and the `sliding_window - 1` before it).
            Defaults to `None`.
        {attention_sinks}
        {block_options}
        self_attention: optional `keras_attn.layers.MultiHeadLatentAttention`
            (or its `keras.saving.serialize_keras_object` dict), keyword
            only: the self-attention, instead of a `MultiHeadAttention` of
            the block's options. The block builds a clone of it named
            `self_attention`, and refuses the rotary, sliding-window and
            sink options (the layer has its own) and, without an encoder,
            the other attention options, which nothing would read.
            `num_heads` must be the layer's. Defaults to `None`.

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
        segment_ids: optional int `(batch, target_length)`: packed sequences
            in self-attention, a segment a contiguous run of equal ids. A
            token attends only to tokens of its own segment, and rotary
            positions restart at each segment's start (explicit `positions`
            win); see `keras_attn.MultiHeadAttention` (and its remark on
            `flash_attention=True`). Not with a cache, nor with an
            `encoder_sequence` (cross-attention would need the encoder's
            segment ids, which this release does not take: a `ValueError`);
            padding is not special-cased.
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

    def __init__(
        self, intermediate_dim, num_heads, *args, self_attention=None, **kwargs
    ):
        super().__init__(intermediate_dim, num_heads, *args, **kwargs)
        self._self_attention = _self_attention.resolve(self, self_attention)

    def build(self, decoder_sequence_shape, encoder_sequence_shape=None):
        self._check_width("decoder_sequence", decoder_sequence_shape)
        if encoder_sequence_shape is not None:  # before any sublayer is built
            check_encoder_batch(decoder_sequence_shape, encoder_sequence_shape)
        (
            self.self_attention,
            self.self_attention_layer_norm,
            self.self_attention_output_norm,
        ) = self._build_self_attention(decoder_sequence_shape, encoder_sequence_shape)
        self._has_cross_attention = encoder_sequence_shape is not None
        if self._has_cross_attention:
            (
                self.cross_attention,
                self.cross_attention_layer_norm,
                self.cross_attention_output_norm,
            ) = self._build_attention(
                "cross_attention", decoder_sequence_shape, encoder_sequence_shape
            )
        self._build_feedforward(decoder_sequence_shape, norm_first=False)
        self.built = True

    def _build_self_attention(self, shape, encoder_sequence_shape):
        """The block's `MultiHeadAttention`, or a clone of its own
        `self_attention` layer; with their norms."""
        if self._self_attention is None:
            return self._build_attention(
                "self_attention",
                shape,
                window=self.sliding_window,
                sinks=self.attention_sinks,
            )
        if encoder_sequence_shape is None:
            _self_attention.refuse_cross_options(self)
        attention = _self_attention.build(self, self._self_attention, shape)
        norm = self._build_norm("self_attention_layer_norm", shape)
        return attention, norm, self._build_output_norm("self_attention", shape)

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
        segment_ids=None,
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
            decoder_attention_bias, encoder_attention_bias, positions,
            segment_ids, mask, decoder_sequence_mask, encoder_sequence_mask,
        )  # fmt: skip
        check_decoder_call(self, args)
        x, self_scores, self_attention_cache = self._attention_residual(
            decoder_sequence,
            self.self_attention,
            self._norms("self_attention"),
            training,
            return_attention_scores,
            value_mask=to_bool(args.decoder_padding),
            attention_mask=decoder_attention_mask,
            attention_bias=decoder_attention_bias,
            use_causal_mask=use_causal_mask,
            cache=self_attention_cache,
            cache_update_index=self_attention_cache_update_index,
            positions=positions,
            segment_ids=segment_ids,
        )
        scores, caches = (self_scores,), (self_attention_cache,)
        if self._has_cross_attention:
            x, cross_scores, cross_attention_cache = self._cross_attention_residual(
                x, args
            )
            scores, caches = scores + (cross_scores,), caches + (cross_attention_cache,)
        padding = to_bool(args.decoder_padding)
        x = self._feedforward_residual(x, training, padding=padding)
        outputs = (x,) + (scores if return_attention_scores else ())
        outputs += caches if self_attention_cache is not None else ()
        return outputs[0] if len(outputs) == 1 else outputs

    def _cross_attention_residual(self, x, args):
        """Cross-attention into the encoder sequence, or into its cache."""
        cache = args.cross_attention_cache
        if args.self_attention_cache is not None and cache is None:
            cache = self.cross_attention.compute_cache_unchecked(args.encoder_sequence)
        precomputed = (
            cache is not None and args.cross_attention_cache_update_index is None
        )
        return self._attention_residual(
            x,
            self.cross_attention,
            self._norms("cross_attention"),
            args.training,
            args.return_attention_scores,
            value=None if precomputed else args.encoder_sequence,
            value_mask=to_bool(args.encoder_padding),
            attention_mask=args.encoder_attention_mask,
            attention_bias=args.encoder_attention_bias,
            cache=cache,
            cache_update_index=args.cross_attention_cache_update_index,
        )

    def decode_unchecked(
        self,
        decoder_sequence,
        cache,
        index,
        positions=None,
        mask=None,
        cross_cache=None,
        cross_mask=None,
        calls=None,
    ):
        """One decoding step of the block over its caches, unchecked: the
        twin of `call` with a self-attention cache, for
        `keras_attn.generation.generate` and callers that checked what they
        pass (see `MultiHeadAttention.decode_unchecked`). No dropout.

        Args:
            decoder_sequence: `(batch, length, width)`, the new tokens, at
                positions `index, ..., index + length - 1`.
            cache: the self-attention cache, a `keras_attn.cache` object.
            index: int32 scalar (or the Python int 0 of a prompt's
                prefill), the position of the first new token.
            positions: optional int `(batch, length)`: the new tokens'
                rotary positions (with `rope_max_wavelength`).
            mask: bool `(batch, length, slots)` (or broadcastable): the
                self-attention cache slots each new token sees, within the
                causal mask (`cache.mask(...)`).
            cross_cache: with cross-attention, the encoder output's keys and
                values (`DenseCache(compute_cross_attention_cache(...))`).
            cross_mask: optional bool `(batch, 1, source_length)`: the
                source positions that may be attended to.
            calls: how sublayers are called; see
                `MultiHeadAttention.decode_unchecked`.

        Returns:
            `(output (batch, length, width), cache)`.
        """
        calls = calls or call_sublayer
        x, norms = decoder_sequence, self._norms("self_attention")
        hidden = calls(norms[0], x) if self.normalize_first else x
        branch, cache = self.self_attention.decode_unchecked(
            hidden, cache, index, positions, mask, calls
        )
        x = self._add_residual(x, branch, norms, False, calls)
        if self._has_cross_attention:
            norms = self._norms("cross_attention")
            hidden = calls(norms[0], x) if self.normalize_first else x
            branch, _ = self.cross_attention.decode_unchecked(
                hidden, cross_cache, mask=cross_mask, calls=calls
            )
            x = self._add_residual(x, branch, norms, False, calls)
        return self._feedforward_residual(x, False, calls), cache

    def _norms(self, sublayer):
        """`(layer norm, output norm or None)` of `"self_attention"` or
        `"cross_attention"`."""
        return (
            getattr(self, f"{sublayer}_layer_norm"),
            getattr(self, f"{sublayer}_output_norm"),
        )

    def get_empty_self_attention_cache(self, batch_size, max_length, dtype=None):
        """An all-zeros self-attention cache for step-by-step decoding.

        Args:
            batch_size: int. Batch size.
            max_length: int. Number of positions the cache holds.
            dtype: dtype of the cache. Defaults to the compute dtype;
                `"int8"` gives a `keras_attn.cache.Int8Cache`.

        Returns:
            Zeros `(batch_size, 2, num_key_value_heads, max_length, key_dim)`
            (or an `Int8Cache`); see
            `keras_attn.MultiHeadAttention.get_empty_cache`.

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

    # --- Keras machinery ------------------------------------------------------

    def compute_output_shape(self, decoder_sequence_shape, encoder_sequence_shape=None):
        return tuple(decoder_sequence_shape)

    def compute_output_spec(self, *args, **kwargs):
        args = DecoderCall(*args, **kwargs)  # the arguments of `call`
        check_decoder_call(self, args)
        decoder_sequence = args.decoder_sequence
        self_attention_cache = args.self_attention_cache
        dtype = self.compute_dtype
        batch, target = decoder_sequence.shape[:2]
        keys = (
            target
            if self_attention_cache is None
            else cache_length(self_attention_cache)
        )
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
            outputs += [_attention_cache.spec(c) for c in caches]
        return outputs[0] if len(outputs) == 1 else tuple(outputs)

    def get_config(self):
        config = super().get_config()
        config["self_attention"] = _self_attention.config_of(self._self_attention)
        return config

    def _cross_spec(self, args, batch):
        """The number of cross-attention keys and the cross cache's spec."""
        cache = args.cross_attention_cache
        if cache is not None:
            return cache_length(cache), cache
        source = args.encoder_sequence.shape[1]
        attention = self.cross_attention
        shape = (batch, 2, attention._kv_heads, source, attention._head_dim)
        return source, keras.KerasTensor(shape, dtype=self.compute_dtype)
