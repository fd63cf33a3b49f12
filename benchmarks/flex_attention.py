"""Packed rows on PyTorch: FlexAttention's block mask against the kernels the
plan runs for `segment_ids`.

    OMP_NUM_THREADS=1 KERAS_BACKEND=torch python benchmarks/flex_attention.py

One attention forward pass over a packed row (batch 1, 8 heads
of 64, causal) of `--length` tokens holding documents of `--document`
tokens each, with three kernels:

- torch's `scaled_dot_product_attention` with the `(1, 1, T, T)` segment mask
  folded in (what the plan runs where the sequence is short: the mask is
  quadratic in T);
- keras_attn's explicit path with `query_segment_ids` (what the plan runs for
  long sequences, in chunks, with memory linear in T: each chunk builds its own
  mask and computes every logit);
- `torch.nn.attention.flex_attention` under `torch.compile` with a block mask
  from the same ids (`create_block_mask`): blocks of 128 x 128 that no
  document spans are skipped, so its work falls with the documents' length.

Forward only: torch 2.13's FlexAttention has no backward pass on a CPU
("FlexAttention does not support backward on CPU"), so it cannot train here.
The plan does not run FlexAttention: it needs `torch.compile` (eagerly it
falls back to a composite that materializes the logits), which a Keras layer
cannot assume, and a GPU to train. This table is what a plan rule for it
would cite; the GPU's numbers are still owed.

Reported: the median of `--calls` calls after one warm-up (which compiles
FlexAttention), the kernels interleaved (`benchmarks/timing.py`), and each
kernel against SDPA. Results go to `benchmarks/results/flex_attention.md`.
"""

import argparse
import os
import sys

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.report import write_report  # noqa: E402
from benchmarks.timing import describe, time_calls  # noqa: E402
from keras_attn import ops as attn_ops  # noqa: E402

HEADS, HEAD_DIM = 8, 64
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def kernels(length, document):
    """name -> a function of no arguments: one forward pass."""
    import torch
    from torch.nn.attention import flex_attention as flex

    generator = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(1, length, HEADS, HEAD_DIM, generator=generator) for _ in range(3)
    )
    ids = torch.arange(length, dtype=torch.int32) // document  # (T,)

    def same_document(b, h, q_index, kv_index):
        return (ids[q_index] == ids[kv_index]) & (q_index >= kv_index)

    block_mask = flex.create_block_mask(
        same_document, 1, 1, length, length, device="cpu"
    )
    compiled = torch.compile(flex.flex_attention)
    positions = torch.arange(length)
    mask = same_document(0, 0, positions[:, None], positions[None, :])  # (T, T)

    def forward(output):  # the work done: read an element back
        return float(output.flatten()[0])

    heads_first = [x.transpose(1, 2) for x in (q, k, v)]  # (B, H, T, D)
    return {
        "SDPA, (T, T) segment mask": lambda: forward(
            torch.nn.functional.scaled_dot_product_attention(
                *heads_first, attn_mask=mask[None, None]
            )
        ),
        "keras_attn explicit, segment ids (chunked from 2**26 logits)": lambda: forward(
            attn_ops.dot_product_attention(
                q,
                k,
                v,
                is_causal=True,
                flash_attention=False,
                query_segment_ids=ids[None],
            )  # fmt: skip
        ),
        "FlexAttention, block mask (compiled)": lambda: forward(
            compiled(*heads_first, block_mask=block_mask)
        ),
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--length", type=int, default=4096, help="Row length T.")
    parser.add_argument("--document", type=int, default=128, help="Document length.")
    parser.add_argument("--calls", type=int, default=3, help="Timed calls.")
    parser.add_argument("--results", default=RESULTS, help="Output folder.")
    args = parser.parse_args(argv)
    if keras.config.backend() != "torch":
        raise SystemExit("FlexAttention is PyTorch's: run with KERAS_BACKEND=torch.")
    import torch

    with torch.no_grad():
        timings = time_calls(kernels(args.length, args.document), args.calls)
    base = timings["SDPA, (T, T) segment mask"].median
    threads = os.environ.get("OMP_NUM_THREADS", "unset")
    lines = [
        f"### A packed row on PyTorch's CPU: T={args.length}, documents of "
        f"{args.document}, {HEADS} heads of {HEAD_DIM}, causal, forward "
        "(no FlexAttention backward on a CPU)",
        "",
        f"Each point: {describe(args.calls)}, the kernels interleaved; "
        f"OMP_NUM_THREADS={threads}, load average {os.getloadavg()[0]:.1f}.",
        "",
        "| kernel | ms | against SDPA |",
        "|---|---:|---:|",
    ]
    for name, timing in timings.items():
        lines.append(
            f"| {name} | {timing.median * 1e3:.0f} | {timing.median / base:.2f}x |"
        )
    return write_report(args.results, "flex_attention.md", "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
