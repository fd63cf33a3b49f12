"""Block skipping on the chunked path: causal attention and sliding windows,
forward and backward, with and without skipping the hidden keys.

    OMP_NUM_THREADS=1 KERAS_BACKEND=jax python benchmarks/block_skipping.py

One call: `attend` on `(1, T, 8, 64)` float32 queries, keys and values,
`flash_attention=False` (the chunked path on every backend at these
lengths), its output and the gradients of the query, keys and values,
compiled as each backend runs a train step here: `jax.jit`, a
`tf.function` (graph, no XLA: Keras' default on a CPU), eager PyTorch.
Rows:

- causal at `--causal-length`, against the same call without a mask;
- a causal sliding window of `--window` (its band by position, as a layer
  passes it) at each of `--window-lengths`, and the ratio of the longest to
  the shortest (linear: their length ratio; quadratic: its square).

"before" is the same process with `blocks.key_windows` answering `None`:
every chunk over every key, the code path before block skipping. Seconds:
the median of `--calls` timed calls after a warm-up call
(`benchmarks/timing.py`), interleaved. Results go to
`benchmarks/results/block_skipping_<backend>.md`.
"""

import argparse
import os
import sys

import keras
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.report import write_report  # noqa: E402
from benchmarks.timing import describe, time_calls  # noqa: E402
from keras_attn.ops.attention import attend  # noqa: E402
from keras_attn.ops.kernels import blocks  # noqa: E402

HEADS, WIDTH = 8, 64
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def value_and_gradients(fn):
    """`fn(q, k, v)`'s gradients of `sum(output)`, as a function of numpy
    arrays that returns once they are computed."""
    backend = keras.config.backend()
    if backend == "jax":
        import jax

        step = jax.jit(jax.grad(lambda *x: fn(*x).sum(), argnums=(0, 1, 2)))
        return lambda *x: [np.asarray(g) for g in step(*x)]
    if backend == "tensorflow":
        import tensorflow as tf

        @tf.function
        def step(*x):
            with tf.GradientTape() as tape:
                tape.watch(x)
                loss = tf.reduce_sum(fn(*x))
            return tape.gradient(loss, x)

        return lambda *x: [g.numpy() for g in step(*map(tf.constant, x))]
    import torch

    def step(*x):
        x = [torch.tensor(a, requires_grad=True) for a in x]
        fn(*x).sum().backward()
        return [a.grad.numpy() for a in x]

    return step


class Before:
    """`blocks.key_windows` answering `None` (no skipping) while entered."""

    def __enter__(self):
        self.original = blocks.key_windows
        blocks.key_windows = lambda *args: None

    def __exit__(self, *exc):
        blocks.key_windows = self.original


def inputs(length):
    rng = np.random.default_rng(0)
    return [
        rng.standard_normal((1, length, HEADS, WIDTH)).astype("float32")
        for _ in range(3)
    ]


def timed(cases, calls):
    """`{name: median seconds}` of `cases` (name -> `(fn, length, before)`)."""
    functions = {}
    for name, (fn, length, before) in cases.items():
        x = inputs(length)
        step = value_and_gradients(fn)

        def call(step=step, x=x, before=before):
            if before:
                with Before():
                    return step(*x)
            return step(*x)

        functions[name] = call
    return {name: t.median for name, t in time_calls(functions, calls).items()}


def causal_rows(length, calls):
    def full(q, k, v):
        return attend(q, k, v, flash_attention=False)

    def causal(q, k, v):
        return attend(q, k, v, is_causal=True, flash_attention=False)

    cases = {
        "no mask": (full, length, False),
        "causal, before": (causal, length, True),
        "causal": (causal, length, False),
    }
    seconds = timed(cases, calls)
    base = seconds["no mask"]
    return [
        f"| {name} | {length} | {s:.2f} | {s / base:.2f} |"
        for name, s in seconds.items()
    ]


def window_rows(lengths, window, calls, before):
    """Rows of the sliding window at `lengths`, and without skipping at
    `before` (lengths)."""
    seconds = {}
    for length in sorted({*lengths, *before}):

        def windowed(q, k, v):
            # The band as a layer passes it: by position, no (T, S) mask.
            return attend(
                q, k, v, is_causal=True, flash_attention=False,
                band=(window, 0),
            )  # fmt: skip

        cases = {}
        if length in lengths:
            cases[(length, False)] = (windowed, length, False)
        if length in before:
            cases[(length, True)] = (windowed, length, True)
        seconds.update(timed(cases, calls))
    lines = []
    for flag, points in ((True, before), (False, lengths)):
        if not points:
            continue
        name = "before" if flag else "skipping"
        first, last = seconds[(points[0], flag)], seconds[(points[-1], flag)]
        for length in points:
            lines.append(
                f"| window {window}, {name} | {length} | "
                f"{seconds[(length, flag)]:.2f} | |"
            )
        lines.append(
            f"| window {window}, {name}: time({points[-1]}) / "
            f"time({points[0]}) | | | {last / first:.2f} |"
        )
    return lines


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--causal-length", type=int, default=8192)
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--window-lengths", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument(
        "--window-before", type=int, nargs="*", default=[4096, 8192],
        help="Lengths to time the window without skipping at.",
    )  # fmt: skip
    parser.add_argument("--calls", type=int, default=3, help="Timed calls a point.")
    parser.add_argument("--results", default=RESULTS, help="Output folder.")
    args = parser.parse_args(argv)
    backend = keras.config.backend()
    lines = [
        f"### Block skipping, `KERAS_BACKEND={backend}`, fwd+bwd, batch 1, "
        f"{HEADS} heads of {WIDTH}, OMP_NUM_THREADS="
        f"{os.environ.get('OMP_NUM_THREADS', 'unset')}",
        "",
        f"Seconds: {describe(args.calls)}. Ratio: to the unmasked call, or "
        "of the longest window row to the shortest.",
        "",
        "| call | T | seconds | ratio |",
        "|---|---:|---:|---:|",
    ]
    for line in (
        causal_rows(args.causal_length, args.calls) if args.causal_length else []
    ):
        lines.append(line)
        print(line, flush=True)
    for line in window_rows(
        args.window_lengths, args.window, args.calls, args.window_before
    ):
        lines.append(line)
        print(line, flush=True)
    text = "\n".join(lines) + "\n"
    return write_report(args.results, f"block_skipping_{backend}.md", text)


if __name__ == "__main__":
    main()
