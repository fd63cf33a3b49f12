"""Training throughput of the `make demo` translation model, against keras-hub.

Run once per backend (each in its own process, on an otherwise idle machine):

    KERAS_BACKEND=jax python benchmarks/translation.py
    KERAS_BACKEND=tensorflow python benchmarks/translation.py
    KERAS_BACKEND=torch python benchmarks/translation.py

The whole encoder-decoder of `examples/translate_numbers.py`, built by its own
`build_model` with its default sizes (embedding 128, 2 encoder and 2 decoder
blocks, 4 heads, feed-forward 256, no dropout) and compiled by its own
`compile_model` (AdamW with clipping, cross-entropy that ignores padding,
token accuracy), is timed on `model.train_on_batch` with the demo's per-token
sample weights. The batches are synthetic, of the shapes the demo trains on:
batch 128, source 14 and target 20 word pieces, vocabularies of 76 pieces (what
its WordPiece learner makes of 20,000 numbers). Row lengths are random, source
7..14 pieces and target 2..20 with [START]/[END], the rest padding, so the
padding masks work about as hard as in the demo.

The peer, `keras-hub`, is the same model built from `keras_hub.layers`
(`TransformerEncoder`, `TransformerDecoder`, `SinePositionEncoding` over a
`keras.layers.Embedding` scaled by sqrt(128), explicit padding masks) and
compiled by the same `compile_model`. Each cell is the median of `--calls`
steps after two warm-up steps (compilation), the two models' steps interleaved
(`benchmarks/timing.py`). Tokens/s counts the non-padding source and target
tokens of a batch (the target ones are the labels: word pieces and [END]).

The table is markdown, written to `benchmarks/results/translation_<backend>.md`
(or `--results DIR`). `python benchmarks/run.py` runs this with the other
benchmarks.
"""

import argparse
import importlib.util
import math
import os
import sys

import keras
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks.report import write_report  # noqa: E402
from benchmarks.timing import describe, time_calls  # noqa: E402

RESULTS = os.path.join(ROOT, "benchmarks", "results")
DEMO = os.path.join(ROOT, "examples", "translate_numbers.py")
# What `make demo` trains on (its defaults): padded lengths and vocabulary sizes.
BATCH, SOURCE_LENGTH, TARGET_LENGTH, VOCABULARY = 128, 14, 20, 76
SCHEDULE_STEPS = 468  # The demo's 3 epochs of 156 batches; sets the LR schedule.
WARMUP = 2  # Compile, and settle.


def load_demo():
    """`examples/translate_numbers.py` as a module (examples/ is no package)."""
    if "translate_numbers" not in sys.modules:
        if os.path.dirname(DEMO) not in sys.path:  # its `import console`
            sys.path.insert(0, os.path.dirname(DEMO))
        spec = importlib.util.spec_from_file_location("translate_numbers", DEMO)
        module = importlib.util.module_from_spec(spec)
        sys.modules["translate_numbers"] = module
        spec.loader.exec_module(module)
    return sys.modules["translate_numbers"]


def demo_defaults(demo):
    """The demo's command-line defaults (model sizes, learning rate)."""
    saved, sys.argv = sys.argv, [DEMO]
    try:
        return demo.parse_args()
    finally:
        sys.argv = saved


