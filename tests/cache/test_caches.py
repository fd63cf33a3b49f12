"""The key/value caches of `keras_attn.cache`: writes and reads against numpy,
the dense masks against their definition, int8's error bound and memory, the
rolling cache against a dense one through a whole decoding, and each cache
as a tree (Keras' tree functions, `keras.ops.while_loop`). The layers with
cache objects: tests/layers/test_cache_objects.py."""

import contextlib

import keras
import numpy as np
import pytest
from keras import ops

from keras_attn.cache import DenseCache, Int8Cache, RollingCache, as_cache, quantize
from keras_attn.cache.dense import written
from tests.helpers.backend import BACKEND, to_numpy
from tests.helpers.builders import random_floats
from tests.helpers.references import visible_positions_reference

B, H, D, L = 2, 3, 5, 7  # batch, key/value heads, head width, slots


def dense_array(seed=0):
    """A cache tensor `(B, 2, H, L, D)` of random keys and values."""
    return random_floats(B, 2, H, L, D, seed=seed)


def tensor(array, dtype=None):
    return ops.convert_to_tensor(array, dtype)


def heads_major(x):
    """New keys or values `(B, n, K, D)` as a cache holds them, `(B, K, n, D)`."""
    return np.transpose(x, (0, 2, 1, 3))


# --- DenseCache ---------------------------------------------------------------


def test_as_cache_wraps_a_cache_tensor_and_keeps_a_cache_object():
    kv = tensor(dense_array())
    wrapped = as_cache(kv)
    assert type(wrapped) is DenseCache and wrapped.kv is kv
    int8 = Int8Cache.empty(B, H, L, D)
    assert as_cache(wrapped) is wrapped and as_cache(int8) is int8


@pytest.mark.parametrize("index, count", [(4, 1), (2, 3)])
def test_dense_update_then_read_equals_numpy(index, count):
    before = dense_array()
    keys = random_floats(B, count, H, D, seed=1)
    values = random_floats(B, count, H, D, seed=2)
    cache = DenseCache(tensor(before)).update(keys, values, index)
    expected = before.copy()
    expected[:, 0, :, index : index + count] = heads_major(keys)
    expected[:, 1, :, index : index + count] = heads_major(values)
    read_keys, read_values = cache.read("float32")
    np.testing.assert_array_equal(to_numpy(read_keys), expected[:, 0])
    np.testing.assert_array_equal(to_numpy(read_values), expected[:, 1])
    assert cache.length == L and cache.nbytes == before.nbytes


def test_dense_update_takes_a_tensor_index_and_reads_in_another_dtype():
    before = dense_array()
    keys, values = random_floats(B, 1, H, D, seed=1), random_floats(B, 1, H, D)
    cache = DenseCache(tensor(before)).update(keys, values, tensor(5, "int32"))
    read_keys, _ = cache.read("float16")
    assert keras.backend.standardize_dtype(read_keys.dtype) == "float16"
    expected = before[:, 0].copy()
    expected[:, :, 5:6] = heads_major(keys)
    np.testing.assert_array_equal(to_numpy(read_keys), expected.astype("float16"))


def test_written_leaves_the_given_tensor_unchanged():
    before = dense_array()
    kv = tensor(before)
    keys, values = random_floats(B, 2, H, D, seed=1), random_floats(B, 2, H, D)
    new = written(kv, keys, values, 3)
    np.testing.assert_array_equal(to_numpy(kv), before)
    expected = before.copy()
    expected[:, 0, :, 3:5], expected[:, 1, :, 3:5] = map(heads_major, (keys, values))
    np.testing.assert_array_equal(to_numpy(new), expected)


