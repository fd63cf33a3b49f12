"""Which keys each chunk of query rows can see, from what is known when the
call is traced: the block structure of the chunked path (`key_windows`),
the loops it makes of the chunks (`chunk_groups`), and how a chunk takes its
window of keys (`windowed`, `keys_of`, `by_position`; `take_windows` for
all of a loop's chunks at once) and gives back their gradient (`add_keys` in
a loop, `add_windows` after it).

A chunk of rows `[a, b)` can see only keys in one range (and the attention
sinks): causal attention ends it at `b` (key `j <= i`), a sliding window
of `w` (the band `|i - j| < w`) starts it at `a - w + 1` and ends it at
`b + w - 1`, attention sinks add the first keys. Everything outside is
hidden by every mask, so the chunk need not compute it. Under XLA a loop's
shapes are static, so the chunks go in a few groups of consecutive chunks,
each a loop whose chunks see a window of keys of one static width (the
group's widest range) at a start of their own: the sinks, then `width` keys
from `start`. Keys inside a window that the masks hide are still masked
element by element, so the numbers are those of all keys.
"""

import functools
from typing import Any, NamedTuple

import numpy as np
from keras import ops

from keras_attn.ops.masks import merge_attention_masks, same_segment

# A group of chunks stacks its gradients of its windows of keys, rather than
# adding them to the sums the loop carries, where the stack holds at most this
# many times the keys (`few_keys`, `chunked._stacks_keys`): in a TensorFlow
# graph without XLA each update of a carried tensor copies it, so carried sums
# cost chunks x length (a sliding window's fwd+bwd at 16,384 tokens took 6.5x
# its time at 4,096, `benchmarks/block_skipping.py`). A causal call's widest
# groups would stack about the square of the length, so they still carry
# theirs. On PyTorch (`recomputed.attention`) such a group gathers its keys
# in one `take`, and keeps them for the call.
STACKED_KEYS = 4

# At most this many groups (loops) of chunks. Each is one more loop to trace
# and compile; 8 leave a causal call about 0.56 of its logits
# (`(count + count / 8) / (2 count)`, `benchmarks/block_skipping.py`).
MAX_GROUPS = 8


class KeyBand(NamedTuple):
    """What a caller's mask by position hides, as a promise: query `i` sees
    only keys `j` with `|i - j| < window` (any `j` for `None`), or with
    `j < sinks` (the attention sinks). The mask that hides them is passed
    as well; the band only tells the chunks which keys to skip."""

    window: int | None = None
    sinks: int = 0


class KeyWindows(NamedTuple):
    """The keys each chunk computes: the first `sinks` keys, then `width`
    keys from `starts[i]`, per group of chunks `(first, end, width)`."""

    groups: tuple
    starts: tuple
    sinks: int


def key_windows(length, key_length, count, rows, is_causal, band):
    """The `KeyWindows` of `count` chunks of `rows` query rows (the first at
    position 0, `length` of them real) over `key_length` keys, or `None`
    where every chunk sees every key."""
    return _key_windows(length, key_length, count, rows, is_causal, band, MAX_GROUPS)


# Asked on every call with the same static shapes (eager PyTorch traces
# nothing), and the group search costs seconds at thousands of chunks. The
# most groups is an argument, so that a cached answer is never another's.
@functools.lru_cache(maxsize=64)
def _key_windows(length, key_length, count, rows, is_causal, band, most):
    if not is_causal and (band is None or band.window is None):
        return None
    window = None if band is None else band.window
    sinks = min(band.sinks, key_length) if window is not None else 0
    ranges = [
        _visible(i * rows, min((i + 1) * rows, length) - 1, key_length, is_causal,
                 window, sinks)
        for i in range(count)
    ]  # fmt: skip
    widths = [max(high - low, 1) for low, high in ranges]
    groups = _groups(widths, most)
    if all(sinks + width >= key_length for _, _, width in groups):
        return None
    starts = []
    for first, end, width in groups:
        for _, high in ranges[first:end]:
            starts.append(min(max(high - width, sinks), key_length - width))
    return KeyWindows(tuple(groups), tuple(starts), sinks)


def _visible(first, last, key_length, is_causal, window, sinks):
    """`(low, high)`: the keys past the sinks that rows `first..last` may see."""
    low, high = 0, key_length
    if is_causal:
        high = min(high, last + 1)
    if window is not None:
        low = max(low, first - window + 1)
        high = min(high, last + window)
    low = max(low, sinks)
    return low, max(high, low)


