"""The latent cache of multi-head latent attention (DeepSeek-V2): per token
the compressed key/value latent and the shared rotated key, not each head's
keys and values."""

import collections

import keras
from keras import ops

from keras_attn._checks import check_sizes
from keras_attn.cache import _slots
from keras_attn.ops.dtypes import cast_to, int32

if keras.config.backend() == "torch":
    from keras_attn import _torch_eager
else:
    _torch_eager = None


class LatentCache(_slots.Linear, collections.namedtuple("LatentCache", ["latent"])):
    """What `keras_attn.layers.MultiHeadLatentAttention` caches: `latent`
    `(batch, length, kv_lora_rank + qk_rope_head_dim)`, per position the
    normalized key/value latent `c` and then the rotated key `k_rope` that
    every head shares; slot `p` holds position `p` (as a `DenseCache`).

    Memory: `kv_lora_rank + qk_rope_head_dim` numbers a token and layer
    against `2 * heads * head_dim` for a dense cache (DeepSeek-V3's shapes:
    576 against 49152 at 128 heads of 192). Written in place on PyTorch
    where no gradient is recorded; always use the returned cache.

    Example:
    >>> cache = keras_attn.cache.LatentCache.empty(2, length=8, width=6)
    >>> latent, rope = np.ones((2, 1, 4), "float32"), np.ones((2, 1, 2), "float32")
    >>> cache = cache.update(latent, rope, index=5)
    >>> tuple(cache.read("float32").shape), cache.nbytes
    ((2, 8, 6), 384)
    >>> keras.ops.convert_to_numpy(cache.mask(5, 1))[0, 0, 0, 4:7].tolist()
    [True, True, False]
    """

    __slots__ = ()

    @classmethod
    def empty(cls, batch_size, length, width, dtype="float32"):
        """An all-zeros cache of `length` positions, `width` numbers each."""
        check_sizes(batch_size=batch_size, length=length, width=width)
        return cls(ops.zeros((batch_size, length, width), dtype))

    @property
    def length(self):
        """The number of slots."""
        return self.latent.shape[1]

    @property
    def nbytes(self):
        """The cache's memory, in bytes."""
        return _slots.nbytes(self.latent)

    def update(self, latent, rope, index):
        """`latent` `(batch, n, kv_lora_rank)` and the rotated key `rope`
        `(batch, n, qk_rope_head_dim)` written at positions `index, ...,
        index + n - 1`; returns the cache."""
        update = cast_to(ops.concatenate([latent, rope], axis=-1), self.latent.dtype)
        if _torch_eager is not None and not _torch_eager.recording():
            return LatentCache(_torch_eager.write_in_place(self.latent, update, index))
        return LatentCache(ops.slice_update(self.latent, [0, int32(index), 0], update))

    def read(self, dtype):
        """The cache `(batch, length, kv_lora_rank + qk_rope_head_dim)` in
        `dtype`."""
        return cast_to(self.latent, dtype)

    def take(self, positions):
        """A cache of the slots at `positions` (int32 `(batch or 1, n)`)."""
        shape = (ops.shape(self.latent)[0], positions.shape[1], self.latent.shape[2])
        at = ops.broadcast_to(positions[:, :, None], shape)
        return LatentCache(ops.take_along_axis(self.latent, at, axis=1))

    def grown(self, size):
        """The cache padded with zeros to `size` slots."""
        return LatentCache(
            ops.pad(self.latent, [[0, 0], [0, size - self.length], [0, 0]])
        )
