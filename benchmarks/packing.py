"""Packed against padded documents: real tokens per second of a training step.

    OMP_NUM_THREADS=1 KERAS_BACKEND=torch python benchmarks/packing.py
    OMP_NUM_THREADS=1 KERAS_BACKEND=jax python benchmarks/packing.py --quick

A batch of `--documents` documents of lengths drawn uniformly from 8 to 128
tokens (seed 0) trains one step of a model of one `TransformerEncoder` block
(width 64, 4 heads, rotary positions, pre-norm) and a linear head, mean
squared error on the real tokens only (`train_on_batch` with a sample weight
of the padding mask; Adam). Two layouts of the same tokens:

- padded: one document per row, padded to the longest (128), a padding mask;
- packed: documents packed first-fit into rows of `--row-length` tokens
  (`segment_ids` one id per document, the rows' tails padded and masked),
  so that a token attends only to its own document, and its rotary positions
  restart with it.

Reported: real (unpadded) tokens per second, the median of `--calls` steps
after a warm-up step that compiles, the layouts interleaved
(`benchmarks/timing.py`), and packed against padded. Untrained weights and
random targets: the numbers are arbitrary, the work is not. Packed rows
longer than the documents pay for attention across documents that the
segment mask then discards (no kernel here skips masked blocks), so rows of
about the longest document's length pay off most.

Results go to `benchmarks/results/packing_<backend>.md` (or `--results DIR`).
"""

import argparse
import os
import sys

import keras
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import keras_attn  # noqa: E402
from benchmarks.report import write_report
from benchmarks.timing import describe, time_calls  # noqa: E402

WIDTH, HEADS, SHORTEST, LONGEST = 64, 4, 8, 128
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def document_lengths(count, seed=0):
    return np.random.default_rng(seed).integers(SHORTEST, LONGEST + 1, count)


def padded(lengths):
    """One document a row: `(rows, longest)` padding mask, and segment ids
    `None`."""
    mask = np.arange(LONGEST)[None, :] < lengths[:, None]
    return mask, None


def packed(lengths, row_length):
    """First-fit rows of `row_length` tokens: their padding mask and segment
    ids (document `d` has id `d`; a row's padded tail, -1)."""
    rows, used = [], []  # each row a list of (document, length)
    for document, length in enumerate(lengths):
        r = next((r for r, n in enumerate(used) if n + length <= row_length), None)
        if r is None:
            r = len(rows)
            rows.append([])
            used.append(0)
        rows[r].append((document, length))
        used[r] += length
    ids = np.full((len(rows), row_length), -1, dtype="int32")
    for r, row in enumerate(rows):
        ids[r, : used[r]] = np.repeat(*zip(*row, strict=True))
    return ids >= 0, ids


def model(packed_layout):
    keras.utils.set_random_seed(0)
    x = keras.Input((None, WIDTH))
    mask = keras.Input((None,), dtype="bool")
    inputs = [x, mask]
    kwargs = {}
    if packed_layout:
        kwargs["segment_ids"] = keras.Input((None,), dtype="int32")
        inputs.append(kwargs["segment_ids"])
    encoder = keras_attn.TransformerEncoder(
        2 * WIDTH, HEADS, normalize_first=True, rope_max_wavelength=10000.0
    )
    y = keras.layers.Dense(WIDTH)(encoder(x, padding_mask=mask, **kwargs))
    network = keras.Model(inputs, y)
    network.compile(optimizer="adam", loss="mse")
    return network


def step(layout):
    """A training step of the layout's model on its batch (no arguments)."""
    mask, ids = layout
    rng = np.random.default_rng(1)
    x = rng.standard_normal((*mask.shape, WIDTH)).astype("float32")
    target = rng.standard_normal(x.shape).astype("float32")
    network = model(ids is not None)
    inputs = [x, mask] + ([] if ids is None else [ids])
    weight = mask.astype("float32")
    return lambda: float(network.train_on_batch(inputs, target, sample_weight=weight))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--documents", type=int, default=64)
    parser.add_argument("--row-length", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--calls", type=int, default=5, help="Timed steps a point.")
    parser.add_argument("--quick", action="store_true", help="Smoke run.")
    parser.add_argument("--results", default=RESULTS, help="Output folder.")
    args = parser.parse_args(argv)
    if args.quick:
        args.documents, args.row_length, args.calls = 8, [128], 1
    backend = keras.config.backend()
    lengths = document_lengths(args.documents)
    layouts = {"padded": padded(lengths)}
    for row_length in args.row_length:
        layouts[f"packed, rows of {row_length}"] = packed(lengths, row_length)
    steps = {name: step(layout) for name, layout in layouts.items()}
    load = os.getloadavg()[0]
    timings = time_calls(steps, args.calls)
    load = max(load, os.getloadavg()[0])
    real = int(lengths.sum())
    threads = os.environ.get("OMP_NUM_THREADS", "unset")
    lines = [
        f"### One encoder training step, `KERAS_BACKEND={backend}`: "
        f"{args.documents} documents of {SHORTEST} to {LONGEST} tokens "
        f"({real} real tokens), width {WIDTH}, {HEADS} heads",
        "",
        f"{describe(args.calls)}, layouts interleaved; OMP_NUM_THREADS={threads}; "
        f"load average up to {load:.1f} (a shared machine).",
        "",
        "| layout | rows x length | real tokens | ms per step | real tokens/s "
        "| vs padded |",
        "|---|---|---:|---:|---:|---:|",
    ]
    base = real / timings["padded"].median
    for name, (mask, _) in layouts.items():
        rate = real / timings[name].median
        shape = f"{mask.shape[0]} x {mask.shape[1]} ({mask.mean():.0%} real)"
        lines.append(
            f"| {name} | {shape} | {real} | {timings[name].median * 1e3:.1f} "
            f"| {rate:.0f} | {rate / base:.2f}x |"
        )
    text = "\n".join(lines) + "\n"
    return write_report(args.results, f"packing_{backend}.md", text)


if __name__ == "__main__":
    main()
