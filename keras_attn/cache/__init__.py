"""Key/value caches: what a decoding step writes and the next one reads, as
objects that are passed (to `MultiHeadAttention`, the decoder blocks'
`decode_unchecked`, `generate`), never state that is set.

- `DenseCache`: a slot per position, at a static shape, written in place on
  PyTorch (gpt-fast's `KVCache`, Hugging Face's `StaticCache`);
- `Int8Cache`: the same slots, keys and values in int8 with a float32 scale
  per token and head, dequantized inside the step that reads them;
- `RollingCache`: a sliding window's sinks and ring of `window` slots, over
  either of them;
- `LatentCache`: multi-head latent attention's compressed latent and shared
  rotary key per position (`MultiHeadLatentAttention`).

Each is a named tuple of tensors, so a cache travels through `jax.jit`,
`tf.function`, `keras.ops.while_loop` and `torch.export` as those trees
do, with no registration, and every fact besides its tensors (its length,
heads, window, sinks) is read from their shapes. They share a few members:

- `update(keys, values, index)`: new keys and values `(batch, n, kv_heads,
  head_dim)` written at position `index` onwards; returns the cache;
- `read(dtype)`: the keys and values a step attends over, each
  `(batch, kv_heads, slots, head_dim)`;
- `positions(index)`: the position each slot holds once `index` is written;
- `mask(index, count, real, window, sinks)`: which slots the queries at
  `index, ..., index + count - 1` see (written, causal, real tokens only,
  the layer's sliding window and attention sinks);
- `top_left_causal(index)`: whether that mask is known, when the call is
  traced, to lie within the top-left causal mask (query `i` sees no slot
  past `i`: a prompt's prefill at the Python int 0 on slots that hold their
  positions), so that attention may skip the slots past each query
  (`attend`'s `within_causal`);
- `grown(size)`: the cache padded to `size` slots (a decoding's segments;
  not the rolling cache, which keeps its window);
- `length` (slots) and `nbytes` (memory).

The latent cache's `update` and `read` take and give its latent and rotary
key instead of keys and values; the other members are the same.
"""

from keras_attn.cache.dense import DenseCache
from keras_attn.cache.int8 import Int8Cache, quantize
from keras_attn.cache.latent import LatentCache
from keras_attn.cache.rolling import RollingCache

__all__ = [
    "DenseCache",
    "Int8Cache",
    "LatentCache",
    "RollingCache",
    "as_cache",
    "empty_cache",
    "quantize",
]


def empty_cache(batch_size, num_heads, length, head_dim, dtype):
    """An empty `Int8Cache` for `dtype="int8"`, else a `DenseCache` of `dtype`."""
    kind = Int8Cache if dtype == "int8" else DenseCache
    return kind.empty(batch_size, num_heads, length, head_dim, dtype)


def as_cache(cache):
    """A cache object of `cache`: a cache tensor (Keras' and keras-hub's
    form, `(batch, 2, kv_heads, length, head_dim)`) as a `DenseCache`, a
    cache object as it is."""
    return cache if isinstance(cache, tuple) else DenseCache(cache)
