"""How every benchmark times a call: warm-up calls, then the median of timed calls.

One home for the protocol, so that each table can say what its points are
(`describe`). A function is called `warmup` times untimed (the first call
compiles, traces or fills caches; its seconds are kept apart as `first`),
then `calls` more times, each timed alone; a point is the median of those.
Several functions are timed in interleaved rounds (each called once per round,
in the order given), so a slow spell of the machine falls on all of them.

Each function must return only once its work is done: convert a result to
numpy, as `predict_on_batch` and `generate` do, or JAX's asynchronous
dispatch would time the launch alone.
"""

import dataclasses
import statistics
import time


@dataclasses.dataclass(frozen=True)
class Timing:
    """Seconds of one function's calls: the warm-up ones and the timed ones."""

    warmups: tuple[float, ...]
    times: tuple[float, ...]

    @property
    def first(self):
        """Seconds of the first call (compiling included)."""
        return self.warmups[0]

    @property
    def median(self):
        """Median seconds of the timed calls."""
        return statistics.median(self.times)


def time_calls(functions, calls, warmup=1, clock=time.perf_counter):
    """Time each of `functions` (a dict of name -> function of no arguments).

    Each is called `warmup` times, then `calls` rounds call every function
    once, in the dict's order. Returns a dict of name -> `Timing`.
    """
    if calls < 1 or warmup < 1:
        raise ValueError(
            "Every point needs a warm-up call and a timed call. "
            f"Received: calls={calls}, warmup={warmup}."
        )

    def seconds(function):
        start = clock()
        function()
        return clock() - start

    warmups = {
        name: tuple(seconds(function) for _ in range(warmup))
        for name, function in functions.items()
    }
    times = {name: [] for name in functions}
    for _ in range(calls):
        for name, function in functions.items():
            times[name].append(seconds(function))
    return {name: Timing(warmups[name], tuple(times[name])) for name in functions}


def time_call(function, calls, warmup=1):
    """`time_calls` of one function: its `Timing`."""
    return time_calls({None: function}, calls, warmup)[None]


def describe(calls, warmup=1):
    """What a point is, for a table's caption: 'median of 5 calls after 1
    warm-up call'."""
    return (
        f"median of {calls} call{'s' if calls != 1 else ''} after {warmup} "
        f"warm-up call{'s' if warmup != 1 else ''}"
    )