@pytest.mark.parametrize("kind", [DenseCache, Int8Cache])
def test_update_writes_in_place_on_torch_only(kind):
    """PyTorch with no gradient recorded (a decoding): the returned cache
    holds the very tensors it was given, now written; under autograd (which
    may have saved them for a backward pass), JAX and TensorFlow: new
    tensors, the given ones unchanged."""
    in_place = BACKEND == "torch"
    keys = random_floats(B, 1, H, D, seed=1)
    recorded = contextlib.nullcontext()
    if in_place:
        import torch

        recorded = torch.no_grad()
        with torch.enable_grad():  # autograd: a new cache
            cache = kind.empty(B, H, L, D)
            fresh = cache.update(keys, keys, 2)
            assert all(new is not old for old, new in zip(cache, fresh, strict=True))
    cache = kind.empty(B, H, L, D)
    with recorded:
        updated = cache.update(keys, 2 * keys, 2)
    for old, new in zip(cache, updated, strict=True):
        assert (new is old) == in_place
    step = np.abs(keys).max(-1).max() / 127  # int8's step, at most
    # The given cache reads what was written on PyTorch, zeros elsewhere.
    states = (updated, cache) if in_place else (updated,)
    for state in states:
        read_keys, read_values = map(to_numpy, state.read("float32"))
        for read, new in ((read_keys, keys), (read_values, 2 * keys)):
            np.testing.assert_allclose(read[:, :, 2], new[:, 0], atol=step, rtol=0)
            assert not read[:, :, 3:].any() and not read[:, :, :2].any()
    if not in_place:
        assert not any(to_numpy(t).any() for t in cache)


# --- Masks of the dense slots -----------------------------------------------


PADS = np.array([0, 3])  # the second row left-padded by 3
LONG = 11  # the mask tests' slots


def left_padded(pads=PADS, length=LONG):
    """bool `(batch, length)`, True from each row's `pads` on."""
    return np.arange(length)[None, :] >= pads[:, None]


@pytest.mark.parametrize(
    "index, count, padded, window, sinks",
    [
        (4, 1, False, None, None),  # causal, one token
        (3, 4, False, None, None),  # causal, a block at an offset
        (5, 1, True, None, None),  # left padding
        (2, 3, True, None, None),
        (8, 1, False, 3, None),  # a sliding window
        (4, 5, True, 2, None),
        (9, 1, False, 2, 2),  # window and sinks
        (9, 1, True, 2, 2),  # the sinks move with the left padding
        (4, 6, True, 3, 2),
    ],
)
def test_dense_mask_equals_the_positions_reference(index, count, padded, window, sinks):
    cache = DenseCache.empty(B, H, LONG, D)
    real = left_padded() if padded else None
    mask = to_numpy(cache.mask(index, count, real, window, sinks))[:, 0]
    expected = visible_positions_reference(index, count, LONG, real, window, sinks)
    assert mask.dtype == bool and mask.shape[-2:] == (count, LONG)
    np.testing.assert_array_equal(np.broadcast_to(mask, expected.shape), expected)


def test_dense_mask_counts_sinks_from_each_rows_first_real_position():
    cache = DenseCache.empty(B, H, LONG, D)
    mask = to_numpy(cache.mask(10, 1, left_padded(), window=2, sinks=2))[:, 0]
    assert [np.flatnonzero(row[0]).tolist() for row in mask] == [
        [0, 1, 9, 10],
        [3, 4, 9, 10],
    ]


def test_dense_mask_takes_a_tensor_index():
    cache = DenseCache.empty(B, H, LONG, D)
    mask = to_numpy(cache.mask(tensor(6, "int32"), 1, left_padded(), 3, 1))[:, 0]
    expected = visible_positions_reference(6, 1, LONG, left_padded(), 3, 1)
    np.testing.assert_array_equal(mask, expected)


