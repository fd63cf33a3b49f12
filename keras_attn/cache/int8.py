"""The int8 cache: keys and values quantized per token and head, dequantized
inside the step that reads them."""

import collections

import keras
from keras import ops

from keras_attn._checks import check_sizes
from keras_attn.cache import _slots
from keras_attn.ops.dtypes import cast_to, dtype_name

if keras.config.backend() == "torch":
    from keras_attn import _torch_eager
else:
    _torch_eager = None


class Int8Cache(_slots.Linear, collections.namedtuple("Int8Cache", ["kv", "scale"])):
    """A dense cache (`DenseCache`: one slot per position, written in place
    on PyTorch) whose keys and values are int8: `kv` `(batch, 2, kv_heads,
    length, head_dim)` int8 and `scale` `(batch, 2, kv_heads, length, 1)`
    float32, each key or value vector `x` stored as `round(x / s)` with `s =
    max|x| / 127` (symmetric, per token and head), read back as `q * s`.

    Memory: `head_dim + 4` bytes a vector against `4 * head_dim` in float32
    (0.27x at a head width of 64) and `2 * head_dim` in bfloat16 (0.53x).
    Per token rather than KIVI's per-channel keys (Liu et al. 2024): a token
    is quantized once, when it is written, with no float window of recent
    tokens to keep; `benchmarks/int8_cache.py` measures both.

    Example:
    >>> cache = keras_attn.cache.Int8Cache.empty(1, num_heads=2, length=4,
    ...                                          head_dim=64)
    >>> keys = values = np.linspace(-1, 1, 128, dtype="float32").reshape(1, 1, 2, 64)
    >>> cache = cache.update(keys, values, index=0)
    >>> read = keras.ops.convert_to_numpy(cache.read("float32")[0])[:, :, 0]
    >>> float(np.abs(read - keys[:, 0]).max()) < 1 / 254
    True
    >>> cache.nbytes / keras_attn.cache.DenseCache.empty(1, 2, 4, 64).nbytes
    0.265625
    """

    __slots__ = ()

    @classmethod
    def empty(cls, batch_size, num_heads, length, head_dim, dtype=None):
        """An all-zeros cache of `length` positions (`dtype`: ignored, for
        the signature of `DenseCache.empty`)."""
        check_sizes(
            batch_size=batch_size, num_heads=num_heads, length=length,
            head_dim=head_dim,
        )  # fmt: skip
        shape = (batch_size, 2, num_heads, length, head_dim)
        return cls(ops.zeros(shape, "int8"), ops.zeros((*shape[:4], 1), "float32"))

    @property
    def nbytes(self):
        """The cache's memory, in bytes."""
        return _slots.nbytes(self.kv, self.scale)

    def update(self, keys, values, index):
        """`keys` and `values` `(batch, n, kv_heads, head_dim)` quantized and
        written at positions `index, ..., index + n - 1`; returns the cache."""
        (keys, key_scale), (values, value_scale) = map(quantize, (keys, values))
        return Int8Cache(
            _slots.write(self.kv, keys, values, index),
            _slots.write(self.scale, key_scale, value_scale, index),
        )

    def read(self, dtype):
        """`(keys, values)`, each `(batch, kv_heads, length, head_dim)`,
        dequantized in float32 and then cast to `dtype`."""
        kv = _dequantize(self.kv, self.scale, dtype_name(dtype))
        return kv[:, 0], kv[:, 1]

    def take(self, positions):
        """A cache of the slots at `positions` (int32 `(batch or 1, n)`)."""
        return Int8Cache(
            _slots.take(self.kv, positions), _slots.take(self.scale, positions)
        )

    def blend(self, arrives, keys, values):
        """The first `s` slots take one token's keys and values where
        `arrives` `(batch, s)` is True (a rolling cache's sinks)."""
        (keys, key_scale), (values, value_scale) = map(quantize, (keys, values))
        return Int8Cache(
            _slots.blend(self.kv, arrives, keys, values),
            _slots.blend(self.scale, arrives, key_scale, value_scale),
        )


def _dequantize(values, scale, dtype):
    """`values * scale` in float32, then in `dtype`: on PyTorch one multiply
    that casts as it reads (`_torch_eager.dequantize`)."""
    if _torch_eager is not None:
        return _torch_eager.dequantize(values, scale, dtype)
    return cast_to(ops.cast(values, "float32") * scale, dtype)


def quantize(x):
    """`(q, scale)` of float `x` `(..., D)`: int8 `q` and float32 `scale`
    `(..., 1)` with `x ~ q * scale`, `|q| <= 127` (`scale = max|x| / 127`; an
    all-zeros vector gets scale 0)."""
    x = ops.cast(x, "float32")
    scale = ops.max(ops.abs(x), axis=-1, keepdims=True) / 127.0
    q = ops.round(x / ops.where(scale > 0, scale, 1.0))
    return ops.cast(q, "int8"), scale
