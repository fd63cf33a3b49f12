"""Block skipping on the chunked path: causal attention and sliding windows,
forward and backward, and a prompt's prefill, forward only, with and
without skipping the hidden keys.

    OMP_NUM_THREADS=1 KERAS_BACKEND=jax python benchmarks/block_skipping.py
    OMP_NUM_THREADS=1 python benchmarks/block_skipping.py --only prefill

One call: `attend` on `(1, T, 8, 64)` float32 queries, keys and values,
`flash_attention=False` (the chunked path on every backend at these
lengths), its output and the gradients of the query, keys and values,
compiled as each backend runs a train step here: `jax.jit`, a
`tf.function` (graph, no XLA: Keras' default on a CPU), eager PyTorch.
Rows:

- causal at `--causal-length`, against the same call without a mask;
- a causal sliding window of `--window` (its band by position, as a layer
  passes it) at each of `--window-lengths`, and the ratio of the longest to
  the shortest (linear: their length ratio; quadratic: its square);
- a prompt's prefill, forward only: `--prefill` prompt tokens over a cache of
  twice as many slots, with the cache's mask (`cache.mask`), as
  `decode_unchecked` gets it, without and with `within_causal`
  (`cache.top_left_causal`: what the layers pass now), against the
  unmasked call over the prompt's own keys; and the same two with
  `flash_attention=None` (the backend's default kernel: fused on PyTorch),
  where `within_causal` must cost nothing.

"before" is the same process with `blocks.key_windows` answering `None`:
every chunk over every key, the code path before block skipping. Seconds:
the median of `--calls` timed calls after a warm-up call
(`benchmarks/timing.py`), interleaved. A section's size 0 leaves it out.
Results go to `benchmarks/results/block_skipping_<backend>.md`, or with
`--only SECTION` to `block_skipping_<backend>_<section>.md`.
"""

import argparse
import os
import sys

import keras
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.report import write_report  # noqa: E402
from benchmarks.timing import describe, time_calls  # noqa: E402
from keras_attn.cache import DenseCache  # noqa: E402
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


def forward(fn):
    """`fn(q, k, v)` alone, compiled as `value_and_gradients` compiles it."""
    backend = keras.config.backend()
    if backend == "jax":
        import jax

        return lambda *x: np.asarray(jax.jit(fn)(*x))
    if backend == "tensorflow":
        import tensorflow as tf

        step = tf.function(fn)
        return lambda *x: step(*map(tf.constant, x)).numpy()
    import torch

    def step(*x):
        with torch.no_grad():
            return fn(*map(torch.tensor, x)).numpy()

    return step


def timed(cases, calls, compiled=value_and_gradients, slots=None):
    """`{name: median seconds}` of `cases` (name -> `(fn, length, before)`);
    `slots`: the keys' length, where not the queries'."""
    functions = {}
    for name, (fn, length, before) in cases.items():
        x = inputs(length)
        if slots:
            x[1:] = [np.concatenate([k, np.zeros_like(k)], axis=1) for k in x[1:]]
        step = compiled(fn)

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


def prefill_rows(length, calls):
    """A prompt of `length` tokens written at index 0 into a cache of
    `2 * length` slots, attended with the cache's mask, forward only."""
    mask = DenseCache.empty(1, HEADS, 2 * length, WIDTH).mask(0, length)

    def full(q, k, v):
        return attend(q, k[:, :length], v[:, :length], flash_attention=False)

    def prefill(causal, flash_attention=False):
        return lambda q, k, v: attend(
            q, k, v, mask=mask, within_causal=causal,
            flash_attention=flash_attention,
        )  # fmt: skip

    cases = {
        "prompt, no mask": (full, length, False),
        "prefill, the mask only (before)": (prefill(False), length, False),
        "prefill, within_causal": (prefill(True), length, False),
        "default kernel: prefill, the mask only": (prefill(False, None), length, False),
        "default kernel: prefill, within_causal": (prefill(True, None), length, False),
    }
    seconds = timed(cases, calls, forward, slots=2 * length)
    base = seconds["prompt, no mask"]
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
    parser.add_argument("--window-lengths", type=int, nargs="*", default=[4096, 16384])
    parser.add_argument(
        "--window-before", type=int, nargs="*", default=[4096, 8192],
        help="Lengths to time the window without skipping at.",
    )  # fmt: skip
    parser.add_argument("--prefill", type=int, default=4096)
    parser.add_argument(
        "--only", choices=("causal", "window", "prefill"),
        help="One section, written to block_skipping_<backend>_<section>.md.",
    )  # fmt: skip
    parser.add_argument("--calls", type=int, default=3, help="Timed calls a point.")
    parser.add_argument("--results", default=RESULTS, help="Output folder.")
    args = parser.parse_args(argv)
    backend = keras.config.backend()
    lines = [
        f"### Block skipping, `KERAS_BACKEND={backend}`, batch 1, "
        f"{HEADS} heads of {WIDTH}, OMP_NUM_THREADS="
        f"{os.environ.get('OMP_NUM_THREADS', 'unset')}",
        "",
        f"Seconds: {describe(args.calls)}. Forward and backward, but the "
        "prefill (forward only). Ratio: to the unmasked call, or of the "
        "longest window row to the shortest.",
        "",
        "| call | T | seconds | ratio |",
        "|---|---:|---:|---:|",
    ]
    sections = {
        "causal": lambda: causal_rows(args.causal_length, args.calls),
        "window": lambda: window_rows(
            args.window_lengths, args.window, args.calls, args.window_before
        ),
        "prefill": lambda: prefill_rows(args.prefill, args.calls),
    }
    sizes = {"causal": args.causal_length, "window": args.window_lengths}
    sizes["prefill"] = args.prefill
    for name, rows in sections.items():
        chosen = args.only in (None, name) and sizes[name]
        for line in rows() if chosen else []:
            lines.append(line)
            print(line, flush=True)
    text = "\n".join(lines) + "\n"
    suffix = f"_{args.only}" if args.only else ""
    return write_report(args.results, f"block_skipping_{backend}{suffix}.md", text)


if __name__ == "__main__":
    main()
