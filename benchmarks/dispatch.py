"""Candidate speed rules of the attention dispatcher, measured per backend.

    KERAS_BACKEND=jax python benchmarks/dispatch.py
    KERAS_BACKEND=torch python benchmarks/dispatch.py

`keras_attn.ops.dot_product_attention` takes a speed rule only where this
shows it wins by more than 10% on a quiet machine. The candidate measured: a
decoding step (one query) on a heads-major key/value cache `(B, K, S, D)` in
the explicit path, which reads the cache in place, against the fused
`keras.ops.dot_product_attention`, which takes `(B, S, K, D)` and so needs a
transposed copy of the whole cache at every step. One step of batch 4, 8
heads of 64, a cache of S positions (half of them written), run as `generate`
runs it (jitted on JAX, eager on PyTorch): the median of `--calls` calls after
a warm-up call, the two interleaved (`benchmarks/timing.py`). TensorFlow is
not measured: every TensorFlow attention is explicit (Keras has no fused
TensorFlow kernel).

Results go to `benchmarks/results/dispatch_<backend>.md` (or `--results DIR`).
"""

import argparse
import os
import sys

import keras
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.report import write_report
from benchmarks.timing import describe, time_calls  # noqa: E402
from keras_attn import ops as attn_ops  # noqa: E402

B, H, D = 4, 8, 64
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def step_functions(length):
    """(explicit, fused) decoding steps: one query over a heads-major cache."""
    rng = np.random.default_rng(0)
    query = keras.ops.convert_to_tensor(rng.standard_normal((B, 1, H, D), "float32"))
    cache = rng.standard_normal((B, 2, H, length, D), "float32")
    keys, values = (keras.ops.convert_to_tensor(cache[:, i]) for i in (0, 1))
    written = np.arange(length) < length // 2
    mask = keras.ops.convert_to_tensor(np.broadcast_to(written, (B, 1, 1, length)))

    def explicit(q, k, v, m):  # in place
        return attn_ops.dot_product_attention(
            q, k, v, mask=m, heads_major=True, flash_attention=False
        )

    def fused(q, k, v, m):  # what the fused kernels need
        k, v = (keras.ops.transpose(x, (0, 2, 1, 3)) for x in (k, v))
        return keras.ops.dot_product_attention(q, k, v, mask=m)

    if keras.config.backend() == "jax":
        import jax

        explicit, fused = jax.jit(explicit), jax.jit(fused)
    args = (query, keys, values, mask)
    return (
        lambda: keras.ops.convert_to_numpy(explicit(*args)),
        lambda: keras.ops.convert_to_numpy(fused(*args)),
    )


def measure(length, calls):
    explicit, fused = step_functions(length)
    np.testing.assert_allclose(explicit(), fused(), atol=1e-5)  # same numbers
    timings = time_calls({"explicit": explicit, "fused": fused}, calls)
    return {name: timing.median for name, timing in timings.items()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--calls", type=int, default=100, help="Timed calls.")
    parser.add_argument("--results", default=RESULTS, help="Output folder.")
    args = parser.parse_args(argv)
    backend = keras.config.backend()
    lines = [
        f"### A decoding step on a heads-major cache, `KERAS_BACKEND={backend}` "
        f"(batch {B}, {H} heads of {D}, one query)",
        "",
        f"Each point: {describe(args.calls)}, the two interleaved.",
        "",
        "| cache length | explicit, in place (ms) | fused, transposed copy (ms) "
        "| fused / explicit |",
        "|---:|---:|---:|---:|",
    ]
    if backend == "tensorflow":
        lines.append("| - | every TensorFlow attention is explicit | - | - |")
    else:
        for length in args.lengths:
            t = measure(length, args.calls)
            lines.append(
                f"| {length} | {t['explicit'] * 1e3:.3f} | {t['fused'] * 1e3:.3f} "
                f"| {t['fused'] / t['explicit']:.2f}x |"
            )
    text = "\n".join(lines) + "\n"
    return write_report(args.results, f"dispatch_{backend}.md", text)


if __name__ == "__main__":
    main()
