"""The layers with `keras_attn.cache` objects: `MultiHeadAttention` called
with a `DenseCache` or an `Int8Cache` as with Keras' cache tensor, the
caches it refuses, and the decoding twins (`decode_unchecked` of the
attention and of the decoder block) against the layers' own calls. The
caches themselves: tests/cache/test_caches.py."""

import keras
import numpy as np
import pytest
from keras import ops

from keras_attn import MultiHeadAttention, TransformerDecoder
from keras_attn.cache import DenseCache, Int8Cache, RollingCache
from tests.helpers.backend import to_numpy
from tests.helpers.builders import random_floats

B, T, WIDTH = 3, 5, 10  # batch, positions, width
PROMPT = 3  # the first call writes positions 0, 1, 2; then one at a time
TOLERANCE = {"atol": 1e-5, "rtol": 1e-5}


def attention(**options):
    """Grouped-query attention (4 heads over 2 of width 6), built."""
    layer = MultiHeadAttention(4, key_dim=6, num_key_value_heads=2, **options)
    layer.build((B, T, WIDTH))
    return layer


def index(i):
    return ops.convert_to_tensor(i, "int32")


def spans():
    """`(start, stop)` of each cached call: the prompt, then one token."""
    return [(0, PROMPT)] + [(i, i + 1) for i in range(PROMPT, T)]


def step_calls(layer, x, cache):
    """`layer` called on `x` span by span over `cache`, as Keras' layer is
    called: `(outputs (B, T, width), the last cache, every returned cache)`."""
    outputs, returned = [], []
    for start, stop in spans():
        output, cache = layer(
            x[:, start:stop],
            use_causal_mask=True,
            cache=cache,
            cache_update_index=start,
        )
        outputs.append(to_numpy(output))
        returned.append(cache)
    return np.concatenate(outputs, axis=1), cache, returned


# --- MultiHeadAttention's call with cache objects ---------------------------


def test_dense_cache_steps_as_the_tensor_cache_and_the_full_call():
    layer = attention()
    x = random_floats(B, T, WIDTH, seed=1)
    full = to_numpy(layer(x, use_causal_mask=True))
    tensor_outputs, tensor_cache, _ = step_calls(layer, x, layer.get_empty_cache(B, T))
    outputs, cache, returned = step_calls(
        layer, x, DenseCache(layer.get_empty_cache(B, T))
    )
    np.testing.assert_allclose(tensor_outputs, full, **TOLERANCE)
    np.testing.assert_allclose(outputs, tensor_outputs, **TOLERANCE)
    assert all(type(c) is DenseCache for c in returned)
    assert not isinstance(tensor_cache, tuple)
    np.testing.assert_allclose(to_numpy(cache.kv), to_numpy(tensor_cache), **TOLERANCE)
    assert tuple(cache.kv.shape) == (B, 2, 2, T, 6)


def test_int8_cache_steps_close_to_the_float_call():
    layer = attention()
    x = random_floats(B, T, WIDTH, seed=2)
    full = to_numpy(layer(x, use_causal_mask=True))
    empty = layer.get_empty_cache(B, T, dtype="int8")
    assert type(empty) is Int8Cache
    assert tuple(empty.kv.shape) == (B, 2, 2, T, 6)
    outputs, cache, returned = step_calls(layer, x, empty)
    assert all(type(c) is Int8Cache for c in returned)
    error = np.abs(outputs - full).max()
    assert 0 < error <= 2e-2 * np.abs(full).max()  # quantized, and close
    keys = to_numpy(cache.read("float32")[0])
    assert np.abs(keys).min(axis=-1).max() > 0  # every position written


def test_call_refuses_a_rolling_cache_and_caches_of_other_types():
    layer = attention(sliding_window=2)
    x = random_floats(B, 1, WIDTH)
    prefill = DenseCache(layer.get_empty_cache(B, T))
    pads = ops.zeros((B,), "int32")
    rolling = RollingCache.from_prefill(prefill, 3, pads, window=2, sinks=1)
    with pytest.raises(ValueError, match="is a RollingCache.*`decode_unchecked`"):
        layer(x, cache=rolling, cache_update_index=3)
    tensor = layer.get_empty_cache(B, T)
    for wrong in ((tensor, tensor), {"kv": tensor}):
        with pytest.raises(TypeError, match="`cache` must be a tensor"):
            layer(x, cache=wrong, cache_update_index=3)


# --- decode_unchecked -------------------------------------------------------


def test_decode_unchecked_equals_the_cached_call_with_rotary_positions():
    """Self-attention: the keys written at the index (rotated to explicit
    `positions`), the slots seen by `cache.mask`, as the layer's call with
    the cache tensor and its default positions."""
    layer = attention(rope_max_wavelength=100.0)
    x = random_floats(B, T, WIDTH, seed=3)
    full = to_numpy(layer(x, use_causal_mask=True))
    called, tensor_cache, _ = step_calls(layer, x, layer.get_empty_cache(B, T))
    cache, outputs = DenseCache(layer.get_empty_cache(B, T)), []
    for start, stop in spans():
        positions = np.broadcast_to(
            np.arange(start, stop, dtype="int32"), (B, stop - start)
        )
        output, cache = layer.decode_unchecked(
            ops.convert_to_tensor(x[:, start:stop]),
            cache,
            index(start),
            positions=ops.convert_to_tensor(positions),
            mask=cache.mask(index(start), stop - start),
        )
        assert type(cache) is DenseCache
        outputs.append(to_numpy(output))
    np.testing.assert_allclose(called, full, **TOLERANCE)
    np.testing.assert_allclose(np.concatenate(outputs, axis=1), called, **TOLERANCE)
    np.testing.assert_allclose(to_numpy(cache.kv), to_numpy(tensor_cache), **TOLERANCE)


