"""The benchmarks' measuring protocol: warm-up calls, medians, peak memory."""

import os
import sys

import numpy as np
import pytest

from benchmarks import memory, timing


def fake_clock(durations):
    """A clock under which the calls take `durations` seconds, in turn."""
    readings = [0]
    for seconds in durations:
        readings += [readings[-1], readings[-1] + seconds]
    return iter(readings[1:]).__next__


def test_time_calls_warms_up_then_takes_the_median_of_interleaved_calls():
    log = []
    functions = {name: (lambda name=name: log.append(name)) for name in "ab"}
    # Warm-ups a, a, b, b; then rounds a, b; a, b; a, b.
    clock = fake_clock([5, 1, 7, 1] + [1, 2, 1, 2, 100, 3])
    result = timing.time_calls(functions, calls=3, warmup=2, clock=clock)
    assert log == ["a", "a", "b", "b"] + ["a", "b"] * 3
    assert result["a"].warmups == (5, 1)
    assert result["a"].first == 5
    assert result["a"].times == (1, 1, 100)
    assert result["a"].median == 1
    assert result["b"].first == 7
    assert result["b"].times == (2, 2, 3)
    assert result["b"].median == 2


@pytest.mark.parametrize("calls, warmup", [(0, 1), (3, 0)])
def test_time_calls_needs_a_warm_up_and_a_timed_call(calls, warmup):
    with pytest.raises(ValueError, match="warm-up call and a timed call"):
        timing.time_calls({"f": lambda: None}, calls, warmup)


def test_describe_says_what_a_point_is():
    assert timing.describe(5, 2) == "median of 5 calls after 2 warm-up calls"
    assert timing.describe(1) == "median of 1 call after 1 warm-up call"


@pytest.mark.skipif(
    not os.access("/proc/self/clear_refs", os.W_OK), reason="Linux /proc only"
)
def test_peak_growth_sees_memory_freed_before_it_returns():
    def allocate(mib):
        block = np.ones(mib * 2**20 // 8)  # touched, so resident
        return float(block[-1])

    allocate(128)  # A high-water mark from before must not count.
    _, small = memory.peak_growth(lambda: allocate(1))
    result, large = memory.peak_growth(lambda: allocate(64))
    assert result == 1.0
    assert 60 * 2**20 < large < 80 * 2**20
    assert small < 16 * 2**20


def test_in_fresh_process_runs_a_benchmark_function_with_its_arguments():
    result = memory.in_fresh_process(_describe_in_child, 7, backend="numpy")
    assert result["describe"] == "median of 7 calls after 1 warm-up call"
    assert result["backend"] == "numpy"
    assert result["pid"] != os.getpid()
    assert result["executable"] == sys.executable


def _describe_in_child(calls):
    return {
        "describe": timing.describe(calls),
        "backend": os.environ["KERAS_BACKEND"],
        "pid": os.getpid(),
        "executable": sys.executable,
    }
