"""Multi-head attention with grouped-query heads and a fused or explicit kernel."""

import functools
import math

import keras
from keras import ops

from keras_attn import ops as attn_ops
from keras_attn.layers._utils import (
    ConfigCheck,
    check_bool,
    check_float,
    check_index,
    check_mask,
    check_positive_int,
    check_rank,
    check_rate,
    check_seed,
    check_width,
    clone_initializer,
    get_keras_object,
)


def _matrix_initializer(initializer, fan_in_axes):
    """Initialize a `(..., ...)` kernel as the 2-D matrix it multiplies as.

    Keras' variance-scaling initializers read the fans of rank-3 kernels as if
    they were convolutions; attention kernels are matrices `(in, heads * dim)`
    or `(heads * dim, out)`, so draw them as such and reshape.
    """

    def initialize(shape, dtype=None):
        rows = math.prod(shape[:fan_in_axes])
        matrix = initializer((rows, math.prod(shape) // rows), dtype=dtype)
        return ops.reshape(matrix, shape)

    return initialize


@keras.saving.register_keras_serializable(package="keras_attn")
class MultiHeadAttention(ConfigCheck, keras.layers.Layer):
    """Multi-head attention, softmax(QK^T / sqrt(d_k)) V per head, then W_O.

    As in Vaswani et al. (2017), with grouped-query attention
    (`num_key_value_heads`, Ainslie et al. 2023). The attention itself runs in
    `keras.ops.dot_product_attention` (fused and flash kernels where the backend
    has them) whenever it can and they pay off, and in an explicit
    float32-softmax path when the weights are needed (dropout in training,
    `return_attention_scores=True`), with `flash_attention=False`, and on a
    CPU where it is faster (measured in `benchmarks/`): under TensorFlow, and
    in training under JAX. Both paths give the same numbers.

    Masks: a key may be attended to where the key/value padding mask (from the
    inputs' Keras masks or `value_mask`/`key_mask`), `attention_mask` and the
    causal mask all allow it. A query row that may attend to nothing outputs
    zeros before the output projection (so the output is the output bias). The
    query's padding mask does not mask anything: padded query positions are
    computed like the others (as in `torch.nn.MultiheadAttention`) and the output
    carries the query's Keras mask.

    Weights: `query_kernel (query_width, num_heads, key_dim)`,
    `key_kernel (key_width, num_key_value_heads, key_dim)`,
    `value_kernel (value_width, num_key_value_heads, value_dim)`,
    `output_kernel (num_heads, value_dim, output_dim)` and, with `use_bias`, the
    matching `*_bias` vectors.

    Args:
        num_heads: int. Number of query heads.
        key_dim: int. Per-head width of queries and keys. Defaults to the query
            width // `num_heads` (which must then divide it).
        value_dim: int. Per-head width of values. Defaults to `key_dim`.
        num_key_value_heads: int. Number of key/value heads for grouped-query
            attention; must divide `num_heads`. `1` is multi-query attention.
            Defaults to `num_heads`.
        dropout: float in [0, 1). Dropout on the attention weights in training.
            Defaults to `0.0`.
        use_bias: bool. Whether the projections have biases. Defaults to `True`.
        output_dim: int. Width of the output. Defaults to the query width.
        flash_attention: `None` (use fused kernels where they pay off), `True`
            (require the backend's flash kernel; errors where there is none) or
            `False` (always the explicit path). Defaults to `None`.
        kernel_initializer: initializer of the kernels. Defaults to
            `"glorot_uniform"` (fans of the 2-D projection matrices).
        bias_initializer: initializer of the biases. Defaults to `"zeros"`.
        kernel_regularizer: optional regularizer of the kernels.
        bias_regularizer: optional regularizer of the biases.
        kernel_constraint: optional constraint of the kernels.
        bias_constraint: optional constraint of the biases.
        seed: optional int. Seed of the attention dropout.
        **kwargs: Base layer arguments (`name`, `dtype`, ...).

    Call arguments:
        query: float tensor `(batch, query_length, query_width)`.
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
            broadcastable (rank 2 to 4), True where attention is allowed.
        use_causal_mask: bool. Query `i` may only attend to keys `j <= i`.
            Defaults to `False`.
        return_attention_scores: bool. Also return the attention weights.
            Defaults to `False`.
        training: bool. Whether dropout is active.
        mask: filled in by Keras with the query's Keras mask when the query is
            the only tensor argument (self-attention); in self-attention it masks
            the keys as `value_mask` does.

    Returns:
        Tensor `(batch, query_length, output_dim)`, carrying the query's Keras
        mask; with `return_attention_scores=True`, a tuple `(output, scores)`
        where `scores` `(batch, num_heads, query_length, key_length)` are the
        softmax weights (before dropout) the output was computed with.

    Example:
    >>> attention = keras_attn.MultiHeadAttention(num_heads=2)
    >>> x = np.random.rand(3, 5, 8).astype("float32")
    >>> output, scores = attention(x, use_causal_mask=True,
    ...                            return_attention_scores=True)
    >>> tuple(output.shape), tuple(scores.shape)
    ((3, 5, 8), (3, 2, 5, 5))
    """

    def __init__(
        self,
        num_heads,
        key_dim=None,
        value_dim=None,
        num_key_value_heads=None,
        dropout=0.0,
        use_bias=True,
        output_dim=None,
        flash_attention=None,
        kernel_initializer="glorot_uniform",
        bias_initializer="zeros",
        kernel_regularizer=None,
        bias_regularizer=None,
        kernel_constraint=None,
        bias_constraint=None,
        seed=None,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.num_heads = check_positive_int("num_heads", num_heads)
        self.key_dim = check_positive_int("key_dim", key_dim, allow_none=True)
        self.value_dim = check_positive_int("value_dim", value_dim, allow_none=True)
        self.num_key_value_heads = check_positive_int(
            "num_key_value_heads", num_key_value_heads, allow_none=True
        )
        if self.num_key_value_heads and num_heads % self.num_key_value_heads:
            raise ValueError(
                "`num_key_value_heads` must divide `num_heads`. Received: "
                f"num_heads={num_heads}, num_key_value_heads={num_key_value_heads}."
            )
        self.dropout = check_rate("dropout", dropout)
        self.use_bias = check_bool("use_bias", use_bias)
        self.output_dim = check_positive_int("output_dim", output_dim, allow_none=True)
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
        self.seed = check_seed(seed)
        self.supports_masking = True

    def build(self, query_shape, value_shape=None, key_shape=None):
        value_shape = query_shape if value_shape is None else value_shape
        key_shape = value_shape if key_shape is None else key_shape
        for name, shape in (("query", query_shape), ("value", value_shape)):
            check_rank(name, shape, 3, "(batch, length, width)")
        check_rank("key", key_shape, 3, "(batch, length, width)")
        query_width = query_shape[-1]
        if query_width is None:
            raise ValueError(
                "The query width (last dimension) must be known. "
                f"Received: query_shape={tuple(query_shape)}."
            )
        if self.key_dim is None and query_width % self.num_heads:
            raise ValueError(
                "`num_heads` must divide the query width when `key_dim` is not "
                f"given. Received: num_heads={self.num_heads}, "
                f"query width={query_width}. Pass `key_dim` explicitly or choose "
                "a divisor of the width."
            )
        self._head_dim = self.key_dim or query_width // self.num_heads
        self._value_head_dim = self.value_dim or self._head_dim
        self._kv_heads = self.num_key_value_heads or self.num_heads
        self._output_width = self.output_dim or query_width
        heads, kv_heads = self.num_heads, self._kv_heads
        self.query_kernel, self.query_bias = self._projection(
            "query", (query_width, heads, self._head_dim)
        )
        self.key_kernel, self.key_bias = self._projection(
            "key", (key_shape[-1], kv_heads, self._head_dim)
        )
        self.value_kernel, self.value_bias = self._projection(
            "value", (value_shape[-1], kv_heads, self._value_head_dim)
        )
        self.output_kernel, self.output_bias = self._projection(
            "output", (heads, self._value_head_dim, self._output_width), fan_in_axes=2
        )
        if self.dropout > 0:
            self._attention_dropout = keras.layers.Dropout(
                self.dropout, seed=self.seed, dtype=self.dtype_policy, name="dropout"
            )
        self.built = True

    def _projection(self, name, kernel_shape, fan_in_axes=1):
        initializer = clone_initializer(self.kernel_initializer)
        kernel = self.add_weight(
            name=f"{name}_kernel",
            shape=kernel_shape,
            initializer=_matrix_initializer(initializer, fan_in_axes),
            regularizer=self.kernel_regularizer,
            constraint=self.kernel_constraint,
        )
        if not self.use_bias:
            return kernel, None
        bias = self.add_weight(
            name=f"{name}_bias",
            shape=kernel_shape[fan_in_axes:],
            initializer=clone_initializer(self.bias_initializer),
            regularizer=self.bias_regularizer,
            constraint=self.bias_constraint,
        )
        return kernel, bias

    def call(
        self,
        query,
        value=None,
        key=None,
        query_mask=None,
        value_mask=None,
        key_mask=None,
        attention_mask=None,
        use_causal_mask=False,
        return_attention_scores=False,
        training=None,
        cache=None,
        cache_update_index=None,
        mask=None,
    ):
        self_attention = value is None
        value = query if value is None else value
        key = value if key is None else key
        if self_attention and value_mask is None and cache is None:
            value_mask = query_mask if query_mask is not None else mask
        self._check_call(
            query,
            value,
            key,
            value_mask,
            key_mask,
            attention_mask,
            cache,
            cache_update_index,
            query_mask=query_mask,
            mask=mask,
            use_causal_mask=use_causal_mask,
            return_attention_scores=return_attention_scores,
        )
        # Separate Q, K and V matmuls: a fused QKV projection (one matmul on the
        # concatenated kernels) measured no faster on any backend's CPU, and
        # under ModelParallel its concatenation gathers the sharded kernels.
        q = self._project_heads(query, self.query_kernel, self.query_bias)
        k, v, cache = self._keys_and_values(key, value, cache, cache_update_index)
        attention_mask = attn_ops.merge_attention_masks(
            _merge_padding(value_mask, key_mask), attention_mask
        )
        if cache_update_index is not None:
            # The keys are the cache's positions; query i sits at index + i.
            attention_mask = _and(
                attention_mask,
                _cache_visibility(q, k, cache_update_index, use_causal_mask),
            )
            use_causal_mask = False
        explicit = (
            return_attention_scores
            or self.flash_attention is False
            or (bool(training) and self.dropout > 0)
            or (self.flash_attention is None and not _fused_kernels_pay_off(training))
        )
        heads_major = cache is not None and self.flash_attention is not True
        if heads_major and (explicit or not _on_accelerator(keras.config.backend())):
            # Read the heads-major cache in place (on a CPU the fused kernels
            # would take a transposed copy of it at every step).
            result = attn_ops._heads_major_attention(
                q,
                k,
                v,
                mask=attention_mask,
                is_causal=use_causal_mask,
                dropout=self._dropout_fn(training),
                return_scores=return_attention_scores,
            )
        else:
            if cache is not None:  # The fused kernels take `(B, S, K, D)`.
                k, v = (ops.transpose(x, (0, 2, 1, 3)) for x in (k, v))
            result = self._attention(
                q, k, v, attention_mask, use_causal_mask, explicit, training,
                return_attention_scores,
            )  # fmt: skip
        context, scores = result if return_attention_scores else (result, None)
        outputs = (self._output_projection(context),)
        outputs += (scores,) if return_attention_scores else ()
        outputs += (cache,) if cache is not None else ()
        return outputs[0] if len(outputs) == 1 else outputs

    def _attention(
        self, q, k, v, mask, causal, explicit, training, return_attention_scores
    ):
        return attn_ops.dot_product_attention(
            q,
            k,
            v,
            mask=mask,
            is_causal=causal,
            fused=not explicit,
            flash_attention=self.flash_attention,
            dropout=self._dropout_fn(training) if explicit else None,
            return_scores=return_attention_scores,
        )

    def _keys_and_values(self, key, value, cache, cache_update_index):
        """Keys and values, read from or written to a cache.

        `key` and `value` are the inputs `(B, S, width)`. Returns them projected,
        `(B, S, K, D)` without a cache, heads-major `(B, K, S, D)` from a cache
        `(B, 2, K, S, D)`.
        """
        if cache is not None and cache_update_index is None:
            return cache[:, 0], cache[:, 1], cache  # precomputed, e.g. the encoder's
        key = self._project_heads(key, self.key_kernel, self.key_bias)
        value = self._project_heads(value, self.value_kernel, self.value_bias)
        if cache is None:
            return key, value, None
        update = ops.transpose(ops.stack([key, value], axis=1), (0, 1, 3, 2, 4))
        start = [0, 0, 0, ops.cast(cache_update_index, "int32"), 0]
        cache = ops.slice_update(cache, start, ops.cast(update, cache.dtype))
        return cache[:, 0], cache[:, 1], cache

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
        for name, tensor, kernel in (
            ("value", value, self.value_kernel),
            ("key", key, self.key_kernel),
        ):
            check_rank(name, tensor.shape, 3, "(batch, length, width)")
            check_width(name, tensor.shape, kernel.shape[0])
        k = self._project_heads(key, self.key_kernel, self.key_bias)
        v = self._project_heads(value, self.value_kernel, self.value_bias)
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

    def _project_heads(self, inputs, kernel, bias):
        """`(B, T, width) @ (width, heads, dim)` -> `(B, T, heads, dim)`.

        (One einsum. The letters are chosen so that the contracted axes sort
        in memory order: `jnp.einsum` orders them alphabetically, and any
        other order makes XLA transpose the kernels and their gradients.)
        """
        kernel = ops.cast(kernel, inputs.dtype)  # a no-op inside `__call__`
        projected = ops.einsum("abc,cde->abde", inputs, kernel)
        if bias is not None:
            projected = projected + ops.cast(bias, inputs.dtype)
        return projected

    def _output_projection(self, context):
        """`(B, T, H, Dv)` -> `(B, T, output_dim)` through W_O."""
        output = ops.einsum("abcd,cde->abe", context, self.output_kernel)
        return output if self.output_bias is None else output + self.output_bias

    def _dropout_fn(self, training):
        if self.dropout == 0:
            return None
        return lambda weights: self._attention_dropout(weights, training=training)

    def _check_call(
        self,
        query,
        value,
        key,
        value_mask,
        key_mask,
        attention_mask,
        cache,
        cache_update_index,
        query_mask=None,
        mask=None,
        use_causal_mask=False,
        return_attention_scores=False,
    ):
        check_bool("use_causal_mask", use_causal_mask)
        check_bool("return_attention_scores", return_attention_scores)
        # Keys and values are projected, or read from a precomputed cache.
        projected = cache is None or cache_update_index is not None
        self._check_inputs(query, value, key, projected)
        batch, query_length = query.shape[0], query.shape[1]
        check_mask("query_mask", query_mask, (batch, query_length))
        check_mask("mask", mask, (batch, query_length))
        key_length = key.shape[1]
        if _differ(key.shape[1], value.shape[1]):
            raise ValueError(
                "`key` and `value` must have the same length. "
                f"Received: key.shape={tuple(key.shape)}, "
                f"value.shape={tuple(value.shape)}."
            )
        if cache is not None:
            self._check_cache(cache, batch)
            key_length = cache.shape[3]
            if cache_update_index is not None:
                check_index(
                    "cache_update_index", cache_update_index, query_length, key_length
                )
        elif cache_update_index is not None:
            raise ValueError(
                "`cache_update_index` needs a `cache`. Received: cache=None, "
                f"cache_update_index={cache_update_index}."
            )
        check_mask("value_mask", value_mask, (batch, key_length))
        check_mask("key_mask", key_mask, (batch, key_length))
        check_mask(
            "attention_mask",
            attention_mask,
            {
                2: (query_length, key_length),
                3: (batch, query_length, key_length),
                4: (batch, self.num_heads, query_length, key_length),
            },
            broadcast=True,
        )

    def _check_inputs(self, query, value, key, projected):
        """Float `(batch, length, width)` inputs of the widths built for."""
        for name, tensor, kernel in (
            ("query", query, self.query_kernel),
            ("value", value, self.value_kernel),
            ("key", key, self.key_kernel),
        ):
            check_rank(name, tensor.shape, 3, "(batch, length, width)")
            check_float(name, tensor)
            if name == "query" or projected:
                check_width(name, tensor.shape, kernel.shape[0])

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
                "num_key_value_heads": self.num_key_value_heads,
                "dropout": self.dropout,
                "use_bias": self.use_bias,
                "output_dim": self.output_dim,
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
                "seed": self.seed,
            }
        )
        return config


def _merge_padding(value_mask, key_mask):
    if value_mask is None or key_mask is None:
        return key_mask if value_mask is None else value_mask
    return ops.logical_and(ops.cast(value_mask, "bool"), ops.cast(key_mask, "bool"))


def _fused_kernels_pay_off(training):
    """Whether `keras.ops.dot_product_attention` beats the explicit path here.

    Measured on a CPU (`benchmarks/encoder.py`, one block): JAX's fused op runs
    the forward pass 1.5x faster than the explicit einsums, but its gradient is
    slower (the explicit path trains ~3% faster); PyTorch's
    `scaled_dot_product_attention` has fused CPU kernels; TensorFlow's fused op
    is the same einsums with more overhead (the explicit path trains ~7%
    faster). On a GPU or TPU every backend has fused kernels.
    """
    backend = keras.config.backend()
    if backend == "torch" or _on_accelerator(backend):
        return True
    return backend == "jax" and not training


@functools.cache
def _on_accelerator(backend):
    if backend == "jax":
        import jax

        return jax.default_backend() != "cpu"
    if backend == "tensorflow":
        import tensorflow as tf

        return any(tf.config.list_logical_devices(kind) for kind in ("GPU", "TPU"))
    return False


def _and(mask, other):
    return other if mask is None else ops.logical_and(mask, other)


def _cache_visibility(query, key, cache_update_index, causal):
    """`(1, 1, T, S)`: which cache positions each new query may see.

    Causal: query `i` (at position `index + i`) sees positions `<= index + i`;
    otherwise every position written so far, `< index + T`.
    """
    query_length, key_length = ops.shape(query)[1], ops.shape(key)[2]  # heads-major
    index = ops.cast(cache_update_index, "int32")
    if causal:
        visible = attn_ops.causal_mask(query_length, key_length, query_offset=index)
    else:
        written = ops.arange(key_length) < index + query_length
        visible = ops.broadcast_to(written[None, :], (query_length, key_length))
    return visible[None, None]


def _differ(a, b):
    return isinstance(a, int) and isinstance(b, int) and a != b
