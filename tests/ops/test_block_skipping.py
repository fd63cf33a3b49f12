"""Block skipping on the chunked path (`keras_attn/ops/kernels/blocks.py`):
each chunk of query rows computes only the keys a mask by position may leave
visible, and the numbers are those of all keys."""

import keras
import numpy as np
import pytest

import keras_attn
from keras_attn.ops import plan
from keras_attn.ops.kernels import blocks, chunked, explicit
from tests.helpers.backend import (
    compiled_value_and_gradients,
    to_numpy,
    value_and_gradients,
)
from tests.helpers.builders import random_floats
from tests.helpers.contract import assert_outputs_close
from tests.helpers.doubles import count_key_widths, recorded

# (is_causal, window, sinks) with the numpy mask they stand for.
STRUCTURES = {
    "causal": (True, None, 0),
    "window": (False, 5, 0),
    "causal window with sinks": (True, 6, 2),
}


def numpy_mask(length, key_length, is_causal, window, sinks):
    rows, keys = np.arange(length)[:, None], np.arange(key_length)[None]
    mask = np.ones((length, key_length), bool)
    if window is not None:
        mask = (np.abs(rows - keys) < window) | (keys < sinks)
    return mask & (keys <= rows) if is_causal else mask


@pytest.mark.parametrize("structure", STRUCTURES)
def test_each_chunk_visits_exactly_the_keys_its_rows_may_see(structure, monkeypatch):
    """With a group per chunk, a chunk's keys are the sinks and one range
    that holds every key one of its rows sees, and no key that none sees:
    a key hidden from the whole chunk fails the test (27 rows in chunks of
    4, the last padded)."""
    monkeypatch.setattr(blocks, "MAX_GROUPS", 100)
    is_causal, window, sinks = STRUCTURES[structure]
    length, rows, count = 27, 4, 7
    band = blocks.KeyBand(window, sinks) if window else None
    windows = blocks.key_windows(length, length, count, rows, is_causal, band)
    mask = numpy_mask(length, length, is_causal, window, sinks)
    widths = {
        i: width for first, end, width in windows.groups for i in range(first, end)
    }
    for i, start in enumerate(windows.starts):
        seen = mask[i * rows : (i + 1) * rows].any(axis=0)  # (S,)
        visited = np.zeros(length, bool)
        visited[: windows.sinks] = True
        visited[start : start + widths[i]] = True
        np.testing.assert_array_equal(
            visited, seen | (np.arange(length) < windows.sinks)
        )


def test_causal_groups_visit_little_more_than_the_triangle():
    """At most `MAX_GROUPS` loops: a causal call of 64 chunks computes at
    most 0.6 of its logits (the triangle is 0.5); a key-padding-only call
    has no structure."""
    count = 64
    windows = blocks.key_windows(count * 4, count * 4, count, 4, True, None)
    assert len(windows.groups) <= blocks.MAX_GROUPS
    visited = sum((end - first) * width for first, end, width in windows.groups)
    assert visited <= 0.6 * count * count * 4
    assert blocks.key_windows(64, 64, 16, 4, False, None) is None


def band_case(is_causal, window, sinks, heads_major):
    """`(attend, reference, q, k, v)`: attention with a band by position
    (sliding window, sinks, causal; or causal with heads-major keys and sink
    logits) and keys padded per row, 27 rows, and the same with the band as
    a numpy mask."""
    q = random_floats(2, 27, 4, 8, seed=1, scale=3.0)
    layout = (2, 2, 27) if heads_major else (2, 27, 2)
    k, v = random_floats(*layout, 8, seed=2), random_floats(*layout, 6, seed=3)
    padding = np.random.default_rng(5).random((2, 1, 1, 27)) > 0.2
    band = None if window is None else (window, sinks)
    sink_logits = random_floats(4, seed=6) if heads_major else None

    def attend(q, k, v, mask=padding, band=band):
        return keras_attn.ops.attention.attend(
            q, k, v, mask=mask, is_causal=is_causal, band=band,
            heads_major=heads_major, sink_logits=sink_logits,
        )  # fmt: skip

    def reference(q, k, v):
        band_mask = True if window is None else numpy_mask(27, 27, False, window, sinks)
        return attend(q, k, v, mask=padding & band_mask, band=None)

    return attend, reference, q, k, v


