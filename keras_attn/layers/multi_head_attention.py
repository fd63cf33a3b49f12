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
from keras_attn.cache import DenseCache, empty_cache
from keras_attn.cache.dense import written
from keras_attn.layers._attention_axes import AttentionAxes
from keras_attn.layers._attention_call import (
    AttentionCall,
    check_cacheable,
    check_call,
    check_heads,
    check_shapes,
)
from keras_attn.layers._attention_call import (
    cache_length as length,
)
from keras_attn.layers._docs import shared_docs
from keras_attn.layers._lean_call import call_sublayer
from keras_attn.layers._machinery import (
    ConfigCheck,
    dtype_config,
    enable_lora,
    keras_objects_config,
    leaf_dtype,
    set_keras_objects,
)
from keras_attn.layers._options import AttentionOptions
from keras_attn.layers._projections import (
    head_norm,
    output_projection,
    project,
    projection,
)
from keras_attn.ops.attention import attend
from keras_attn.ops.plan import fused_limits, refuse_flash
from keras_attn.ops.positions import rotate


@keras.saving.register_keras_serializable(package="keras_attn")
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
        num_heads: int. Number of query heads.
        key_dim: int. Per-head width of queries and keys. Defaults to the query
            width // `num_heads` (which must then divide it).
        value_dim: int. Per-head width of values. Defaults to `key_dim`.
        dropout: float in [0, 1). Dropout on the attention weights in training.
            Defaults to `0.0`.
        use_bias: bool. Whether the projections have biases. Defaults to `True`.
        output_shape: int or tuple of ints. Shape of each output position.
            Defaults to the query width.
        attention_axes: int or tuple of ints. The axes of inputs of rank >= 3
            that attention runs over (the others act as batch axes). Defaults
            to every axis between the batch and the feature axis.
        sliding_window: int >= 1. Query `i` attends only to keys `j` with
            `|i - j| < sliding_window`; with `use_causal_mask=True` this is
            the causal sliding window of Mistral. Defaults to `None`.
        flash_attention: `None` (fused kernels where they compute the same,
            none after `keras.config.disable_flash_attention()`, as in Keras'
            layer), `True` (require a fused kernel, whatever Keras' switch
            says: raises with `dropout`,
            `logit_soft_cap`, `return_attention_scores=True`, and where the
            backend has none for the inputs; on PyTorch, any of torch's
            fused kernels, not its composite one) or `False` (always the explicit
            path, in chunks for long sequences). Defaults to `None`.
        kernel_initializer: initializer of the kernels. Defaults to
            `"glorot_uniform"` (fans of the 2-D projection matrices).
        bias_initializer: initializer of the biases. Defaults to `"zeros"`.
        kernel_regularizer: optional regularizer of the kernels.
        bias_regularizer: optional regularizer of the biases.
        activity_regularizer: optional regularizer of the output.
        kernel_constraint: optional constraint of the kernels.
        bias_constraint: optional constraint of the biases.
        use_gate: bool. Multiply the attention output by a sigmoid gate
            projected from the query (Qiu et al. 2025, arXiv 2505.06708), as
            Keras does. Defaults to `False`.
        seed: optional int. Seed of the attention dropout.
        num_key_value_heads: int, keyword only. Key/value heads for
            grouped-query attention; must divide `num_heads`. `1` is
            multi-query attention. Defaults to `num_heads`.
        output_dim: int, keyword only. The same as an int `output_shape` (the
            name of keras_attn 0.1).
        rope_max_wavelength: float, keyword only. Rotate queries and keys by
            their positions after projection (rotary position embeddings, Su
            et al. 2021; `keras_attn.ops.rotary_embedding`) with this base.
            Needs inputs of rank 3 and an even `key_dim`. Defaults to `None`
            (no rotation).
        rope_scaling_factor: float, keyword only. Positions are divided by it
            (linear position interpolation). Defaults to `1.0`.
        rope_scaling: dict, keyword only. Hugging Face's `rope_scaling`, as
            keras-hub computes it: `{"rope_type": "linear", "factor": f}` (as
            `rope_scaling_factor=f`), `{"rope_type": "dynamic", "factor": f}`
            (static NTK-aware scaling), `{"rope_type": "yarn", "factor": f,
            "original_max_position_embeddings": n}` (and optionally
            `beta_fast`, `beta_slow`, `truncate`) or `{"rope_type": "llama3",
            "factor": f, "low_freq_factor": l, "high_freq_factor": h,
            "original_max_position_embeddings": n}`; see
            `keras_attn.ops.rotary_embedding`. Needs `rope_max_wavelength`;
            not with `rope_scaling_factor`. Saved with its defaults filled
            in. Defaults to `None`.
        normalize_qk: bool, keyword only. RMS-normalize queries and keys per
            head (sublayers `query_norm`, `key_norm`, Keras'
            `RMSNormalization`) before the rotation and the dot product, as in
            Gemma 3. Defaults to `False`.
        qk_norm_epsilon: float, keyword only. Epsilon of the QK-norms.
            Defaults to `1e-6`.
        logit_soft_cap: float, keyword only. Soft-cap the scaled logits to
            `cap * tanh(logits / cap)` before the softmax (Gemma 2); it runs on
            the explicit path. Defaults to `None`.
        attention_scale: float > 0, keyword only. The multiplier of the
            query-key logits, on every path (Gemma scales by `(query width /
            num_heads) ** -0.5` where its heads are wider). Defaults to
            `None`: `1 / sqrt(key_dim)`.
        attention_sinks: int >= 1, keyword only, with `sliding_window`. Key
            `j` is also visible where `j < attention_sinks`: with the causal
            mask, each query sees the first `attention_sinks` positions and
            the last `sliding_window` (StreamingLLM, Xiao et al. 2023;
            `keras_attn.ops.sliding_window_mask`). Left padding (the leading
            keys the padding mask masks out) does not count: a left-padded
            row's sinks are its first real keys; with `segment_ids`, each
            segment's first keys. Defaults to `None`.
        **kwargs: Base layer arguments (`name`, `dtype`, ...).

    Call arguments:
        query: float tensor `(batch, query_length, query_width)`, or of higher
            rank with `attention_axes`.
        value: optional float tensor `(batch, key_length, value_width)`.
            Defaults to `query` (self-attention).
        key: optional float tensor `(batch, key_length, key_width)`. Defaults to
            `value`.
        query_mask: optional bool `(batch, query_length)`; filled in by Keras from
            the query's Keras mask. It only sets the output's mask.
        value_mask: optional bool `(batch, key_length)`, True for keys that may be
            attended to; filled in by Keras from the value's Keras mask.
        key_mask: optional bool `(batch, key_length)`, combined with `value_mask`.
        attention_mask: optional bool `(batch, query_length, key_length)` or
            broadcastable (rank 2 to 4), True where attention is allowed. For
            inputs of higher rank, `(batch, *batch axes, *query attention axes,
            *key attention axes)`.
        return_attention_scores: bool. Also return the attention weights.
            Defaults to `False`.
        training: bool. Whether dropout is active.
        use_causal_mask: bool. Query `i` may only attend to keys `j <= i` (over
            the flattened attention axes). Defaults to `False`.
        attention_bias: optional float tensor broadcastable to
            `(batch, num_heads, query_length, key_length)`, added to the scaled
            logits (ALiBi: `keras_attn.ops.alibi_bias`; T5 relative biases).
            Inputs of rank 3 only.
        cache: optional key/value cache `(batch, 2, num_key_value_heads,
            cache_length, key_dim)` (see `get_empty_cache`, `compute_cache`).
            Inputs of rank 3 only.
        cache_update_index: optional int or scalar int tensor: write the new
            keys and values into `cache` from this position; the queries sit
            there too. Without it, `cache` holds precomputed keys and values.
        positions: optional int tensor `(query_length,)` or
            `(batch, query_length)`: the rotary positions of the queries (and,
            in self-attention, of the new keys), e.g. per row for left-padded
            prompts. Defaults to `cache_update_index` (or 0) onwards. For
            self-attention only (no `value`, or `value` the query itself):
            keys of another sequence sit at `cache_update_index` (or 0)
            onwards. Needs `rope_max_wavelength`.
        segment_ids: optional int `(batch, query_length)`: packed sequences
            (several documents in one row). A segment is a contiguous run
            of equal ids (an id that comes back later starts a new
            document). A token attends only to tokens of its own segment
            (ANDed with every other mask), and its rotary position counts
            from its segment's start (`keras_attn.ops.segment_positions`;
            explicit `positions` win). Padding is not special-cased (mask it
            with a padding mask). Self-attention without a `cache` only.
            Long sequences go in chunks, memory linear in the length,
            except with `flash_attention=True`, which folds their `(batch,
            1, T, T)` mask into the fused kernel's: quadratic memory.
        mask: filled in by Keras with the query's Keras mask when the query is
            the only tensor argument (self-attention); in self-attention it masks
            the keys as `value_mask` does.

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
        self._build_sublayers(query_width, key_shape[-1], value_shape[-1])
        self.built = True

    def _build_sublayers(self, query_width, key_width, value_width):
        heads, kv_heads = self.num_heads, self._kv_heads
        # Keras' order (query, key, gate, value, output): the same weight list.
        self.query_dense = projection(self, "query", query_width, heads, self._head_dim)
        self.key_dense = projection(self, "key", key_width, kv_heads, self._head_dim)
        self.gate_dense = None
        if self.use_gate:
            self.gate_dense = projection(
                self, "gate", query_width, heads, self._value_head_dim, "sigmoid"
            )
        self.value_dense = projection(
            self, "value", value_width, kv_heads, self._value_head_dim
        )
        self.output_dense = output_projection(self, query_width)
        self.query_norm = self.key_norm = None
        if self.normalize_qk:  # after Keras' sublayers: the same weights first
            self.query_norm = head_norm(self, "query_norm")
            self.key_norm = head_norm(self, "key_norm")
        self._attention_dropout = keras.layers.Dropout(
            self.dropout,
            seed=self.seed,
            dtype=leaf_dtype(self, "dropout"),
            name="dropout",
        )

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
        mask, causal = call.merged_mask(
            self._axes, self.sliding_window, lengths, sinks=self.attention_sinks
        )
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

        Args:
            query: `(batch, length, width)`, the new tokens.
            cache: a `keras_attn.cache` object (`DenseCache`, `Int8Cache`,
                `RollingCache`).
            index: int32 scalar: the position of the first new token.
            positions: optional int `(batch, length)` or `(length,)`: the
                rotary positions of the new tokens (with
                `rope_max_wavelength`).
            mask: optional bool `(batch, length, slots)` (or broadcastable):
                the cache slots each new token sees, as `cache.mask(...)`
                gives them.
            calls: how sublayers are called (`SublayerCalls` of a decoding,
                which binds each once); defaults to `call_sublayer`.

        Returns:
            `(output (batch, length, output width), cache)`.
        """
        calls = calls or call_sublayer
        q = self._heads(self.query_dense, self.query_norm, query, positions, calls)
        if index is not None:
            k = self._heads(self.key_dense, self.key_norm, query, positions, calls)
            cache = cache.update(k, project(self.value_dense, query, calls), index)
        keys, values = cache.read(q.dtype)
        context = attend(
            q, keys, values,
            mask=mask,
            flash_attention=self.flash_attention,
            heads_major=True,
            logit_soft_cap=self.logit_soft_cap,
            scale=self.attention_scale,
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
        q = self._heads(
            self.query_dense, self.query_norm, fold(call.query), query_positions
        )
        cache, index = call.cache, call.cache_update_index
        if cache is not None and index is None:  # keys and values precomputed
            return (q, *_read(cache, q.dtype), cache)
        key, value = fold(call.key), fold(call.value)
        k = self._heads(self.key_dense, self.key_norm, key, key_positions)
        v = project(self.value_dense, value)
        if cache is None:
            return q, k, v, None
        if isinstance(cache, tuple):  # a cache object
            cache = cache.update(k, v, index)
        else:
            cache = written(cache, k, v, index)
        return (q, *_read(cache, q.dtype), cache)

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

    def _heads(self, dense, norm, x, positions, calls=call_sublayer):
        """Queries or keys `(B, T, heads, D)`: projected, RMS-normalized per
        head with `normalize_qk`, then rotated to `positions` with RoPE."""
        x = project(dense, x, calls)
        if norm is not None:
            x = calls(norm, x)
        if positions is not None:
            x = rotate(
                x,
                positions,
                self.rope_max_wavelength,
                self.rope_scaling_factor,
                self.rope_scaling,
            )
        return x

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
        dtype = dtype or self.compute_dtype
        cache = empty_cache(
            batch_size, self._kv_heads, max_length, self._head_dim, dtype
        )
        return cache.kv if isinstance(cache, DenseCache) else cache

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
        calls = calls or call_sublayer
        key = value if key is None else key
        positions = None  # the keys of another sequence sit at 0, 1, ...
        if self.rope_max_wavelength is not None:
            positions = ops.arange(0, ops.shape(key)[1], dtype="int32")
        k = self._heads(self.key_dense, self.key_norm, key, positions, calls)
        v = project(self.value_dense, value, calls)
        return ops.transpose(ops.stack([k, v], axis=1), (0, 1, 3, 2, 4))

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
        projections = (self.query_dense, self.key_dense, self.gate_dense)
        projections += (self.value_dense, self.output_dense)
        return [p for p in projections if p is not None]

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
            key_shape = key.shape if cache is None else (key.shape[0], length(cache))
            axes = AttentionAxes(self.attention_axes, len(query.shape))
            scores = axes.scores_shape(query.shape, key_shape, self.num_heads)
            outputs += (keras.KerasTensor(scores, dtype=dtype),)
        if cache is not None:  # a tensor, or a cache object of tensors
            outputs += (keras.tree.map_structure(_spec, cache),)
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


_KERAS_OBJECTS = (
    "kernel_initializer",
    "bias_initializer",
    "kernel_regularizer",
    "bias_regularizer",
    "kernel_constraint",
    "bias_constraint",
)


def _spec(tensor):
    return keras.KerasTensor(tensor.shape, dtype=tensor.dtype)


def _read(cache, dtype):
    """A cache's keys and values `(B, K, S, D)` in `dtype`: a cache object's
    own, or a tensor's (Keras' form)."""
    return (cache if isinstance(cache, tuple) else DenseCache(cache)).read(dtype)
