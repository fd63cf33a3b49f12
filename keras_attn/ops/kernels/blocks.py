"""Which keys each chunk of query rows can see, from what is known when the
call is traced: the block structure of the chunked path.

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

from typing import NamedTuple

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
    groups = _groups(widths, MAX_GROUPS)
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