@pytest.mark.parametrize(
    "structure, heads_major", [("causal", True), ("causal window with sinks", False)]
)
def test_skipped_blocks_give_the_numbers_of_all_keys(
    structure, heads_major, small_chunks, monkeypatch
):
    """A band by position (sliding window, sinks, causal; or causal with
    heads-major keys and sink logits), with keys padded per row, compiled as
    each backend trains: output and gradients of the query, keys and values
    equal the materialized path's with the band as a numpy mask, and some
    chunks computed fewer than 27 keys. On PyTorch (each chunk under
    `keras.remat`) the narrow windows' keys are taken for all their chunks
    in one gather (`blocks.take_windows`), or sliced chunk by chunk where a
    group's windows hold many keys (`blocks.STACKED_KEYS` 0 here): the same
    numbers either way."""
    is_causal, window, sinks = STRUCTURES[structure]
    attend, reference, q, k, v = band_case(is_causal, window, sinks, heads_major)
    widths = count_key_widths(monkeypatch)
    taken = recorded(monkeypatch, blocks, "take_windows", lambda *args: 1)
    ours = [compiled_value_and_gradients(attend, q, k, v)]
    assert small_chunks.calls, "the chunked path did not run"
    assert widths and min(widths) < 27, widths
    remat = keras.config.backend() in plan.CHUNKS_REMATERIALIZED
    assert bool(taken) == remat
    if remat:
        gathers = len(taken)
        monkeypatch.setattr(blocks, "STACKED_KEYS", 0)
        ours.append(compiled_value_and_gradients(attend, q, k, v))
        assert len(taken) == gathers  # sliced chunk by chunk
    small_chunks()
    reference = compiled_value_and_gradients(reference, q, k, v)
    for computed in ours:
        assert_outputs_close(computed, reference, tolerance=1e-5)


@pytest.mark.parametrize("stacked", [False, True], ids=["carried", "stacked"])
@pytest.mark.parametrize(
    "structure, heads_major",
    [("causal", True), ("causal window with sinks", False),
     ("causal window with sinks", True)],
)  # fmt: skip
def test_key_gradients_stacked_or_carried_give_the_same_numbers(
    structure, heads_major, stacked, small_chunks, monkeypatch
):
    """Our own gradient (on PyTorch too: its `keras.remat` turned off), each
    group's gradients of its keys either stacked and added by position after
    the loop (`chunked._backward_stacked`) or carried through it, run
    eagerly (on TensorFlow the kernels of a graph without XLA): equal to the
    materialized path's, heads-major keys and sink logits included."""
    monkeypatch.setattr(plan, "CHUNKS_REMATERIALIZED", ())
    monkeypatch.setattr(blocks, "STACKED_KEYS", float("inf") if stacked else 0)
    stacks = recorded(
        monkeypatch, chunked, "_backward_stacked", lambda *args: args[1].shape
    )
    is_causal, window, sinks = STRUCTURES[structure]
    attend, reference, q, k, v = band_case(is_causal, window, sinks, heads_major)
    ours = value_and_gradients(attend, q, k, v)
    assert small_chunks.calls and bool(stacks) == stacked, stacks
    small_chunks()
    expected = value_and_gradients(reference, q, k, v)
    assert_outputs_close(ours, expected, tolerance=1e-5)


