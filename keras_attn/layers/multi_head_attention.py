"""Multi-head attention on Keras' EinsumDense projections, with grouped-query heads."""

import keras
from keras import ops

from keras_attn._checks import (
    check_output_shape,
    check_positive_float,
    check_positive_int,
    check_rank,
    check_rate,
    check_seed,
    check_size,
    check_width,
    normalize_attention_axes,
)
from keras_attn.layers import _attention_cache
from keras_attn.layers._attention_cache import check_cacheable
from keras_attn.layers._attention_call import (
    AttentionCall,
    check_call,
    check_heads,
    check_shapes,
)
from keras_attn.layers._docs import shared_docs
from keras_attn.layers._lean_call import call_sublayer
from keras_attn.layers._machinery import (
    ConfigCheck,
    dtype_config,
    enable_lora,
    keras_objects_config,
    set_keras_objects,
)
from keras_attn.layers._options import AttentionOptions
from keras_attn.layers._projections import build_sublayers, heads, project
from keras_attn.ops.attention import attend
from keras_attn.ops.plan import fused_limits, refuse_flash


@keras.saving.register_keras_serializable(package="keras_attn")
@shared_docs
class MultiHeadAttention(ConfigCheck, keras.layers.Layer):
    """Multi-head attention, softmax(QK^T / sqrt(d_k)) V per head, then W_O.

    As in Vaswani et al. (2017), with grouped-query attention
    (`num_key_value_heads`, Ainslie et al. 2023), a drop-in superset of
    `keras.layers.MultiHeadAttention`: the same constructor arguments in the
    same order, the same sublayers (`EinsumDense` `query`, `key`, `gate`,
    `value` and `attention_output`, exposed as `query_dense`, ...,
    `output_dense`) and so the same weights, so that `set_weights` moves
    weights between the two, and `model.quantize(...)`, `enable_lora` and
    `DTypePolicyMap` reach every projection. The attention plan
    (`keras_attn.ops.plan`, asked by `keras_attn.ops.dot_product_attention`)
    runs the attention in a fused kernel (torch's own
    `scaled_dot_product_attention` on PyTorch, with grouped heads unrepeated
    but in float32 on a GPU; `keras.ops.dot_product_attention` elsewhere) or
    in an explicit float32-softmax path, which goes in chunks of query rows
    (memory linear in the length) for long sequences where no fused kernel
    runs; all give the same numbers.

    Masks: a key may be attended to where the key/value padding mask (from the
    inputs' Keras masks or `value_mask`/`key_mask`), `attention_mask`, the
    causal mask and the sliding window all allow it. A query row that may
    attend to nothing outputs zeros before the output projection (so the output
    is the output bias). Differences from Keras' layer, on purpose:

    - The query's padding mask masks nothing: padded query positions are
      computed like the others (as in `torch.nn.MultiheadAttention`) and the
      output carries the query's Keras mask. Keras also masks those rows.
    - `key_dim` defaults to the query width // `num_heads`, and `value` to
      `query` (self-attention).
    - Kernels are initialized with the fans of the matrices they are
      (`MatrixInitializer`), not those Keras reads from a rank-3 shape.
    - `activity_regularizer` applies to the layer's output (Keras applies it
      to each projection).
    - Bad arguments raise `TypeError` for wrong types, `ValueError` for wrong
      values.
    - On TensorFlow, heads of width 1 with biases raise a `ValueError` when
      the length equals the number of heads: Keras 3.15 adds such a bias
      along the positions there, and its layer gives wrong numbers.

    Args:
        {attention_arguments}

    Call arguments:
        {attention_call_arguments}
    Returns:
        `output` `(batch, query_length, *output_shape)`, carrying the query's
        Keras mask; with `return_attention_scores=True`, `(output, scores)`,
        where `scores` `(batch, num_heads, query_length, key_length)` are the
        softmax weights before dropout (for higher ranks, `(batch, *batch axes,
        num_heads, *query attention axes, *key attention axes)`); with a
        `cache`, the updated cache is appended: `(output, cache)` or
        `(output, scores, cache)`.

    Example:
    >>> attention = keras_attn.MultiHeadAttention(num_heads=2)
    >>> x = np.random.rand(3, 5, 8).astype("float32")
    >>> output, scores = attention(x, use_causal_mask=True,
    ...                            return_attention_scores=True)
    >>> tuple(output.shape), tuple(scores.shape)
    ((3, 5, 8), (3, 2, 5, 5))
    >>> mha = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4)
    >>> _ = mha(x, x)
    >>> attention.set_weights(mha.get_weights())  # the same weights
    >>> ours, theirs = (keras.ops.convert_to_numpy(l(x, x)) for l in (attention, mha))
    >>> bool(np.allclose(ours, theirs, atol=1e-6))
    True
    """

    # Taken through `**kwargs` (their defaults: `AttentionOptions`), the ones
    # Keras' layer has in Keras' positions.
    keyword_arguments = AttentionOptions.names()

    def __init__(
        self,
        num_heads,
        key_dim=None,
        value_dim=None,
        dropout=0.0,
        use_bias=True,
        output_shape=None,
        attention_axes=None,
        sliding_window=None,
        flash_attention=None,
        kernel_initializer="glorot_uniform",
        bias_initializer="zeros",
        kernel_regularizer=None,
        bias_regularizer=None,
        activity_regularizer=None,
        kernel_constraint=None,
        bias_constraint=None,
        use_gate=False,
        seed=None,
        *,
        output_dim=None,
        qk_norm_epsilon=1e-6,
        **kwargs,
    ):
        num_heads = check_positive_int("num_heads", num_heads)
        dropout = check_rate("dropout", dropout)
        options = AttentionOptions.take(
            kwargs,
            num_heads,
            dropout,
            key_dim=key_dim,
            use_bias=use_bias,
            sliding_window=sliding_window,
            flash_attention=flash_attention,
            use_gate=use_gate,
        )
        super().__init__(activity_regularizer=activity_regularizer, **kwargs)
        self.num_heads, self.dropout = num_heads, dropout
        options.apply(self)
        self.value_dim = check_positive_int("value_dim", value_dim, allow_none=True)
        limits = fused_limits(key_width=key_dim, value_width=self.value_dim or key_dim)
        if self.flash_attention and limits:
            refuse_flash(limits, f"key_dim={key_dim}, value_dim={value_dim}")
        # As in Keras: a public `output_shape` would shadow what `summary()` shows.
        self._output_shape = check_output_shape(output_shape, output_dim)
        self.attention_axes = normalize_attention_axes(attention_axes)
        set_keras_objects(
            self,
            kernel_initializer=kernel_initializer,
            bias_initializer=bias_initializer,
            kernel_regularizer=kernel_regularizer,
            bias_regularizer=bias_regularizer,
            kernel_constraint=kernel_constraint,
            bias_constraint=bias_constraint,
        )
        self.seed = check_seed(seed)
        self.qk_norm_epsilon = check_positive_float("qk_norm_epsilon", qk_norm_epsilon)
        self.supports_masking = True

    # --- Building -------------------------------------------------------------

    def build(self, query_shape, value_shape=None, key_shape=None):
        value_shape = query_shape if value_shape is None else value_shape
        key_shape = value_shape if key_shape is None else key_shape
        axes = check_shapes(self, query_shape, value_shape, key_shape)
        query_width = query_shape[-1]
        check_heads(self, len(query_shape), query_width)
        self._axes = axes
        self._widths = {
            "query": query_width,
            "key": key_shape[-1],
            "value": value_shape[-1],
        }
        self._head_dim = self.key_dim or query_width // self.num_heads
        self._value_head_dim = self.value_dim or self._head_dim
        self._kv_heads = self.num_key_value_heads or self.num_heads
        build_sublayers(self, query_width, key_shape[-1], value_shape[-1])
        self.built = True

    # --- The call -------------------------------------------------------------

    def call(
        self,
        query,
        value=None,
        key=None,
        query_mask=None,
        value_mask=None,
        key_mask=None,
        attention_mask=None,
        return_attention_scores=False,
        training=None,
        use_causal_mask=False,
        attention_bias=None,
        cache=None,
        cache_update_index=None,
        positions=None,
        segment_ids=None,
        mask=None,
    ):
        call = AttentionCall(
            query, value, key, query_mask, value_mask, key_mask, attention_mask,
            return_attention_scores, training, use_causal_mask, attention_bias,
            cache, cache_update_index, positions, segment_ids, mask,
        )  # fmt: skip
        check_call(self, call)
        return self._attend(call)

    def call_unchecked(self, query, value=None, key=None, **kwargs):
        """`call` without its checks: for a caller that checked every
        argument it passes (the blocks, whose own call checks them once)."""
        return self._attend(AttentionCall(query, value, key, **kwargs))

    def _attend(self, call):
        """The attention of a checked call: projections, masks, the plan's
        kernel, the output projection."""
        q, k, v, cache = self._queries_keys_values(call)
        lengths = ops.shape(q)[1], ops.shape(k)[1 if cache is None else 2]
        # A band the keys' positions alone give goes to `attend` as it is.
        band = call.key_band(self.sliding_window, self.attention_sinks)
        window, sinks = (
            (None, None) if band else (self.sliding_window, self.attention_sinks)
        )
        mask, causal = call.merged_mask(self._axes, window, lengths, sinks=sinks)
        result = attend(
            q, k, v,
            mask=mask,
            bias=call.attention_bias,
            is_causal=causal,
            flash_attention=self.flash_attention,
            dropout=self._dropout(call.training),
            return_scores=call.return_attention_scores,
            heads_major=cache is not None,
            logit_soft_cap=self.logit_soft_cap,
            scale=self.attention_scale,
            segment_ids=None if call.segments is None else (call.segments,) * 2,
            sink_logits=self.sink_logits,
            band=band,
            training=call.training is True,
        )  # fmt: skip
        scores = None
        if call.return_attention_scores:
            result, scores = result
        return self._outputs(call, result, scores, cache)

    def decode_unchecked(
        self, query, cache, index=None, positions=None, mask=None, calls=None
    ):
        """One decoding step of attention over a cache object, unchecked:
        the twin of `call` for `keras_attn.generation.generate` and callers
        that checked what they pass (queries of the built width and compute
        dtype, a cache of this layer's heads).

        With `index`, self-attention: the keys and values of `query`
        (rotated to `positions`) are written into `cache` at `index`, then
        attended over; without, `cache` holds another sequence's keys and
        values (cross-attention, `compute_cache`), and nothing is written.

        `query`: `(batch, length, width)`, the new tokens; `cache`: a
        `keras_attn.cache` object; `index`: int32 scalar (or the int 0 of a
        prefill), the position of the first new token; `positions`: their
        rotary positions (`(batch, length)` or `(length,)`); `mask`: the
        slots each sees (bool; with `index`, within the causal mask as
        `cache.mask`'s is, and where `cache.top_left_causal(index)` the
        chunked path skips the slots past each chunk's rows); `calls`: how
        sublayers are called (a decoding's `SublayerCalls`; by default
        `call_sublayer`). Returns `(output (batch, length, output width),
        cache)`.
        """
        calls = calls or call_sublayer
        q = heads(self, "query", query, positions, calls)
        if index is not None:
            k = heads(self, "key", query, positions, calls)
            cache = cache.update(k, project(self.value_dense, query, calls), index)
        keys, values = cache.read(q.dtype)
        context = attend(
            q, keys, values,
            mask=mask,
            within_causal=cache.top_left_causal(index),
            flash_attention=self.flash_attention,
            heads_major=True,
            logit_soft_cap=self.logit_soft_cap,
            scale=self.attention_scale,
            sink_logits=self.sink_logits,
        )  # fmt: skip
        if self.use_gate:
            context = context * project(self.gate_dense, query, calls)
        return calls(self.output_dense, context), cache

    def _dropout(self, training):
        """The dropout on the weights, in training with a rate > 0 (`training`
        passed explicitly: the layer may be called without `__call__`)."""
        if not (training and self.dropout):
            return None
        return lambda weights: self._attention_dropout(weights, training=True)

    def _queries_keys_values(self, call):
        """`(queries (B, T, H, D), keys, values, cache)`: projected,
        normalized and rotated; keys and values `(B, S, K, D)`, or heads-major
        `(B, K, S, D)` from the cache (updated where it is written): a cache
        object as it is, a tensor (Keras' form) as a `DenseCache`, written
        into a new tensor."""
        fold = self._axes.fold  # inputs of rank > 3 become sequences
        query_positions, key_positions = (
            call.rope_positions() if self.rope_max_wavelength else (None, None)
        )
        q = heads(self, "query", fold(call.query), query_positions)
        k, v, cache = _attention_cache.keys_and_values(
            self, fold(call.key), fold(call.value), call, key_positions, q.dtype
        )
        return q, k, v, cache

    def _outputs(self, call, context, scores, cache):
        """The output projection (and gate), unfolded; with the scores and the
        cache where asked for."""
        query = call.query
        if self.use_gate:
            context = context * project(self.gate_dense, self._axes.fold(query))
        output = call_sublayer(self.output_dense, context)
        output = self._axes.unfold(output, query, len(self._output_shape or (1,)))
        outputs = (output,)
        if call.return_attention_scores:
            outputs += (self._axes.unfold_scores(scores, query, call.key),)
        outputs += (cache,) if cache is not None else ()
        return outputs[0] if len(outputs) == 1 else outputs

    # --- Caches ---------------------------------------------------------------

    def get_empty_cache(self, batch_size, max_length, dtype=None):
        """An all-zeros key/value cache for step-by-step self-attention.

        Pass it as `cache` with `cache_update_index` (the position of the first
        query) and feed back the cache the call returns. Grouped-query attention
        caches only its `num_key_value_heads`. The layer must be built.

        Args:
            batch_size: int. Batch size.
            max_length: int. Number of positions the cache holds.
            dtype: dtype of the cache. Defaults to the layer's compute dtype.
                `"int8"` gives a `keras_attn.cache.Int8Cache` (keys and values
                quantized per token and head, with their scales).

        Returns:
            Zeros `(batch_size, 2, num_key_value_heads, max_length, key_dim)`:
            keys at index 0 of axis 1, values at index 1 (keras-hub's cached
            attention form, heads-major); for `"int8"`, an `Int8Cache`.

        Example:
        >>> attention = keras_attn.MultiHeadAttention(num_heads=4,
        ...                                           num_key_value_heads=2)
        >>> x = np.random.rand(1, 5, 16).astype("float32")
        >>> full = keras.ops.convert_to_numpy(attention(x, use_causal_mask=True))
        >>> cache = attention.get_empty_cache(batch_size=1, max_length=5)
        >>> steps = []
        >>> for i in range(5):
        ...     y, cache = attention(x[:, i : i + 1], use_causal_mask=True,
        ...                          cache=cache, cache_update_index=i)
        ...     steps.append(keras.ops.convert_to_numpy(y))
        >>> bool(np.allclose(np.concatenate(steps, axis=1), full, atol=1e-5))
        True
        """
        check_cacheable(self)
        check_size("batch_size", batch_size, minimum=1)
        check_positive_int("max_length", max_length)
        return _attention_cache.empty(
            self, batch_size, max_length, dtype or self.compute_dtype
        )

    def compute_cache(self, value, key=None):
        """Project `value` (and `key`) once into a key/value cache.

        For cross-attention, where the keys and values (the encoder output) do
        not change while a decoder generates: pass the result as `cache` with no
        `cache_update_index` at every step. The layer must be built.

        Args:
            value: float tensor `(batch, length, value_width)`.
            key: optional float tensor `(batch, length, key_width)`. Defaults to
                `value`.

        Returns:
            Tensor `(batch, 2, num_key_value_heads, length, key_dim)`: keys at
            index 0 of axis 1, values at index 1 (heads-major, so a step reads
            each head's keys contiguously).

        Example:
        >>> attention = keras_attn.MultiHeadAttention(num_heads=2)
        >>> query, memory = np.ones((1, 3, 8)), np.ones((1, 6, 8))
        >>> _ = attention(query, memory)
        >>> cache = attention.compute_cache(memory)
        >>> tuple(cache.shape)
        (1, 2, 2, 6, 4)
        """
        check_cacheable(self)
        value = ops.cast(value, self.compute_dtype)
        key = value if key is None else ops.cast(key, self.compute_dtype)
        for name, tensor in (("value", value), ("key", key)):
            check_rank(name, tensor.shape, 3, "(batch, length, width)")
            check_width(name, tensor.shape, self._widths[name])
        return self.compute_cache_unchecked(value, key)

    def compute_cache_unchecked(self, value, key=None, calls=None):
        """`compute_cache` of inputs the caller checked, of the compute dtype."""
        key = value if key is None else key
        return _attention_cache.projected(self, value, key, calls or call_sublayer)

    # --- Keras machinery ------------------------------------------------------

    @shared_docs
    def enable_lora(
        self, rank, lora_alpha=None, a_initializer="he_uniform", b_initializer="zeros"
    ):
        """Low-rank adapters (Hu et al. 2021) on every projection; the rest frozen.

        Calls `enable_lora` of the `query`, `key`, `value`, `attention_output`
        (and `gate`) `EinsumDense` sublayers, then freezes every weight that is
        not an adapter (the kernels, as Keras does, and the biases): only the
        adapters train. Saving merges the adapters into the kernels (Keras'
        behaviour), so a reloaded model has the same outputs and no adapters;
        call `enable_lora` again to go on fine-tuning.

        Args:
            {lora_arguments}

        Example:
        >>> attention = keras_attn.MultiHeadAttention(num_heads=2)
        >>> _ = attention(np.zeros((1, 3, 8)))
        >>> attention.enable_lora(2)
        >>> sorted({w.path.split("/")[-1] for w in attention.trainable_weights})
        ['lora_kernel_a', 'lora_kernel_b']
        """
        enable_lora(
            self, self._lora_targets(), rank, lora_alpha, a_initializer, b_initializer
        )

    def _lora_targets(self):
        names = ("query", "key", "gate", "value", "output")
        return [p for n in names if (p := getattr(self, f"{n}_dense")) is not None]

    def compute_output_shape(self, query_shape, value_shape=None, key_shape=None):
        value_shape = query_shape if value_shape is None else value_shape
        key_shape = value_shape if key_shape is None else key_shape
        check_shapes(self, query_shape, value_shape, key_shape)
        return (*query_shape[:-1], *(self._output_shape or query_shape[-1:]))

    def compute_output_spec(self, *args, **kwargs):
        call = AttentionCall(*args, **kwargs)  # the arguments of `call`
        if self.built:
            check_call(self, call)
        query, key, cache = call.query, call.key, call.cache
        dtype = self.compute_dtype
        shape = self.compute_output_shape(query.shape, call.value.shape, key.shape)
        outputs = (keras.KerasTensor(shape, dtype=dtype),)
        if call.return_attention_scores:
            scores = call.scores_shape(self.attention_axes, self.num_heads)
            outputs += (keras.KerasTensor(scores, dtype=dtype),)
        if cache is not None:  # a tensor, or a cache object of tensors
            outputs += (_attention_cache.spec(cache),)
        return outputs[0] if len(outputs) == 1 else outputs

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "num_heads": self.num_heads,
                "value_dim": self.value_dim,
                "dropout": self.dropout,
                "output_shape": self._output_shape,
                "attention_axes": self.attention_axes,
                **keras_objects_config(self, _KERAS_OBJECTS),
                "seed": self.seed,
                "qk_norm_epsilon": self.qk_norm_epsilon,
                **AttentionOptions.config_of(self),
                "dtype": dtype_config(self),
            }
        )
        return config


_KERAS_OBJECTS = tuple(  # kernel_initializer, bias_initializer, ...
    f"{weight}_{kind}"
    for kind in ("initializer", "regularizer", "constraint")
    for weight in ("kernel", "bias")
)
