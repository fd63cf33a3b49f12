"""`MultiHeadAttention`'s key/value caches: what a cache argument must be,
an empty one, another sequence projected into one, and the keys and values a
call reads from one (writing its new ones first). The caches themselves are
`keras_attn.cache`'s."""

import keras
from keras import ops

from keras_attn._checks import check_fits, check_float
from keras_attn.cache import (
    DenseCache,
    Int8Cache,
    RollingCache,
    as_cache,
    empty_cache,
)
from keras_attn.cache.dense import written
from keras_attn.layers._projections import heads, project
from keras_attn.ops.dtypes import dtype_name


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
    """Raise unless `cache` is a float `(batch, 2, kv_heads, length, key_dim)`
    tensor, or a `DenseCache` or `Int8Cache` of that shape (a
    `RollingCache` holds slots, not positions: it is read by
    `decode_unchecked`, not by `call`)."""
    check_cacheable(layer)
    expected = (batch, 2, layer._kv_heads, None, layer._head_dim)
    if isinstance(cache, RollingCache):
        raise ValueError(
            f"`{name}` is a RollingCache, whose slots hold a sliding window's "
            "positions out of order: `call` takes a cache tensor, a "
            "DenseCache or an Int8Cache; a RollingCache goes to "
            "`decode_unchecked` (as `keras_attn.generation.generate` uses it)."
        )
    if isinstance(cache, Int8Cache):
        check_fits(f"{name}.kv", cache.kv, expected)
        check_fits(f"{name}.scale", cache.scale, (*expected[:4], 1))
        dtypes = (dtype_name(cache.kv.dtype), dtype_name(cache.scale.dtype))
        if dtypes != ("int8", "float32"):
            raise TypeError(
                f"`{name}` must hold int8 values and float32 scales (an "
                "`Int8Cache` as `get_empty_cache(dtype='int8')` makes it). "
                f"Received: {name}.kv.dtype={dtypes[0]}, "
                f"{name}.scale.dtype={dtypes[1]}."
            )
        return
    if isinstance(cache, DenseCache):
        cache, name = cache.kv, f"{name}.kv"
    elif isinstance(cache, tuple) or not hasattr(cache, "shape"):
        raise TypeError(
            f"`{name}` must be a tensor `(batch, 2, num_key_value_heads, "
            "length, key_dim)` or a `keras_attn.cache` object. "
            f"Received: {name} of type {type(cache).__name__}."
        )
    check_fits(name, cache, expected)
    check_float(name, cache)


def cache_length(cache):
    """The number of positions of a cache tensor or object."""
    return cache.length if isinstance(cache, tuple) else cache.shape[3]


def spec(cache):
    """The `keras.KerasTensor`s of a cache tensor or object (a symbolic
    call's output)."""
    return keras.tree.map_structure(
        lambda t: keras.KerasTensor(t.shape, dtype=t.dtype), cache
    )


def empty(layer, batch_size, length, dtype):
    """An all-zeros cache of `length` positions for `layer`'s keys and
    values: a tensor (Keras' form), or an `Int8Cache` for `"int8"`."""
    cache = empty_cache(batch_size, layer._kv_heads, length, layer._head_dim, dtype)
    return cache.kv if isinstance(cache, DenseCache) else cache


def projected(layer, value, key, calls):
    """The keys and values of another sequence, `(B, 2, K, S, D)`: its keys
    sit at positions 0, 1, ... (for the rotation)."""
    positions = None
    if layer.rope_max_wavelength is not None:
        positions = ops.arange(0, ops.shape(key)[1], dtype="int32")
    k = heads(layer, "key", key, positions, calls)
    v = project(layer.value_dense, value, calls)
    return ops.transpose(ops.stack([k, v], axis=1), (0, 1, 3, 2, 4))


def keys_and_values(layer, key, value, call, positions, dtype):
    """`(keys, values, cache)` of a call: projected (the keys normalized and
    rotated to `positions`) `(B, S, K, D)`; or with a cache, heads-major
    `(B, K, S, D)` in `dtype`, read from it after the new ones are written
    (`cache_update_index`), or as it holds them (precomputed)."""
    cache, index = call.cache, call.cache_update_index
    if cache is not None and index is None:  # keys and values precomputed
        return (*read(cache, dtype), cache)
    k = heads(layer, "key", key, positions)
    v = project(layer.value_dense, value)
    if cache is None:
        return k, v, None
    cache = write(cache, k, v, index)
    return (*read(cache, dtype), cache)


def read(cache, dtype):
    """A cache's keys and values `(B, K, S, D)` in `dtype`: a cache object's
    own, or a tensor's (Keras' form)."""
    return as_cache(cache).read(dtype)


def write(cache, keys, values, index):
    """`keys` and `values` `(B, n, K, D)` written at `index`: into a cache
    object (in place on PyTorch), or into a new tensor (Keras' form, the
    given one kept as it was); returns the cache."""
    if isinstance(cache, tuple):
        return cache.update(keys, values, index)
    return written(cache, keys, values, index)