def synthetic_batch(demo, rng, batch, source_length, target_length, vocabulary):
    """`(inputs, labels, sample_weight)` as the demo's `encode` makes them.

    Source rows have `source_length // 2 .. source_length` pieces, target rows
    `1 .. target_length - 1` (plus [START] or [END]); ids avoid the reserved
    ones (padding, unknown, start, end).
    """
    low = len(demo.RESERVED_TOKENS)
    sources = [
        rng.integers(low, vocabulary, n).tolist()
        for n in rng.integers(max(1, source_length // 2), source_length + 1, batch)
    ]
    targets = [
        rng.integers(low, vocabulary, n).tolist()
        for n in rng.integers(1, target_length, batch)
    ]
    inputs, labels = demo.encode(sources, targets, source_length, target_length)
    return list(inputs), labels, (labels != demo.PAD).astype("float32")


def keras_hub_model(args, source_vocabulary_size, target_vocabulary_size):
    """The demo's `build_model` with keras-hub layers and explicit masks."""
    import keras_hub

    source = keras.Input(shape=(None,), dtype="int32", name="source")
    decoder_input = keras.Input(shape=(None,), dtype="int32", name="decoder_input")
    blocks = dict(
        intermediate_dim=args.intermediate_dim,
        num_heads=args.num_heads,
        dropout=args.dropout,
    )

    def embed(ids, vocabulary_size, name):
        x = keras.layers.Embedding(vocabulary_size, args.embedding_dim, name=name)(ids)
        x = x * math.sqrt(args.embedding_dim)
        return x + keras_hub.layers.SinePositionEncoding()(x)

    source_mask = keras.ops.not_equal(source, 0)
    decoder_mask = keras.ops.not_equal(decoder_input, 0)
    x = embed(source, source_vocabulary_size, "source_embedding")
    for i in range(args.num_layers):
        x = keras_hub.layers.TransformerEncoder(**blocks, name=f"encoder_{i}")(
            x, padding_mask=source_mask
        )
    y = embed(decoder_input, target_vocabulary_size, "target_embedding")
    for i in range(args.num_layers):
        y = keras_hub.layers.TransformerDecoder(**blocks, name=f"decoder_{i}")(
            y,
            x,
            decoder_padding_mask=decoder_mask,
            encoder_padding_mask=source_mask,
        )
    logits = keras.layers.Dense(target_vocabulary_size, name="logits")(y)
    return keras.Model([source, decoder_input], logits, name="keras_hub_translator")


def table(backend, args, demo_args, medians, parameters, tokens):
    source_tokens, target_tokens = tokens
    total = source_tokens + target_tokens
    ours = medians["keras_attn"]
    lines = [
        f"### Translation model training, `KERAS_BACKEND={backend}` "
        f"(the `make demo` model: embedding {demo_args.embedding_dim}, "
        f"{demo_args.num_layers}+{demo_args.num_layers} blocks, "
        f"{demo_args.num_heads} heads, FFN {demo_args.intermediate_dim}; "
        f"batch {args.batch_size}, source {args.source_length}, target "
        f"{args.target_length}, vocabularies {args.vocabulary_size}, float32)",
        "",
        f"Per step: {source_tokens:,} source + {target_tokens:,} target "
        f"non-padding tokens (of {args.batch_size * args.source_length:,} + "
        f"{args.batch_size * args.target_length:,} positions); `train_on_batch`, "
        f"the demo's AdamW and loss; {describe(args.calls, WARMUP)}, the models' "
        "steps interleaved.",
        "",
        "| model | parameters | train step ms | tokens/s (source + target, "
        "non-padding) | target tokens/s | time vs keras_attn |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, seconds in medians.items():
        lines.append(
            f"| {name} | {parameters[name]:,} | {seconds * 1e3:.1f} "
            f"| {total / seconds:,.0f} | {target_tokens / seconds:,.0f} "
            f"| {seconds / ours:.2f}x |"
        )
    return lines


def main(argv=None):
    """Run the benchmark (`argv`: command-line flags); returns the markdown."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=10, help="Timed steps.")
    parser.add_argument("--batch-size", type=int, default=BATCH)
    parser.add_argument("--source-length", type=int, default=SOURCE_LENGTH)
    parser.add_argument("--target-length", type=int, default=TARGET_LENGTH)
    parser.add_argument("--vocabulary-size", type=int, default=VOCABULARY)
    parser.add_argument("--no-keras-hub", action="store_true")
    parser.add_argument("--results", default=RESULTS, help="Output folder.")
    args = parser.parse_args(argv)
    backend = keras.config.backend()
    demo = load_demo()
    demo_args = demo_defaults(demo)
    keras.utils.set_random_seed(0)
    inputs, labels, weights = synthetic_batch(
        demo,
        np.random.default_rng(0),
        args.batch_size,
        args.source_length,
        args.target_length,
        args.vocabulary_size,
    )
    tokens = (int(np.sum(inputs[0] != demo.PAD)), int(np.sum(labels != demo.PAD)))
    builders = {"keras_attn": demo.build_model}
    if not args.no_keras_hub:
        builders["keras-hub"] = keras_hub_model
    steps_by_name, parameters = {}, {}
    for name, build in builders.items():
        model = build(demo_args, args.vocabulary_size, args.vocabulary_size)
        demo.compile_model(model, demo_args, SCHEDULE_STEPS)
        parameters[name] = model.count_params()
        steps_by_name[name] = lambda model=model: model.train_on_batch(
            inputs, labels, sample_weight=weights
        )
    timings = time_calls(steps_by_name, args.calls, WARMUP)
    medians = {name: timing.median for name, timing in timings.items()}
    text = "\n".join(table(backend, args, demo_args, medians, parameters, tokens))
    text += "\n"
    return write_report(args.results, f"translation_{backend}.md", text)


if __name__ == "__main__":
    main()