def _groups(widths, most):
    """Consecutive groups `(first, end, width)`, at most `most`, that cover
    the chunks for the fewest keys `sum(chunks * width)` (dynamic
    programming over where each group ends)."""
    count = len(widths)
    most = min(most, count)
    inf = float("inf")
    # cost[g][n]: the first `n` chunks in `g` groups; cut[g][n]: the last's start.
    cost = [[inf] * (count + 1) for _ in range(most + 1)]
    cut = [[0] * (count + 1) for _ in range(most + 1)]
    cost[0][0] = 0
    for g in range(1, most + 1):
        for n in range(1, count + 1):
            widest = 0
            for start in range(n - 1, -1, -1):
                widest = max(widest, widths[start])
                total = cost[g - 1][start] + (n - start) * widest
                if total < cost[g][n]:
                    cost[g][n], cut[g][n] = total, start
    best = min(range(1, most + 1), key=lambda g: cost[g][count])
    groups, end = [], count
    for g in range(best, 0, -1):
        start = cut[g][end]
        groups.append((start, end, max(widths[start:end])))
        end = start
    return groups[::-1]


# How a chunk takes its window of keys, and gives back their gradient.


def by_position(queries, keys, view):
    """The masks by position `(C, S)` of `queries` over `keys` (positions),
    as the chunked path's `view` says (its `is_causal` and `band`)."""
    after = keys[None, :] - queries[:, None]  # key - query
    mask = after <= 0 if view.is_causal else None
    if view.band is not None:
        band = ops.abs(after) < view.band.window
        if view.band.sinks:
            band = ops.logical_or(band, keys[None, :] < view.band.sinks)
        mask = band if mask is None else ops.logical_and(mask, band)
    return mask


def keys_of(x, axis, start, window):
    """`x`'s first `sinks` and `width` from `start` on the keys' `axis`
    (as it is where that axis broadcasts)."""
    width, sinks = window
    axis = axis % len(x.shape)
    if x.shape[axis] == 1:
        return x
    starts = [0] * len(x.shape)
    starts[axis] = start
    shape = list(ops.shape(x))
    shape[axis] = width
    part = ops.slice(x, starts, shape)
    if not sinks:
        return part
    first = x[(slice(None),) * axis + (slice(0, sinks),)]
    return ops.concatenate([first, part], axis=axis)


def add_keys(total, part, chunk, view, options):
    """`total` `(B, S, K, D)` (or heads-major) with `part`, the gradient of
    the keys `keys_of` took for `view`, added where they came from."""
    if view.width is None:
        return total + part
    width, sinks = view.width, view.sinks
    axis = 2 if options.heads_major else 1
    starts = [0] * 4
    if sinks:
        shape = list(ops.shape(total))
        shape[axis] = sinks
        first = ops.slice(total, starts, shape)
        sink_part = part[(slice(None),) * axis + (slice(0, sinks),)]
        total = ops.slice_update(total, starts, first + sink_part)
        part = part[(slice(None),) * axis + (slice(sinks, None),)]
    starts[axis] = chunk["start"]
    return ops.slice_update(
        total, starts, keys_of(total, axis, chunk["start"], (width, 0)) + part
    )


def add_windows(total, stack, starts, view, options):
    """`total` `(B, S, K, D)` (or heads-major) with `stack` `(N, ...)`: the
    gradients of the keys `keys_of` took for `view` in each of `N` chunks
    from its start in `starts` `(N,)`, added where they came from, in one
    sum by position."""
    axis = 2 if options.heads_major else 1
    positions = _window_positions(starts, view)
    parts = ops.moveaxis(stack, axis + 1, 1)  # (N, sinks + width, ...)
    parts = ops.reshape(parts, [-1, *ops.shape(parts)[2:]])
    summed = ops.segment_sum(
        parts, ops.reshape(positions, (-1,)), num_segments=total.shape[axis]
    )
    return total + ops.moveaxis(summed, 0, axis)


def take_windows(x, axis, starts, view):
    """The keys `keys_of` takes for `view` in each of `N` chunks from its
    start in `starts` `(N,)`, from `x` (keys on `axis`), stacked `(N, ...)`
    in one gather: its gradient is one sum by position."""
    taken = ops.take(x, _window_positions(starts, view), axis=axis)
    return ops.moveaxis(taken, axis, 0)  # (N, ..., sinks + width, ...)


