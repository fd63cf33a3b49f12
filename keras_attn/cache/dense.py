"""The dense cache: one slot per position, written in place at a static
shape (what a CUDA graph replays: no reallocation, no copy per step)."""

import collections

from keras import ops

from keras_attn._checks import check_sizes
from keras_attn.cache import _slots
from keras_attn.ops.dtypes import cast_to


class DenseCache(_slots.Linear, collections.namedtuple("DenseCache", ["kv"])):
    """Keys and values of every position, `kv` `(batch, 2, kv_heads, length,
    head_dim)`: keys at index 0 of axis 1, values at index 1, heads-major;
    slot `p` holds position `p`. Keys are stored as the attention reads them
    (normalized, rotated).

    The tensor layout is `MultiHeadAttention`'s `cache` tensor (keras-hub's
    `CachedMultiHeadAttention` form, heads-major): `DenseCache(tensor)` wraps
    one. `update` writes in place on PyTorch where no gradient is recorded
    (the returned cache holds the same tensor, as gpt-fast's and Hugging
    Face's static caches do), so keep no other use of a cache you update; on
    JAX and TensorFlow, and under autograd, it returns a new cache (which XLA
    writes in place inside a compiled loop). Always use the returned cache.

    Example:
    >>> cache = keras_attn.cache.DenseCache.empty(2, num_heads=3, length=8,
    ...                                           head_dim=4)
    >>> keys = values = np.ones((2, 1, 3, 4), "float32")  # one token
    >>> cache = cache.update(keys, values, index=5)
    >>> tuple(cache.read("float32")[0].shape), cache.nbytes
    ((2, 3, 8, 4), 1536)
    >>> keras.ops.convert_to_numpy(cache.mask(5, 1))[0, 0, 0, 4:7].tolist()
    [True, True, False]
    """

    __slots__ = ()

    @classmethod
    def empty(cls, batch_size, num_heads, length, head_dim, dtype="float32"):
        """An all-zeros cache of `length` positions."""
        check_sizes(
            batch_size=batch_size, num_heads=num_heads, length=length,
            head_dim=head_dim,
        )  # fmt: skip
        return cls(ops.zeros((batch_size, 2, num_heads, length, head_dim), dtype))

    @property
    def nbytes(self):
        """The cache's memory, in bytes."""
        return _slots.nbytes(self.kv)

    def update(self, keys, values, index):
        """`keys` and `values` `(batch, n, kv_heads, head_dim)` written at
        positions `index, ..., index + n - 1` (`index` an int or a scalar
        int tensor); returns the cache."""
        keys, values = (cast_to(x, self.kv.dtype) for x in (keys, values))
        return DenseCache(_slots.write(self.kv, keys, values, index))

    def read(self, dtype):
        """`(keys, values)`, each `(batch, kv_heads, length, head_dim)` in
        `dtype`: what a step attends over."""
        return cast_to(self.kv[:, 0], dtype), cast_to(self.kv[:, 1], dtype)

    def take(self, positions):
        """A cache of the slots at `positions` (int32 `(batch or 1, n)`)."""
        return DenseCache(_slots.take(self.kv, positions))

    def blend(self, arrives, keys, values):
        """The first `s` slots take one token's keys and values where
        `arrives` `(batch, s)` is True (a rolling cache's sinks)."""
        keys, values = (cast_to(x, self.kv.dtype) for x in (keys, values))
        return DenseCache(_slots.blend(self.kv, arrives, keys, values))


def written(kv, keys, values, index):
    """A new cache tensor `(B, 2, K, L, D)`: `kv` with `keys` and `values`
    `(B, n, K, D)` written at positions `index, ..., index + n - 1`, and
    `kv` as it was (a `MultiHeadAttention` called with a cache tensor:
    Keras' and keras-hub's functional form)."""
    keys, values = (cast_to(x, kv.dtype) for x in (keys, values))
    return _slots.write(kv, keys, values, index, in_place=False)
