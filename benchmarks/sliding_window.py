"""Cached generation with and without a sliding window: time and cache memory.

    KERAS_BACKEND=jax python benchmarks/sliding_window.py
    OMP_NUM_THREADS=2 KERAS_BACKEND=torch python benchmarks/sliding_window.py

A LLaMA-style decoder-only model (Keras' `ReversibleEmbedding` tied as the
head, RoPE, grouped-query attention, RMSNorm, SwiGLU; 4 decoders of width 128,
8 heads and 2 key/value heads of 16) generates greedily from an 8-token prompt
to 256 and to 2048 tokens, once with full caches and once with
`sliding_window=64` on every decoder, whose caches then roll: they hold 64
positions however long the sequence. Reported: milliseconds per generated
token (the median of `--calls` runs after a warm-up run that compiles, full
and rolling caches interleaved; `benchmarks/timing.py`), and the
self-attention cache memory at the last step, computed from the cache lengths
`generate` allocates (`batch x 2 x kv_heads x positions x head_dim x 4 bytes`,
summed over decoders: a full cache grows to the sequence length, a rolling one
stays at the window; tests/generation/test_decoding.py checks those lengths).
Untrained weights: the tokens are arbitrary, the work is not.

Results go to `benchmarks/results/sliding_window_<backend>.md` (or
`--results DIR`).
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
from keras_attn.generation import generate  # noqa: E402

VOCAB, WIDTH, HEADS, KV_HEADS, LAYERS, BATCH, PROMPT = 256, 128, 8, 2, 4, 2, 8
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def llama(window):
    keras.utils.set_random_seed(0)
    ids = keras.Input((None,), dtype="int32")
    embedding = keras.layers.ReversibleEmbedding(VOCAB, WIDTH)
    x = embedding(ids)
    for _ in range(LAYERS):
        x = keras_attn.TransformerDecoder(
            4 * WIDTH,
            HEADS,
            activation="silu",
            normalize_first=True,
            num_key_value_heads=KV_HEADS,
            normalization="rms_norm",
            gated_feedforward=True,
            use_bias=False,
            rope_max_wavelength=10000.0,
            sliding_window=window,
        )(x)
    x = keras.layers.RMSNormalization()(x)
    return keras.Model(ids, embedding(x, reverse=True))


def cache_bytes(length, window):
    positions = length if window is None or window >= length else window
    head_dim = WIDTH // HEADS
    return LAYERS * BATCH * 2 * KV_HEADS * positions * head_dim * 4


def measure(models, length, calls):
    """Median seconds per generated token of each model, interleaved."""
    prompt = np.random.default_rng(0).integers(1, VOCAB, (BATCH, PROMPT))
    timings = time_calls(
        {
            window: (lambda m=m: generate(m, prompt, length))
            for window, m in models.items()
        },
        calls,
    )
    return {window: t.median / (length - PROMPT) for window, t in timings.items()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 2048])
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--calls", type=int, default=3, help="Timed runs a point.")
    parser.add_argument("--results", default=RESULTS, help="Output folder.")
    args = parser.parse_args(argv)
    backend = keras.config.backend()
    lines = [
        f"### Greedy generation, `KERAS_BACKEND={backend}` (batch {BATCH}, "
        f"{LAYERS} decoders of width {WIDTH}, {KV_HEADS} key/value heads)",
        "",
        f"ms per token: {describe(args.calls)} (a call: one `generate` to the "
        "length), full and rolling caches interleaved.",
        "",
        "| tokens | cache | ms per token | cache memory (KiB) |",
        "|---:|---|---:|---:|",
    ]
    models = {None: llama(None), args.window: llama(args.window)}
    for length in args.lengths:
        for window, seconds in measure(models, length, args.calls).items():
            ms = seconds * 1e3
            name = "full" if window is None else f"rolling, window {window}"
            kib = cache_bytes(length, window) / 1024
            lines.append(f"| {length} | {name} | {ms:.2f} | {kib:.0f} |")
            print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    return write_report(args.results, f"sliding_window_{backend}.md", text)


if __name__ == "__main__":
    main()