@pytest.mark.parametrize("kind", [DenseCache, Int8Cache])
def test_top_left_causal_only_where_the_mask_is_within_it(kind):
    """`top_left_causal`: the Python int 0 only, where every mask the cache
    gives (padded, windowed, with sinks) sees no slot past its query's own,
    so `is_causal` changes nothing but which slots attention may skip."""
    cache = kind.empty(B, H, LONG, D)
    assert cache.top_left_causal(0)
    assert not cache.top_left_causal(3) and not cache.top_left_causal(
        tensor(0, "int32")
    )
    triangle = np.tril(np.ones((6, LONG), bool))
    for real, window, sinks in ((None, None, None), (left_padded(), 3, 2)):
        mask = to_numpy(cache.mask(0, 6, real, window, sinks))[:, 0]
        assert not (mask & ~triangle).any()
    rolling = RollingCache.from_prefill(cache, 4, tensor([0, 1], "int32"), 3, 1)
    assert not rolling.top_left_causal(0)


# --- Int8Cache ----------------------------------------------------------------


def test_int8_reads_within_half_a_step_of_what_was_written():
    """Each vector `x` reads back within `max|x| / 254` per element; an
    all-zero vector reads back zero, and so does every slot not written."""
    scales = np.array([0.01, 1.0, 30.0], "float32")[None, None, :, None]
    keys = random_floats(B, 3, H, D, seed=1) * scales  # a scale per head
    values = random_floats(B, 3, H, D, seed=2) * scales
    keys[1, 2, 0] = 0.0
    cache = Int8Cache.empty(B, H, L, D).update(keys, values, 2)
    for new, read in zip((keys, values), cache.read("float32"), strict=True):
        read = to_numpy(read)
        bound = np.abs(new).max(-1, keepdims=True) / 254
        error = np.abs(read[:, :, 2:5] - heads_major(new))
        assert np.all(error <= heads_major(bound) * (1 + 1e-6))
        assert not read[:, :, :2].any() and not read[:, :, 5:].any()
    read_keys = to_numpy(cache.read("float32")[0])
    assert not read_keys[1, 0, 4].any()  # the zero vector
    assert to_numpy(cache.scale)[1, 0, 0, 4, 0] == 0


@pytest.mark.parametrize("head_dim", [4, 5])
def test_int8_memory_is_head_dim_plus_4_bytes_a_vector(head_dim):
    int8 = Int8Cache.empty(B, H, L, head_dim)
    dense = DenseCache.empty(B, H, L, head_dim, "float32")
    assert int8.nbytes / dense.nbytes == (head_dim + 4) / (4 * head_dim)
    assert dense.nbytes == B * 2 * H * L * head_dim * 4


def test_quantize_gives_int8_and_float32_scales():
    x = random_floats(B, 4, H, D, seed=3) * 5
    q, scale = quantize(tensor(x))
    assert keras.backend.standardize_dtype(q.dtype) == "int8"
    assert keras.backend.standardize_dtype(scale.dtype) == "float32"
    assert tuple(q.shape) == x.shape and tuple(scale.shape) == (*x.shape[:-1], 1)
    q, scale = to_numpy(q), to_numpy(scale)
    np.testing.assert_allclose(scale, np.abs(x).max(-1, keepdims=True) / 127)
    assert np.abs(q).max() == 127 and np.all(np.abs(q * scale - x) <= scale / 2 + 1e-6)


# --- RollingCache -------------------------------------------------------------

WINDOW, SINKS, STEPS = 4, 2, 16  # positions 0, ..., STEPS - 1
ROLL_PADS = np.array([0, 3, 4])  # 5, 2 and 1 real tokens in a prompt of 5
ROLL_HEADS = 2


def assert_same_vectors(got, want, atol=1e-6):
    """`got` and `want` `(n, X)` hold the same vectors, in any order."""
    assert got.shape == want.shape
    if not len(got):
        return
    distance = np.abs(got[:, None] - want[None]).max(-1)  # (n, n)
    match = distance.argmin(1)
    assert sorted(match.tolist()) == list(range(len(want)))
    assert distance[np.arange(len(got)), match].max() <= atol