def test_causal_chunks_open_no_rows_and_keep_their_numbers(small_chunks, monkeypatch):
    """Under a causal mask alone every row sees key 0, so the chunks open no
    empty rows (`explicit.open_empty_rows`), the padded rows of the last
    chunk included (27 rows in chunks of 4): output and gradients equal the
    materialized path's, which opens them; with a key padding mask they are
    opened."""
    opened = recorded(
        monkeypatch, explicit, "open_empty_rows", lambda mask: tuple(mask.shape)
    )
    q, k, v = (random_floats(2, 27, 2, 8, seed=seed) for seed in (1, 2, 3))

    def attend(q, k, v, mask=None):
        return keras_attn.ops.attention.attend(
            q, k, v, mask=mask, is_causal=True, flash_attention=False
        )

    ours = value_and_gradients(attend, q, k, v)
    assert small_chunks.calls and not opened, opened
    padding = np.arange(27)[None, None, None, :] < 20
    value_and_gradients(lambda q, k, v: attend(q, k, v, mask=padding), q, k, v)
    assert opened, "a key padding mask must open the rows it empties"
    small_chunks()
    expected = value_and_gradients(attend, q, k, v)
    assert_outputs_close(ours, expected, tolerance=1e-5)


def test_bands_stack_their_key_gradients_and_long_causal_groups_carry_them():
    """The rule (`blocks.STACKED_KEYS`): each group of a sliding window of
    256 at 16,384 tokens (64 chunks of 256 rows) stacks the gradients of its
    keys; a causal call's widest groups carry them, as their stacks would
    grow with the square of the length."""

    def stacks(band):
        windows = blocks.key_windows(16384, 16384, 64, 256, True, band)
        return [
            chunked._stacks_keys(
                end - first,
                blocks.View(width, windows.sinks, True, band),
                16384,
                "float32",
            )
            for first, end, width in windows.groups
        ]

    assert all(stacks(blocks.KeyBand(256, 4)))
    causal = stacks(None)
    assert any(causal) and not causal[-1], causal  # the widest is the last


def test_causal_windows_start_at_key_0():
    """What `blocks.rows_have_keys` relies on: under a causal mask alone
    every chunk's window of keys starts at key 0 (so each row, padded rows
    included, sees a key), with fewer, as many and more keys than rows."""
    for length, key_length in ((27, 19), (27, 27), (27, 40), (300, 300)):
        count = -(-length // 4)
        windows = blocks.key_windows(length, key_length, count, 4, True, None)
        assert windows is None or set(windows.starts) == {0}, windows


def test_a_sliding_window_layer_skips_keys_and_keeps_its_numbers(
    small_chunks, monkeypatch
):
    """`MultiHeadAttention(sliding_window=4, attention_sinks=1)`, causal:
    the chunks see at most the sinks and `4 + window - 1` keys, and the
    output equals the materialized path's."""
    layer = keras_attn.layers.MultiHeadAttention(
        num_heads=2,
        key_dim=4,
        sliding_window=4,
        attention_sinks=1,
        flash_attention=False,
    )
    x = random_floats(2, 23, 8, seed=4)
    widths = count_key_widths(monkeypatch)
    ours = layer(x, use_causal_mask=True)
    assert small_chunks.calls and widths and max(widths) <= 1 + 4 + 3, widths
    small_chunks()
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(ours),
        keras.ops.convert_to_numpy(layer(x, use_causal_mask=True)),
        atol=1e-5,
        rtol=1e-5,
    )


def test_within_causal_changes_only_which_keys_the_chunks_compute(
    small_chunks, monkeypatch
):
    """`within_causal` (a prefill's cache mask): in chunks, the keys past each
    chunk's rows are skipped and the numbers are the mask's; on the other
    kernels the mask is taken as it is, not folded with a causal mask again
    (shown with a mask that is not causal, which the promise rules out)."""
    q, k = random_floats(2, 9, 4, 8, seed=1), random_floats(2, 16, 2, 8, seed=2)
    slots = np.arange(16)[None, :] <= np.arange(9)[:, None]  # a cache's, (9, 16)

    def attend(mask, **kwargs):
        return to_numpy(keras_attn.ops.attention.attend(q, k, k, mask=mask, **kwargs))

    widths = count_key_widths(monkeypatch)
    chunked = attend(slots, within_causal=True, flash_attention=False)
    assert small_chunks.calls and min(widths) < 9, widths
    small_chunks()  # then each backend's default kernel: fused, or materialized
    np.testing.assert_allclose(chunked, attend(slots), atol=1e-5, rtol=1e-5)
    everything = np.ones((9, 16), bool)
    np.testing.assert_array_equal(
        attend(everything, within_causal=True), attend(everything)
    )
