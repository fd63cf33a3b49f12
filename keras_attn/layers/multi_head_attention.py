"""Multi-head attention on Keras' EinsumDense projections, with grouped-query heads."""

import math

import keras
from keras import ops

from keras_attn import ops as attn_ops
from keras_attn.layers._attention_axes import AttentionAxes, normalize_attention_axes
from keras_attn.layers._utils import (
    CallArguments,
    ConfigCheck,
    check_bool,
    check_broadcastable,
    check_flash_attention,
    check_float,
    check_index,
    check_key_value_heads,
    check_mask,
    check_modern_attention,
    check_positions,
    check_positive_float,
    check_positive_int,
    check_rank,
    check_rate,
    check_seed,
    check_shape_argument,
    check_width,
    clone_initializer,
    dtype_config,
    enable_lora,
    get_keras_object,
    leaf_dtype,
)


@keras.saving.register_keras_serializable(package="keras_attn")
class MatrixInitializer(keras.initializers.Initializer):
    """Draws a projection kernel as the 2-D matrix it multiplies as, then reshapes.

    Keras' variance-scaling initializers read the fans of a rank-3 kernel
    `(width, heads, dim)` as if it were a convolution; attention kernels are
    matrices `(width, heads * dim)` or `(heads * dim, width)`, so they are
    drawn as such.

    Args:
        initializer: the Keras initializer of the matrix.
        fan_in_axes: int. How many leading kernel axes are the matrix's rows.
    """

    def __init__(self, initializer, fan_in_axes=1):
        self.initializer = keras.initializers.get(initializer)
        self.fan_in_axes = fan_in_axes

    def __call__(self, shape, dtype=None):
        rows = math.prod(shape[: self.fan_in_axes])
        matrix = self.initializer((rows, math.prod(shape) // rows), dtype=dtype)
        return ops.reshape(matrix, shape)

    def get_config(self):
        return {
            "initializer": keras.initializers.serialize(self.initializer),
            "fan_in_axes": self.fan_in_axes,
        }


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
    `DTypePolicyMap` reach every projection. One dispatcher
    (`keras_attn.ops.dot_product_attention`) runs the attention in a fused
    kernel (torch's own `scaled_dot_product_attention` on PyTorch, with
    grouped heads unrepeated; `keras.ops.dot_product_attention` elsewhere) or
    in an explicit float32-softmax path, which goes in chunks of
    query rows (memory linear in the length) for long sequences where no
    fused kernel runs; all give the same numbers.

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
        flash_attention: `None` (fused kernels where they compute the same),
            `True` (require a fused kernel: raises with `dropout`,
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
        normalize_qk: bool, keyword only. RMS-normalize queries and keys per
            head (sublayers `query_norm`, `key_norm`, Keras'
            `RMSNormalization`) before the rotation and the dot product, as in
            Gemma 3. Defaults to `False`.
        qk_norm_epsilon: float, keyword only. Epsilon of the QK-norms.
            Defaults to `1e-6`.
        logit_soft_cap: float, keyword only. Soft-cap the scaled logits to
            `cap * tanh(logits / cap)` before the softmax (Gemma 2); it runs on
            the explicit path. Defaults to `None`.
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
        num_key_value_heads=None,
        output_dim=None,
        rope_max_wavelength=None,
        rope_scaling_factor=1.0,
        normalize_qk=False,
        qk_norm_epsilon=1e-6,
        logit_soft_cap=None,
        **kwargs,
    ):
        super().__init__(activity_regularizer=activity_regularizer, **kwargs)
        self.num_heads = check_positive_int("num_heads", num_heads)
        self.key_dim = check_positive_int("key_dim", key_dim, allow_none=True)
        self.value_dim = check_positive_int("value_dim", value_dim, allow_none=True)
        self.dropout = check_rate("dropout", dropout)
        self.use_bias = check_bool("use_bias", use_bias)
        # As in Keras: a public `output_shape` would shadow what `summary()` shows.
        self._output_shape = _output_shape(output_shape, output_dim)
        self.attention_axes = normalize_attention_axes(attention_axes)
        self.sliding_window = check_positive_int(
            "sliding_window", sliding_window, allow_none=True
        )
        self.flash_attention = check_bool(
            "flash_attention", flash_attention, allow_none=True
        )
        self.kernel_initializer = get_keras_object(
            "kernel_initializer", keras.initializers.get, kernel_initializer
        )
        self.bias_initializer = get_keras_object(
            "bias_initializer", keras.initializers.get, bias_initializer
        )
        self.kernel_regularizer = get_keras_object(
            "kernel_regularizer", keras.regularizers.get, kernel_regularizer
        )
        self.bias_regularizer = get_keras_object(
            "bias_regularizer", keras.regularizers.get, bias_regularizer
        )
        self.kernel_constraint = get_keras_object(
            "kernel_constraint", keras.constraints.get, kernel_constraint
        )
        self.bias_constraint = get_keras_object(
            "bias_constraint", keras.constraints.get, bias_constraint
        )
        self.use_gate = check_bool("use_gate", use_gate)
        self.seed = check_seed(seed)
        self.num_key_value_heads = check_key_value_heads(
            self.num_heads, num_key_value_heads
        )
        options = check_modern_attention(
            rope_max_wavelength, rope_scaling_factor, normalize_qk, logit_soft_cap
        )
        for name, value in options.items():
            setattr(self, name, value)
        self.qk_norm_epsilon = check_positive_float("qk_norm_epsilon", qk_norm_epsilon)
        check_flash_attention(self.flash_attention, self.dropout, self.logit_soft_cap)
        if self.flash_attention and _differ(self.value_dim or key_dim, key_dim):
            raise ValueError(
                "`flash_attention=True` needs the fused flash kernel, which needs "
                "values of the keys' width. Received: flash_attention=True, "
                f"key_dim={key_dim}, value_dim={value_dim}."
            )
        self.supports_masking = True
        # Set by a block that checks the inputs it passes on (each tensor is
        # checked once, in the layer the user called).
        self._inputs_checked_by_caller = False

    # --- Building -------------------------------------------------------------

    def build(self, query_shape, value_shape=None, key_shape=None):
        value_shape = query_shape if value_shape is None else value_shape
        key_shape = value_shape if key_shape is None else key_shape
        axes = self._check_shapes(query_shape, value_shape, key_shape)
        query_width = query_shape[-1]
        if self.key_dim is None and query_width % self.num_heads:
            raise ValueError(
                "`num_heads` must divide the query width when `key_dim` is not "
                f"given. Received: num_heads={self.num_heads}, "
                f"query width={query_width}. Pass `key_dim` explicitly or choose "
                "a divisor of the width."
            )
        self._check_rope(
            rank=len(query_shape), key_dim=self.key_dim or query_width // self.num_heads
        )
        self._axes = axes
        self._widths = {
            "query": query_width,
            "key": key_shape[-1],
            "value": value_shape[-1],
        }
        self._head_dim = self.key_dim or query_width // self.num_heads
        self._value_head_dim = self.value_dim or self._head_dim
        self._kv_heads = self.num_key_value_heads or self.num_heads
        heads, kv_heads = self.num_heads, self._kv_heads
        # Keras' order (query, key, gate, value, output): the same weight list.
        self.query_dense = self._projection("query", query_width, heads, self._head_dim)
        self.key_dense = self._projection(
            "key", key_shape[-1], kv_heads, self._head_dim
        )
        self.gate_dense = None
        if self.use_gate:
            self.gate_dense = self._projection(
                "gate", query_width, heads, self._value_head_dim, "sigmoid"
            )
        self.value_dense = self._projection(
            "value", value_shape[-1], kv_heads, self._value_head_dim
        )
        self.output_dense = self._output_projection(query_width)
        self.query_norm = self.key_norm = None
        if self.normalize_qk:  # after Keras' sublayers: the same weights first
            self.query_norm = self._head_norm("query_norm")
            self.key_norm = self._head_norm("key_norm")
        self._attention_dropout = keras.layers.Dropout(
            self.dropout,
            seed=self.seed,
            dtype=leaf_dtype(self, "dropout"),
            name="dropout",
        )
        self.built = True

    def _check_shapes(self, query_shape, value_shape, key_shape):
        """Raise unless the shapes fit together; return their `AttentionAxes`."""
        rank = len(query_shape)
        if rank < 3:
            raise ValueError(
                "`query` must have rank 3 or more, (batch, length, width) or "
                "(batch, *axes, width). "
                f"Received: query.shape={tuple(query_shape)}."
            )
        for name, shape in (("value", value_shape), ("key", key_shape)):
            check_rank(name, shape, rank, "the rank of `query`")
        if any(
            _differ(a, b)
            for a, b in zip(value_shape[1:-1], key_shape[1:-1], strict=True)
        ):
            raise ValueError(
                "All dimensions of `value` and `key`, except the last one, must "
                f"be equal. Received: value_shape={tuple(value_shape)}, "
                f"key_shape={tuple(key_shape)}."
            )
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
        axes = AttentionAxes(self.attention_axes, rank)
        if any(_differ(query_shape[a], value_shape[a]) for a in axes.batch):
            raise ValueError(
                "`query` and `value` must be equal on the axes that attention "
                f"does not run over, {list(axes.batch)}. Received: "
                f"query_shape={tuple(query_shape)}, value_shape={tuple(value_shape)}."
            )
        return axes

    def _check_rope(self, rank, key_dim):
        if self.rope_max_wavelength is None:
            return
        if rank != 3 or key_dim % 2:
            raise ValueError(
                "Rotary position embeddings (`rope_max_wavelength`) need inputs "
                "of rank 3, (batch, length, width), and an even `key_dim` "
                f"(channels rotate in pairs). Received: inputs of rank {rank}, "
                f"key_dim={key_dim}."
            )

    def _head_norm(self, name):
        """RMSNorm over each head's channels (QK-norm, as in Gemma 3)."""
        norm = keras.layers.RMSNormalization(
            epsilon=self.qk_norm_epsilon, dtype=leaf_dtype(self, name), name=name
        )
        norm.supports_masking = True  # per position, as the projections
        norm.build((None, None, None, self._head_dim))
        return norm

    def _sublayer_kwargs(self, name):
        return dict(
            kernel_initializer=MatrixInitializer(
                clone_initializer(self.kernel_initializer),
                fan_in_axes=2 if name == "attention_output" else 1,
            ),
            bias_initializer=clone_initializer(self.bias_initializer),
            kernel_regularizer=self.kernel_regularizer,
            bias_regularizer=self.bias_regularizer,
            kernel_constraint=self.kernel_constraint,
            bias_constraint=self.bias_constraint,
            dtype=leaf_dtype(self, name),
            name=name,
        )

    def _projection(self, name, width, heads, dim, activation=None):
        """`EinsumDense` `(B, T, width)` -> `(B, T, heads, dim)`.

        (The letters sort the contracted axes in memory order: `jnp.einsum`
        orders them alphabetically, and any other order makes XLA transpose
        the kernels and their gradients.)
        """
        dense = keras.layers.EinsumDense(
            "abc,cde->abde",
            output_shape=(None, heads, dim),
            bias_axes="de" if self.use_bias else None,
            activation=activation,
            **self._sublayer_kwargs(name),
        )
        # Position-wise: a padding mask holds for the outputs as for the inputs
        # (and Keras warns that a masked input would lose its mask otherwise).
        dense.supports_masking = True
        dense.build((None, None, width))
        return dense

    def _output_projection(self, query_width):
        """`EinsumDense` W_O: `(B, T, H, Dv)` -> `(B, T, *output_shape)`."""
        output_shape = self._output_shape or (query_width,)
        letters = "efghijklmnopqrstuvwxyz"[: len(output_shape)]
        dense = keras.layers.EinsumDense(
            f"abcd,cd{letters}->ab{letters}",
            output_shape=(None, *output_shape),
            bias_axes=letters if self.use_bias else None,
            **self._sublayer_kwargs("attention_output"),
        )
        dense.supports_masking = True  # position-wise, as the projections
        dense.build((None, None, self.num_heads, self._value_head_dim))
        return dense

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
        mask=None,
    ):
        value, key, value_mask, self_attention = self._resolve_inputs(
            query, value, key, value_mask, query_mask, mask, cache
        )
        if not self._inputs_checked_by_caller:
            self._check_call(CallArguments(locals()))
        fold = self._axes.fold  # inputs of rank > 3 become sequences
        query_positions, key_positions = self._rope_positions(
            query, key, positions, cache_update_index, self_attention
        )
        q = self._heads(self.query_dense, self.query_norm, fold(query), query_positions)
        k, v, cache = self._keys_and_values(
            fold(key), fold(value), cache, cache_update_index, key_positions
        )  # (B, S, K, D), or (B, K, S, D) from a cache
        lengths = ops.shape(q)[1], ops.shape(k)[1 if cache is None else 2]
        mask, causal = self._attention_mask(
            query, key, lengths, value_mask, key_mask, attention_mask,
            use_causal_mask, cache_update_index,
        )  # fmt: skip
        result = attn_ops.dot_product_attention(
            q, k, v,
            mask=mask,
            bias=attention_bias,
            is_causal=causal,
            flash_attention=self.flash_attention,
            dropout=self._attention_dropout if training and self.dropout else None,
            return_scores=return_attention_scores,
            heads_major=cache is not None,
            logit_soft_cap=self.logit_soft_cap,
        )  # fmt: skip
        context, scores = result if return_attention_scores else (result, None)
        if self.use_gate:
            context = context * self._project(self.gate_dense, fold(query))
        output = self._axes.unfold(
            self.output_dense(context), query, len(self._output_shape or (1,))
        )
        if scores is not None:
            scores = self._axes.unfold_scores(scores, query, key)
        outputs = (output,) + ((scores,) if return_attention_scores else ())
        outputs += (cache,) if cache is not None else ()
        return outputs[0] if len(outputs) == 1 else outputs

    def _heads(self, dense, norm, x, positions):
        """Queries or keys `(B, T, heads, D)`: projected, RMS-normalized per
        head with `normalize_qk`, then rotated to `positions` with RoPE."""
        x = self._project(dense, x)
        if norm is not None:
            x = norm(x)
        if positions is not None:
            x = attn_ops.rotary_embedding(
                x, positions, self.rope_max_wavelength, self.rope_scaling_factor
            )
        return x

    def _rope_positions(
        self, query, key, positions, cache_update_index, self_attention
    ):
        """The rotary positions of the queries and of the keys projected in
        this call; `(None, None)` without RoPE.

        Queries sit at `positions`, by default `cache_update_index` (or 0)
        onwards. In self-attention the new keys are the queries' tokens, at
        the same positions; the keys of another sequence count from the
        index (or 0) on their own.
        """
        if self.rope_max_wavelength is None:
            return None, None
        start = ops.cast(
            0 if cache_update_index is None else cache_update_index, "int32"
        )
        if positions is None:
            positions = ops.arange(0, ops.shape(query)[1], dtype="int32") + start
        if self_attention:
            return positions, positions
        return positions, ops.arange(0, ops.shape(key)[1], dtype="int32") + start

    @staticmethod
    def _project(dense, x):
        """`dense(x)`, `(B, T, width)` -> `(B, T, heads, dim)`.

        Raises where Keras would add the bias on the wrong axis: on TensorFlow,
        `keras.ops.add` adds a bias of shape `(heads, 1)` along axis 1 (the
        positions) when there are as many positions as heads.
        """
        bias_shape = () if dense.bias is None else tuple(dense.bias.shape)
        if (
            keras.backend.backend() == "tensorflow"
            and len(bias_shape) == 2
            and bias_shape[1] == 1
            and 1 < bias_shape[0] == x.shape[1]
        ):
            raise ValueError(
                f"On TensorFlow, Keras adds the bias of `{dense.name}` (heads of "
                "width 1) along the wrong axis when the length equals the number "
                f"of heads. Received: length={x.shape[1]}, "
                f"heads={bias_shape[0]}, head width=1. Use heads of width > 1 "
                "(key_dim/value_dim), use_bias=False, or another backend."
            )
        return dense(x)

    @staticmethod
    def _resolve_inputs(query, value, key, value_mask, query_mask, mask, cache):
        """`(value, key, value_mask, self_attention)`: `value` and `key`
        default to the query; in self-attention the query's padding mask masks
        the keys (unless they come from a cache). Self-attention is no
        `value`, or Keras' `layer(x, x)`: `value` the query tensor itself."""
        # Identity, not `in`: `key in (None, query)` compares tensors by value.
        self_attention = value is None or (
            value is query and (key is None or key is query)
        )
        if value is None:
            value = query
            if value_mask is None and cache is None:
                value_mask = query_mask if query_mask is not None else mask
        return value, value if key is None else key, value_mask, self_attention

    def _keys_and_values(self, key, value, cache, cache_update_index, positions):
        """Projected keys and values, read from or written to a cache.

        `key` and `value` are the inputs `(B, S, width)`. Returns them projected,
        `(B, S, K, D)` without a cache, heads-major `(B, K, S, D)` from a cache
        `(B, 2, K, S, D)`. Keys are stored normalized and rotated.
        """
        if cache is None or cache_update_index is not None:
            k = self._heads(self.key_dense, self.key_norm, key, positions)
            v = self._project(self.value_dense, value)
            if cache is None:
                return k, v, None
            update = ops.transpose(ops.stack([k, v], axis=1), (0, 1, 3, 2, 4))
            start = [0, 0, 0, ops.cast(cache_update_index, "int32"), 0]
            cache = ops.slice_update(cache, start, ops.cast(update, cache.dtype))
        dtype = self.compute_dtype
        return ops.cast(cache[:, 0], dtype), ops.cast(cache[:, 1], dtype), cache

    def _attention_mask(
        self,
        query,
        key,
        lengths,
        value_mask,
        key_mask,
        attention_mask,
        use_causal_mask,
        cache_update_index,
    ):
        """The merged boolean mask (or `None`), and whether the causal mask is
        left to the kernel (`is_causal`, the fused kernels' fast path).

        `query` and `key` are the inputs; `lengths` counts the (folded) queries
        and the keys (the cache's positions with a cache).
        """
        fold = self._axes.fold
        padding = [
            ops.expand_dims(fold(ops.cast(m, "bool"), trailing=0), 1)  # (B, 1, S)
            for m in (value_mask, key_mask)
            if m is not None
        ]
        attention_mask = self._axes.fold_attention_mask(attention_mask, query, key)
        query_length, key_length = lengths
        offset, positions = 0, []
        if cache_update_index is not None:  # queries sit at index, index + 1, ...
            offset = cache_update_index
            if use_causal_mask:
                positions.append(attn_ops.causal_mask(query_length, key_length, offset))
            else:  # every key written so far
                written = (
                    ops.arange(0, key_length, dtype="int32")
                    < offset + ops.shape(key)[1]
                )
                positions.append(ops.expand_dims(written, 0))
            use_causal_mask = False
        if self.sliding_window is not None:
            positions.append(
                attn_ops.sliding_window_mask(
                    query_length, key_length, self.sliding_window, offset
                )
            )
        mask = attn_ops.merge_attention_masks(*padding, attention_mask, *positions)
        return mask, use_causal_mask

    # --- Caches ---------------------------------------------------------------

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
        self._check_cacheable()
        value = ops.cast(value, self.compute_dtype)
        key = value if key is None else ops.cast(key, self.compute_dtype)
        for name, tensor in (("value", value), ("key", key)):
            check_rank(name, tensor.shape, 3, "(batch, length, width)")
            check_width(name, tensor.shape, self._widths[name])
        return self._project_cache(value, key)

    def _project_cache(self, value, key=None):
        """`compute_cache` of inputs already checked by the caller."""
        key = value if key is None else key
        _, positions = self._rope_positions(key, key, None, None, True)
        k = self._heads(self.key_dense, self.key_norm, key, positions)  # (B, S, K, D)
        v = self._project(self.value_dense, value)
        return ops.transpose(ops.stack([k, v], axis=1), (0, 1, 3, 2, 4))

    def get_empty_cache(self, batch_size, max_length, dtype=None):
        """An all-zeros key/value cache for step-by-step self-attention.

        Pass it as `cache` with `cache_update_index` (the position of the first
        query) and feed back the cache the call returns. Grouped-query attention
        caches only its `num_key_value_heads`. The layer must be built.

        Args:
            batch_size: int. Batch size.
            max_length: int. Number of positions the cache holds.
            dtype: dtype of the cache. Defaults to the layer's compute dtype.

        Returns:
            Zeros `(batch_size, 2, num_key_value_heads, max_length, key_dim)`:
            keys at index 0 of axis 1, values at index 1.

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
        self._check_cacheable()
        shape = (batch_size, 2, self._kv_heads, max_length, self._head_dim)
        return ops.zeros(shape, dtype=dtype or self.compute_dtype)

    def _check_cacheable(self):
        if not self.built:
            raise ValueError(
                f"{self.name} must be built (called once) before it makes a cache."
            )
        if self._value_head_dim != self._head_dim:
            raise ValueError(
                "A key/value cache stacks keys and values, so it needs "
                "`value_dim == key_dim`. Received: "
                f"key_dim={self._head_dim}, value_dim={self._value_head_dim}."
            )
        if self._axes.rank != 3:
            raise ValueError(
                "Key/value caches need inputs of rank 3, (batch, length, width). "
                f"{self.name} was built for inputs of rank {self._axes.rank}."
            )

    # --- Keras machinery ------------------------------------------------------

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
            rank: int. Rank of the adapters.
            lora_alpha: float. Adapters are scaled by `lora_alpha / rank`.
                Defaults to `rank`.
            a_initializer: initializer of the down-projections. Defaults to
                `"he_uniform"`.
            b_initializer: initializer of the up-projections. Defaults to
                `"zeros"` (so the layer starts unchanged).

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
        self._check_shapes(query_shape, value_shape, key_shape)
        return (*query_shape[:-1], *(self._output_shape or query_shape[-1:]))

    def compute_output_spec(
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
        mask=None,
    ):
        value, key, value_mask, self_attention = self._resolve_inputs(
            query, value, key, value_mask, query_mask, mask, cache
        )
        if self.built and not self._inputs_checked_by_caller:
            self._check_call(CallArguments(locals()))
        dtype = self.compute_dtype
        shape = self.compute_output_shape(query.shape, value.shape, key.shape)
        outputs = (keras.KerasTensor(shape, dtype=dtype),)
        if return_attention_scores:
            key_shape = key.shape if cache is None else (*key.shape[:1], cache.shape[3])
            axes = AttentionAxes(self.attention_axes, len(query.shape))
            scores = axes.scores_shape(query.shape, key_shape, self.num_heads)
            outputs += (keras.KerasTensor(scores, dtype=dtype),)
        if cache is not None:
            outputs += (keras.KerasTensor(cache.shape, dtype=cache.dtype),)
        return outputs[0] if len(outputs) == 1 else outputs

    # --- Checks ---------------------------------------------------------------

    def _check_call(self, args):
        """Every argument of a call (`args`: its arguments by name, `value`
        and `key` resolved), before anything is computed."""
        check_bool("use_causal_mask", args.use_causal_mask)
        check_bool("return_attention_scores", args.return_attention_scores)
        if args.return_attention_scores and self.flash_attention:
            raise ValueError(
                "`return_attention_scores=True` needs the explicit path, and "
                "this layer has `flash_attention=True`, which requires the flash "
                "kernel. Create the layer with flash_attention=None to get the "
                "scores."
            )
        query, key, cache = args.query, args.key, args.cache
        # Keys and values are projected, or read from a precomputed cache.
        projected = cache is None or args.cache_update_index is not None
        self._check_inputs(query, args.value, key, projected)
        inner = tuple(query.shape[:-1])
        check_mask("query_mask", args.query_mask, inner)
        check_mask("mask", args.mask, inner)
        key_inner = self._check_cache_arguments(args, tuple(key.shape[:-1]))
        check_mask("value_mask", args.value_mask, key_inner)
        check_mask("key_mask", args.key_mask, key_inner)
        self._check_attention_mask(args.attention_mask, inner, key_inner)
        self._check_attention_bias(args.attention_bias, inner, key_inner)
        check_positions(args.positions, *inner[:2], self.rope_max_wavelength)
        if args.positions is not None and not args.self_attention:
            raise ValueError(
                "`positions` are the rotary positions of a self-attention's "
                "tokens; call it as `layer(query)` (or with `value` the very "
                "query tensor). Keys of another sequence sit at 0, 1, ... "
                "Received: positions with a separate `value`."
            )
        if (
            self.rope_max_wavelength is not None
            and cache is not None
            and args.cache_update_index is None
            and args.positions is None
        ):
            raise ValueError(
                "With rotary positions, a precomputed `cache` (no "
                "`cache_update_index`) needs the queries' `positions`: nothing "
                "else tells where they sit. Received: positions=None."
            )

    def _check_cache_arguments(self, args, key_inner):
        """Check `cache` and `cache_update_index`; return the keys' inner shape."""
        cache, index = args.cache, args.cache_update_index
        if cache is None:
            if index is not None:
                raise ValueError(
                    "`cache_update_index` needs a `cache`. Received: cache=None, "
                    f"cache_update_index={index}."
                )
            return key_inner
        self._check_cache(cache, args.query.shape[0])
        if index is not None:  # the new keys are written from there
            check_index("cache_update_index", index, key_inner[1], cache.shape[3])
        return (key_inner[0], cache.shape[3])

    def _check_inputs(self, query, value, key, projected):
        """Float inputs of the rank and the widths built for."""
        rank = self._axes.rank
        layout = "(batch, length, width)" if rank == 3 else "(batch, *axes, width)"
        for name, tensor in (("query", query), ("value", value), ("key", key)):
            check_rank(name, tensor.shape, rank, layout)
            check_float(name, tensor)
            if name == "query" or projected:
                check_width(name, tensor.shape, self._widths[name])
        if any(
            _differ(a, b)
            for a, b in zip(key.shape[1:-1], value.shape[1:-1], strict=True)
        ):
            raise ValueError(
                "`key` and `value` must have the same length (all dimensions "
                "but the last one equal). "
                f"Received: key.shape={tuple(key.shape)}, "
                f"value.shape={tuple(value.shape)}."
            )

    def _check_attention_mask(self, attention_mask, inner, key_inner):
        if self._axes.rank == 3:
            batch, query_length, key_length = inner[0], inner[1], key_inner[1]
            shapes = {
                2: (query_length, key_length),
                3: (batch, query_length, key_length),
                4: (batch, self.num_heads, query_length, key_length),
            }
        else:  # (B, *batch axes, *query attention axes, *key attention axes)
            axes = self._axes
            shape = (inner[0], *(inner[a] for a in axes.batch))
            shape += tuple(inner[a] for a in axes.attention)
            shape += tuple(key_inner[a] for a in axes.attention)
            shapes = {len(shape): shape}
        check_mask("attention_mask", attention_mask, shapes, broadcast=True)

    def _check_attention_bias(self, bias, inner, key_inner):
        if bias is not None and self._axes.rank != 3:
            raise ValueError(
                "`attention_bias` needs inputs of rank 3, (batch, length, width). "
                f"{self.name} was built for inputs of rank {self._axes.rank}."
            )
        full = (inner[0], self.num_heads, inner[1], key_inner[1])
        check_broadcastable(
            "attention_bias",
            bias,
            full,
            "(batch, num_heads, query_length, key_length)",
        )

    def _check_cache(self, cache, batch, name="cache"):
        """Raise unless `cache` is a float `(batch, 2, kv_heads, length, key_dim)`."""
        self._check_cacheable()
        expected = (batch, 2, self._kv_heads, None, self._head_dim)
        check_mask(name, cache, expected)
        check_float(name, cache)

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "num_heads": self.num_heads,
                "key_dim": self.key_dim,
                "value_dim": self.value_dim,
                "dropout": self.dropout,
                "use_bias": self.use_bias,
                "output_shape": self._output_shape,
                "attention_axes": self.attention_axes,
                "sliding_window": self.sliding_window,
                "flash_attention": self.flash_attention,
                "kernel_initializer": keras.initializers.serialize(
                    self.kernel_initializer
                ),
                "bias_initializer": keras.initializers.serialize(self.bias_initializer),
                "kernel_regularizer": keras.regularizers.serialize(
                    self.kernel_regularizer
                ),
                "bias_regularizer": keras.regularizers.serialize(self.bias_regularizer),
                "kernel_constraint": keras.constraints.serialize(
                    self.kernel_constraint
                ),
                "bias_constraint": keras.constraints.serialize(self.bias_constraint),
                "use_gate": self.use_gate,
                "seed": self.seed,
                "num_key_value_heads": self.num_key_value_heads,
                "rope_max_wavelength": self.rope_max_wavelength,
                "rope_scaling_factor": self.rope_scaling_factor,
                "normalize_qk": self.normalize_qk,
                "qk_norm_epsilon": self.qk_norm_epsilon,
                "logit_soft_cap": self.logit_soft_cap,
                "dtype": dtype_config(self),
            }
        )
        return config


def _output_shape(output_shape, output_dim):
    """`output_shape` (int or tuple) and its alias `output_dim` as a tuple or None."""
    output_shape = check_shape_argument("output_shape", output_shape)
    output_dim = check_positive_int("output_dim", output_dim, allow_none=True)
    if output_dim is not None:
        if output_shape not in (None, (output_dim,)):
            raise ValueError(
                "`output_dim` is another name for an int `output_shape`; pass "
                f"one of them. Received: output_shape={output_shape}, "
                f"output_dim={output_dim}."
            )
        output_shape = (output_dim,)
    return output_shape


def _differ(a, b):
    return isinstance(a, int) and isinstance(b, int) and a != b