def visible(cache_read, mask_row, row):
    """The vectors `(n, K * D)` of `row` that `mask_row` `(S,)` shows."""
    slots = np.transpose(cache_read[row], (1, 0, 2))[mask_row]  # (n, K, D)
    return slots.reshape(-1, np.prod(slots.shape[1:]))


def check_rolling_step(rolling, dense, index, real):
    """At `index`, the rolling cache shows each row the keys and values the
    dense cache shows it under the window and sinks, and each slot holds the
    position `positions` says."""
    position = tensor(index, "int32")
    shown = to_numpy(rolling.mask(position, 1, tensor(real)))[:, 0, 0]  # (B, S + W)
    held = to_numpy(rolling.positions(position))  # (B, S + W)
    expected = to_numpy(dense.mask(position, 1, tensor(real), WINDOW, SINKS))[:, 0]
    expected = np.broadcast_to(expected, (len(real), 1, STEPS))[:, 0]
    for ours, theirs in zip(
        map(to_numpy, rolling.read("float32")),
        map(to_numpy, dense.read("float32")),
        strict=True,
    ):
        for row in range(len(real)):
            assert_same_vectors(
                visible(ours, shown[row], row), visible(theirs, expected[row], row)
            )
            assert (
                sorted(held[row][shown[row]]) == np.flatnonzero(expected[row]).tolist()
            )
            written_slots = (held[row] >= 0) & (held[row] <= index)
            assert np.all(written_slots[shown[row]])
            np.testing.assert_allclose(
                ours[row][:, written_slots],
                theirs[row][:, held[row][written_slots]],
                atol=1e-6,
            )


@pytest.mark.parametrize("width", [5, 4])
@pytest.mark.parametrize("kind", [DenseCache, Int8Cache])
def test_rolling_cache_shows_what_a_dense_cache_shows_at_every_step(kind, width):
    """A decoding of `STEPS` positions after a prompt of `width`: row 1's
    sinks are positions 3 and 4, row 2's 4 and 5 (one real prompt token,
    fewer than the sinks: a sink arrives during the steps, as row 1's does
    with a prompt of 4)."""
    keys = random_floats(3, STEPS, ROLL_HEADS, D, seed=1)
    values = random_floats(3, STEPS, ROLL_HEADS, D, seed=2)
    real = left_padded(ROLL_PADS, STEPS)
    dense = kind.empty(3, ROLL_HEADS, STEPS, D).update(keys, values, 0)
    prefill = kind.empty(3, ROLL_HEADS, STEPS, D)
    prefill = prefill.update(keys[:, :width], values[:, :width], 0)
    rolling = RollingCache.from_prefill(
        prefill, width, tensor(ROLL_PADS, "int32"), WINDOW, SINKS
    )
    assert isinstance(rolling.slots, kind) and rolling.length == SINKS + WINDOW
    assert rolling.window == WINDOW
    np.testing.assert_array_equal(to_numpy(rolling.sinks), ROLL_PADS[:, None] + [0, 1])
    memory = rolling.nbytes
    assert memory == kind.empty(3, ROLL_HEADS, SINKS + WINDOW, D).nbytes + 3 * SINKS * 4
    check_rolling_step(rolling, dense, width - 1, real)
    for index in range(width, STEPS):
        at = slice(index, index + 1)
        rolling = rolling.update(keys[:, at], values[:, at], tensor(index, "int32"))
        assert rolling.nbytes == memory
        check_rolling_step(rolling, dense, index, real)


