"""Eager attention calls on JAX: one XLA program a call against one per op.

    OMP_NUM_THREADS=1 KERAS_BACKEND=jax python benchmarks/jax_eager.py

`keras_attn/_jax_eager.py` runs an eager call's attention (masks and
kernel) and its rotary positions each as one `jax.jit` program; before, each
op ran (and at new shapes compiled) as its own. A `MultiHeadAttention` layer
(width 64, 4 heads, rotary positions, causal, a padding mask) on batch 2, in
both forms (`op by op`: the same code with `_jax_eager.eager` patched to
`False`, as before the change):

- `first call`: at a length not seen before (all compiled programs dropped
  first, `jax.clear_caches()`), the median over `--lengths` lengths, with
  the programs it compiled;
- `call`: the median of `--calls` calls at one length after a warm-up call
  (`benchmarks/timing.py`), the two forms interleaved.

Results go to `benchmarks/results/jax_eager.md` (or `--results DIR`).
"""

import argparse
import os
import statistics
import sys
import time
from unittest import mock

import keras
import numpy as np

if keras.config.backend() != "jax":
    sys.exit("Run with KERAS_BACKEND=jax: the one-program path is JAX's.")
import jax  # noqa: E402
import jax.monitoring  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.report import write_report  # noqa: E402
from benchmarks.timing import describe, time_calls  # noqa: E402
from keras_attn import MultiHeadAttention, _jax_eager  # noqa: E402

B, WIDTH, HEADS = 2, 64, 4
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
FORMS = {"one program": True, "op by op": False}
_COMPILED = []
jax.monitoring.register_event_duration_secs_listener(
    lambda event, duration, **kwargs: (
        _COMPILED.append(event)
        if event == "/jax/core/compile/backend_compile_duration"
        else None
    )
)


def call_function(layer, length, one_program):
    """A function of no arguments: one eager call at `length`, as numpy."""
    x = np.random.default_rng(length).standard_normal((B, length, WIDTH), "float32")
    padding = np.arange(length) < np.array([[length], [length - 2]])
    eager = _jax_eager.eager if one_program else (lambda tensor: False)

    def call():
        with mock.patch.object(_jax_eager, "eager", eager):
            return np.asarray(layer(x, query_mask=padding, use_causal_mask=True))

    return call


def first_calls(layer, lengths):
    """`form -> (median seconds, median programs)` of first calls."""
    seconds, programs = {form: [] for form in FORMS}, {form: [] for form in FORMS}
    for length in lengths:
        for form, one_program in FORMS.items():
            jax.clear_caches()
            call = call_function(layer, length, one_program)
            _COMPILED.clear()
            start = time.perf_counter()
            call()
            seconds[form].append(time.perf_counter() - start)
            programs[form].append(len(_COMPILED))
    return {
        form: (statistics.median(seconds[form]), statistics.median(programs[form]))
        for form in FORMS
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, default=7)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--results", default=RESULTS)
    args = parser.parse_args()
    layer = MultiHeadAttention(HEADS, rope_max_wavelength=10_000.0)
    layer(np.zeros((B, 3, WIDTH), "float32"))
    first = first_calls(layer, range(16, 16 + args.lengths))
    steady = time_calls(
        {form: call_function(layer, 64, flag) for form, flag in FORMS.items()},
        args.calls,
    )
    rows = [
        f"| {form} | {first[form][0] * 1e3:.0f} | {first[form][1]:.0f} "
        f"| {steady[form].median * 1e3:.2f} |"
        for form in FORMS
    ]
    ratio = steady["one program"].median / steady["op by op"].median
    text = "\n".join(
        [
            "### Eager `MultiHeadAttention` calls on JAX, CPU",
            "",
            "Command: `OMP_NUM_THREADS=1 KERAS_BACKEND=jax python "
            "benchmarks/jax_eager.py`. Width 64, 4 heads, rotary positions, "
            f"batch 2, causal, a padding mask. First call: median over lengths 16-"
            f"{15 + args.lengths}, each after `jax.clear_caches()`; call: "
            f"length 64, {describe(args.calls)}.",
            "",
            "| form | first call (ms) | programs compiled | call (ms) |",
            "|---|---:|---:|---:|",
            *rows,
            "",
            f"Call time, one program / op by op: {ratio:.2f}x. jax {jax.__version__}.",
        ]
    )
    write_report(args.results, "jax_eager.md", text)


if __name__ == "__main__":
    main()