def _window_positions(starts, view):
    """`(N, sinks + width)`: the positions of the keys of `view` in each
    chunk from its start in `starts` `(N,)`."""
    count = ops.shape(starts)[0]
    positions = starts[:, None] + ops.arange(0, view.width, dtype="int32")[None]
    if not view.sinks:
        return positions
    first = ops.arange(0, view.sinks, dtype="int32")[None]
    first = ops.broadcast_to(first, (count, view.sinks))
    return ops.concatenate([first, positions], axis=1)


class View(NamedTuple):
    """The keys a loop's chunks compute: the first `sinks`, then `width`
    from each chunk's start (`None`: all keys), and the masks by position
    each builds: causal, and a `KeyBand` or `None`."""

    width: Any
    sinks: int
    is_causal: bool
    band: Any


def chunk_groups(chunks, windows, masking):
    """`[(chunks, View)]`: the chunks of each group of `windows` (a
    `KeyWindows`, or `None`: all chunks over all keys), with the
    start of each chunk's window, and the keys they compute; `masking`:
    the chunked path's `Masking` (its `is_causal` and `band`)."""
    if windows is None:
        return [(chunks, View(None, 0, masking.is_causal, masking.band))]
    groups = []
    for first, end, width in windows.groups:
        group = {name: x[first:end] for name, x in chunks.items()}
        starts = np.asarray(windows.starts[first:end], dtype="int32")
        group["start"] = ops.convert_to_tensor(starts)
        view = View(width, windows.sinks, masking.is_causal, masking.band)
        groups.append((group, view))
    return groups


def windowed(chunk, shared, key, value, view, options, taken=(None, None)):
    """`(chunk, shared, key, value)` over the keys of `view` (a `View`):
    the first `sinks` keys, then `width` from `chunk["start"]`, their masks
    and segments too; the masks by position built from the keys' positions
    (`chunk["causal"]`). `taken`: the chunk's keys and values of `view`
    taken already (`take_windows`), or `(None, None)`."""
    axis = 2 if options.heads_major else 1
    chunk = dict(chunk)
    if view.width is None:
        keys = ops.arange(0, ops.shape(key)[axis], dtype="int32")
    else:
        start, window = chunk["start"], (view.width, view.sinks)
        key, value = (
            keys_of(x, axis, start, window) if part is None else part
            for x, part in zip((key, value), taken, strict=True)
        )
        shared = {n: keys_of(x, -1, start, window) for n, x in shared.items()}
        if "mask" in chunk:
            chunk["mask"] = keys_of(chunk["mask"], -1, start, window)
        keys = ops.arange(0, view.width, dtype="int32") + start
        keys = ops.concatenate([ops.arange(0, view.sinks, dtype="int32"), keys])
    if "offset" in chunk:  # (C, sinks + width)
        queries = chunk.pop("offset") + ops.arange(
            0, ops.shape(chunk["query"])[1], dtype="int32"
        )
        chunk["causal"] = by_position(queries, keys, view)
    return chunk, shared, key, value


def few_keys(count, view, key_length):
    """Whether `count` chunks' windows of keys (`view`, a `View`)
    hold at most `STACKED_KEYS` times the `key_length` keys, so that a stack
    of them all stays linear in the length."""
    if view.width is None:
        return False
    return count * (view.sinks + view.width) <= STACKED_KEYS * key_length


def rows_have_keys(chunk, shared, view):
    """Whether the masks leave every row of a chunk over the keys of `view`
    a key: under a causal mask alone row `i` sees key 0, and a causal
    chunk's keys start at key 0 (`key_windows`). Then no row is
    opened (`explicit.visible`), which saves passes over the mask and the
    output."""
    masks = {"mask", "segments"} & {*chunk, *shared}
    return view.is_causal and view.band is None and not masks


def chunk_mask(chunk, shared):
    """A chunk's boolean mask (or `None`): its rows' or the shared mask, the
    causal mask of a window of keys, and where there are segment ids, its
    rows' segments against the keys' `(B, 1, C, S)`."""
    mask = merge_attention_masks(chunk.get("mask", shared.get("mask")))
    mask = merge_attention_masks(mask, chunk.get("causal"))
    if "segments" not in chunk:
        return mask
    return merge_attention_masks(
        mask, same_segment(chunk["segments"], shared["key_segments"])
    )