def test_rolling_cache_sees_a_sink_arriving_after_the_prompt():
    """The case the decoding test covers, spelled out (at its sizes, and
    with Python int indices): with a prompt of 4, row 1 (left-padded by 3)
    gets its second sink, position 4, at the first step, and row 2 both of
    its sinks, 4 and 5; each keeps seeing them once the window has passed."""
    keys = random_floats(3, STEPS, ROLL_HEADS, D, seed=3)
    prefill = DenseCache.empty(3, ROLL_HEADS, STEPS, D)
    prefill = prefill.update(keys[:, :4], keys[:, :4], 0)
    pads = tensor(ROLL_PADS, "int32")
    rolling = RollingCache.from_prefill(prefill, 4, pads, WINDOW, SINKS)
    for index in range(4, 10):
        at = slice(index, index + 1)
        rolling = rolling.update(keys[:, at], keys[:, at], index)
    shown = to_numpy(rolling.mask(9, 1, tensor(left_padded(ROLL_PADS, STEPS))))[:, 0]
    held = to_numpy(rolling.positions(9))
    seen = [sorted(held[row][shown[row, 0]].tolist()) for row in range(3)]
    assert seen == [[0, 1, 6, 7, 8, 9], [3, 4, 6, 7, 8, 9], [4, 5, 6, 7, 8, 9]]
    read = to_numpy(rolling.read("float32")[0])  # (B, K, S + W, D)
    for row in range(3):
        slots = shown[row, 0]
        np.testing.assert_array_equal(
            read[row][:, slots], heads_major(keys)[row][:, held[row][slots]]
        )


# --- Caches as trees --------------------------------------------------------


def rolling(kind):
    keys = random_floats(B, 3, H, D, seed=6)
    prefill = kind.empty(B, H, L, D).update(keys, keys, 0)
    return RollingCache.from_prefill(prefill, 3, tensor([0, 1], "int32"), 3, 1)


CACHES = {
    "dense": lambda: DenseCache.empty(B, H, L, D),
    "int8": lambda: Int8Cache.empty(B, H, L, D),
    "rolling_dense": lambda: rolling(DenseCache),
    "rolling_int8": lambda: rolling(Int8Cache),
}


@pytest.mark.parametrize("name", list(CACHES))
def test_cache_round_trips_through_keras_tree(name):
    cache = CACHES[name]()
    flat = keras.tree.flatten(cache)
    assert len(flat) == {"dense": 1, "int8": 2, "rolling_dense": 2}.get(name, 3)
    assert all(ops.is_tensor(t) for t in flat)
    packed = keras.tree.pack_sequence_as(cache, flat)
    mapped = keras.tree.map_structure(lambda t: t, cache)
    for tree in (packed, mapped):
        assert type(tree) is type(cache)
        if isinstance(cache, RollingCache):
            assert type(tree.slots) is type(cache.slots)
        assert all(a is b for a, b in zip(keras.tree.flatten(tree), flat, strict=True))


@pytest.mark.parametrize("name", list(CACHES))
def test_cache_is_the_state_of_a_while_loop(name):
    """Updates inside `keras.ops.while_loop` leave the cache of a Python
    loop of the same updates, and its class."""
    start, stop = 3, 7
    keys = random_floats(B, stop, H, D, seed=4)
    values = random_floats(B, stop, H, D, seed=5)
    keys_tensor, values_tensor = tensor(keys), tensor(values)

    def body(i, cache):
        at = ops.expand_dims(i, 0)
        new_keys = ops.take(keys_tensor, at, axis=1)
        new_values = ops.take(values_tensor, at, axis=1)
        return i + 1, cache.update(new_keys, new_values, i)

    _, looped = ops.while_loop(
        lambda i, cache: i < stop, body, (tensor(start, "int32"), CACHES[name]())
    )
    expected = CACHES[name]()
    for i in range(start, stop):
        expected = expected.update(keys[:, i : i + 1], values[:, i : i + 1], i)
    assert type(looped) is type(expected)
    for got, want in zip(
        keras.tree.flatten(looped), keras.tree.flatten(expected), strict=True
    ):
        np.testing.assert_array_equal(to_numpy(got), to_numpy(want))
    before = to_numpy(CACHES[name]().read("float32")[0])
    assert not np.array_equal(to_numpy(looped.read("float32")[0]), before)
