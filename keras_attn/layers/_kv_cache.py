"""The key/value cache of `MultiHeadAttention`: written by each decoding
step and read by the next, or computed once from an encoder output."""

import contextlib
import threading

from keras import ops

from keras_attn._checks import check_float, check_mask, check_rank, check_width
from keras_attn.layers._projections import project


class KeyValueCache:
    """Mixin of `MultiHeadAttention`: its caches.

    A cache is `(batch, 2, num_key_value_heads, length, key_dim)`: keys at
    index 0 of axis 1, values at index 1, heads-major, so that a step reads
    each head's keys contiguously. Keys are stored normalized and rotated.
    """

    def _keys_and_values(self, key, value, cache, cache_update_index, positions):
        """Projected keys and values, read from or written to a cache.

        `key` and `value` are the inputs `(B, S, width)`. Returns them projected,
        `(B, S, K, D)` without a cache, heads-major `(B, K, S, D)` from a cache
        `(B, 2, K, S, D)`. Keys are stored normalized and rotated.
        """
        if cache is None or cache_update_index is not None:
            k = self._heads(self.key_dense, self.key_norm, key, positions)
            v = project(self.value_dense, value)
            if cache is None:
                return k, v, None
            cache = _write(cache, k, v, cache_update_index)
        dtype = self.compute_dtype
        return ops.cast(cache[:, 0], dtype), ops.cast(cache[:, 1], dtype), cache

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
        return self._project_cache(value, key)

    def _project_cache(self, value, key=None):
        """`compute_cache` of inputs already checked by the caller."""
        key = value if key is None else key
        positions = None  # the keys of another sequence sit at 0, 1, ...
        if self.rope_max_wavelength is not None:
            positions = ops.arange(0, ops.shape(key)[1], dtype="int32")
        k = self._heads(self.key_dense, self.key_norm, key, positions)  # (B, S, K, D)
        v = project(self.value_dense, value)
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
        check_cacheable(self)
        shape = (batch_size, 2, self._kv_heads, max_length, self._head_dim)
        return ops.zeros(shape, dtype=dtype or self.compute_dtype)


class _Writer(threading.local):
    function = None  # `(cache, keys, values, index) -> cache`, in this thread


_WRITER = _Writer()


@contextlib.contextmanager
def caches_written_by(write):
    """Caches written inside, in this thread, by `write(cache, keys, values,
    index)` (keys and values `(B, n, K, D)`, of the cache's dtype), which
    returns the written cache (`None`: `ops.slice_update`, which returns a
    new cache and leaves the given one as it was).

    For `generate` on PyTorch, which owns its caches and writes them in
    place (`keras_attn/generation/_torch.py`): a step then copies one
    position, not the whole cache.
    """
    previous, _WRITER.function = _WRITER.function, write
    try:
        yield
    finally:
        _WRITER.function = previous


def _write(cache, keys, values, index):
    """`keys` and `values` `(B, n, K, D)` written into `cache` at positions
    `index, ..., index + n - 1`."""
    keys, values = ops.cast(keys, cache.dtype), ops.cast(values, cache.dtype)
    if _WRITER.function is not None:
        return _WRITER.function(cache, keys, values, index)
    update = ops.transpose(ops.stack([keys, values], axis=1), (0, 1, 3, 2, 4))
    return ops.slice_update(cache, [0, 0, 0, ops.cast(index, "int32"), 0], update)


def check_cacheable(layer):
    """Raise unless `layer` is built for key/value caches."""
    if not layer.built:
        raise ValueError(
            f"{layer.name} must be built (called once) before it makes a cache."
        )
    if layer._value_head_dim != layer._head_dim:
        raise ValueError(
            "A key/value cache stacks keys and values, so it needs "
            "`value_dim == key_dim`. Received: "
            f"key_dim={layer._head_dim}, value_dim={layer._value_head_dim}."
        )
    if layer._axes.rank != 3:
        raise ValueError(
            "Key/value caches need inputs of rank 3, (batch, length, width). "
            f"{layer.name} was built for inputs of rank {layer._axes.rank}."
        )


def check_cache(layer, cache, batch, name="cache"):
    """Raise unless `cache` is a float `(batch, 2, kv_heads, length, key_dim)`."""
    check_cacheable(layer)
    expected = (batch, 2, layer._kv_heads, None, layer._head_dim)
    check_mask(name, cache, expected)
    check_float(name, cache)