def test_decode_unchecked_cross_attention_reads_a_precomputed_cache():
    """Cross-attention: nothing written (no index), as the call with the
    cache tensor and as the call on the source; with a source padding mask
    too."""
    layer = MultiHeadAttention(4, key_dim=5, num_key_value_heads=2)
    query, source = random_floats(B, 2, WIDTH, seed=4), random_floats(B, T, 9, seed=5)
    direct = to_numpy(layer(query, source))
    tensor = layer.compute_cache(source)
    called, returned = layer(query, cache=tensor)
    decoded, cache = layer.decode_unchecked(
        ops.convert_to_tensor(query), DenseCache(tensor)
    )
    np.testing.assert_allclose(to_numpy(called), direct, **TOLERANCE)
    np.testing.assert_allclose(to_numpy(decoded), direct, **TOLERANCE)
    assert type(cache) is DenseCache and cache.kv is tensor
    padding = np.arange(T)[None, :] < np.array([[T], [4], [1]])  # (B, T)
    masked = to_numpy(layer(query, source, value_mask=padding))
    decoded, _ = layer.decode_unchecked(
        ops.convert_to_tensor(query),
        DenseCache(tensor),
        mask=ops.convert_to_tensor(padding[:, None, :]),
    )
    np.testing.assert_allclose(to_numpy(decoded), masked, **TOLERANCE)
    assert not np.allclose(masked, direct)


# --- TransformerDecoder.decode_unchecked --------------------------------------


@pytest.mark.parametrize("cross", [False, True], ids=["decoder_only", "cross"])
def test_decoder_decode_unchecked_equals_its_cached_call(cross):
    decoder = TransformerDecoder(13, 2, num_key_value_heads=1)
    x = random_floats(B, T, WIDTH, seed=6)
    source = random_floats(B, 4, WIDTH, seed=7) if cross else None
    full = to_numpy(decoder(x, source))
    cross_tensor = decoder.compute_cross_attention_cache(source) if cross else None
    cross_cache = DenseCache(cross_tensor) if cross else None
    tensor_cache = decoder.get_empty_self_attention_cache(B, T)
    cache = DenseCache(decoder.get_empty_self_attention_cache(B, T))
    called, decoded = [], []
    for start, stop in spans():
        step = x[:, start:stop]
        extra = {"cross_attention_cache": cross_tensor} if cross else {}
        output, tensor_cache, *_ = decoder(
            step,
            self_attention_cache=tensor_cache,
            self_attention_cache_update_index=start,
            **extra,
        )
        called.append(to_numpy(output))
        output, cache = decoder.decode_unchecked(
            ops.convert_to_tensor(step),
            cache,
            index(start),
            mask=cache.mask(index(start), stop - start),
            cross_cache=cross_cache,
        )
        assert type(cache) is DenseCache
        decoded.append(to_numpy(output))
    called, decoded = np.concatenate(called, axis=1), np.concatenate(decoded, axis=1)
    np.testing.assert_allclose(called, full, **TOLERANCE)
    np.testing.assert_allclose(decoded, called, **TOLERANCE)
    np.testing.assert_allclose(to_numpy(cache.kv), to_numpy(tensor_cache), **TOLERANCE)


def test_symbolic_calls_return_cache_objects_of_specs():
    """A call on a `keras.Input` with a cache object returns the same class
    of cache, its tensors' specs; the decoder's scores span the cache."""
    inputs = keras.Input((1, WIDTH), batch_size=B)
    layer = attention()
    for empty in (DenseCache(layer.get_empty_cache(B, T)), Int8Cache.empty(B, 2, T, 6)):
        _, cache = layer(inputs, cache=empty, cache_update_index=0)
        assert type(cache) is type(empty)
        assert [tuple(t.shape) for t in cache] == [tuple(t.shape) for t in empty]
    decoder = TransformerDecoder(13, 2, num_key_value_heads=1)
    source = random_floats(B, 4, WIDTH, seed=8)
    decoder(random_floats(B, T, WIDTH), source)
    cross = DenseCache(decoder.compute_cross_attention_cache(source))
    _, scores, _, self_cache, cross_cache = decoder(
        inputs,
        self_attention_cache=DenseCache(decoder.get_empty_self_attention_cache(B, T)),
        self_attention_cache_update_index=0,
        cross_attention_cache=cross,
        return_attention_scores=True,
    )
    assert tuple(scores.shape) == (B, 2, 1, T)
    assert type(self_cache) is DenseCache and type(cross_cache) is DenseCache
    assert tuple(self_cache.kv.shape) == (B, 2, 1, T, 5)
    assert tuple(cross_cache.kv.shape) == (B, 2, 1, 4, 5)
