"""Tokens per second of cached `generate` against a naive loop and keras-hub.

Run once per backend (each in its own process; on PyTorch pin the threads,
`OMP_NUM_THREADS=1`, on a quiet machine):

    KERAS_BACKEND=jax python benchmarks/generation.py
    KERAS_BACKEND=tensorflow python benchmarks/generation.py
    KERAS_BACKEND=torch OMP_NUM_THREADS=1 python benchmarks/generation.py

Decoders of the same GPT-style model (2 blocks, width 64, 4 heads,
feed-forward 128, vocabulary 1000, batch 2, an 8-token prompt), greedy:

- `keras_attn cached`: `keras_attn.generation.generate` as a user calls it
  (`jit_compile="auto"`: a compiled while-loop on JAX and TensorFlow, the
  eager step on PyTorch); on PyTorch also `jit_compile=True` (the step
  exported and compiled by Inductor).
- `naive`: the model called on the whole sequence for every new token (a
  fixed-width buffer of `max_length`, so it compiles once; the causal mask
  hides the unwritten tail). Its cost per token is constant in the step, so it
  is timed over `--naive-steps` steps and reported per token.
- `keras-hub cached`: the same loop built from `keras_hub.layers` decoders
  with their `self_attention_cache`, compiled the same way as ours.

With `--speculative`, speculative decoding instead: a target of the same
sizes with `--extra-blocks` more blocks, initialised near the identity (their
kernels scaled by 0.1), and the draft the model without them (the same
weights), so the draft agrees often; greedy tokens/s of the target alone and
with the draft (`num_speculative_tokens` from `--k`), and the acceptance rate.
A real draft is distilled from its target; this one only stands in for a draft
that agrees often.

Tokens/s are per batch: new positions per second, each filled for every row.
Every row is the median of `--calls` calls after a warm-up call (the decoders'
calls interleaved; `benchmarks/timing.py`), whose time (compiling) is reported
apart, with the time and the traces of calls that only change the sampling
numbers. The tables are markdown, written to
`benchmarks/results/generation_<backend>.md` (or `--results DIR`).
`python benchmarks/run.py` runs this with the other benchmarks.
"""

import argparse
import os
import sys

import keras
import numpy as np
from keras import ops

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import keras_attn  # noqa: E402
from benchmarks.report import write_report
from benchmarks.timing import describe, time_call, time_calls  # noqa: E402
from keras_attn.generation import generate  # noqa: E402

VOCAB, WIDTH, HEADS, FFN, LAYERS, BATCH, PROMPT = 1000, 64, 4, 128, 2, 2, 8
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def keras_attn_model(vocab=VOCAB, width=WIDTH, heads=HEADS, ffn=FFN, layers=LAYERS):
    """The GPT-style decoder-only model (pre-norm blocks); the sizes default
    to this benchmark's."""
    ids = keras.Input((None,), dtype="int32")
    x = keras_attn.SinusoidalEmbedding(vocabulary_size=vocab, embedding_dim=width)(ids)
    for _ in range(layers):
        x = keras_attn.TransformerDecoder(ffn, heads, normalize_first=True)(x)
    x = keras.layers.LayerNormalization()(x)
    return keras.Model(ids, keras.layers.Dense(vocab)(x))


class KerasHubGreedy(keras.Model):
    """Greedy decoding with keras-hub decoder layers and their caches."""

    def __init__(self, length):
        import keras_hub

        super().__init__(name="keras_hub_greedy")
        self.length = length
        self.embedding = keras_hub.layers.TokenAndPositionEmbedding(
            VOCAB, length, WIDTH
        )
        self.blocks = [
            keras_hub.layers.TransformerDecoder(FFN, HEADS, normalize_first=True)
            for _ in range(LAYERS)
        ]
        self.norm = keras.layers.LayerNormalization()
        self.head = keras.layers.Dense(VOCAB)
        self.compile(jit_compile=keras.config.backend() != "torch")

    def step(self, ids, index, caches):
        # The embedding's own call, so Keras sees it built: an unbuilt layer
        # makes every `predict_on_batch` run the whole model eagerly first.
        x = self.embedding(ids, start_index=index)
        new_caches = []
        for block, cache in zip(self.blocks, caches, strict=True):
            x, cache = block(
                x, self_attention_cache=cache, self_attention_cache_update_index=index
            )
            new_caches.append(cache)
        return ops.cast(self.head(self.norm(x)), "float32"), new_caches

    def call(self, prompt):
        batch, width = ops.shape(prompt)[0], prompt.shape[1]
        head_dim = WIDTH // HEADS
        caches = [
            ops.zeros((batch, 2, self.length, HEADS, head_dim)) for _ in self.blocks
        ]
        logits, caches = self.step(prompt, 0, caches)
        tokens = ops.pad(prompt, [[0, 0], [0, self.length - width]])

        def body(index, tokens, logits, caches):
            token = ops.cast(ops.argmax(logits, axis=-1), "int32")
            tokens = ops.slice_update(tokens, [0, index], token[:, None])
            logits, caches = self.step(token[:, None], index, caches)
            return index + 1, tokens, logits[:, -1], caches

        index = ops.convert_to_tensor(width, "int32")
        loop_vars = (index, tokens, logits[:, -1], caches)
        return ops.while_loop(lambda index, *_: index < self.length, body, loop_vars)[1]


def naive_step_function(model, length):
    """One naive step: the whole fixed-width buffer through the model."""

    def step(buffer, position):
        logits = model.predict_on_batch(buffer)
        buffer[:, position] = logits[:, position - 1].argmax(-1)

    return step


def ours(backend):
    """`generate` variants by row name: as a user calls it, and compiled on
    PyTorch."""
    variants = {"keras_attn cached": {}}
    if backend == "torch":
        variants["keras_attn cached, jit_compile=True"] = {"jit_compile": True}
    return variants


def main(argv=None):
    """Run the benchmark (`argv`: command-line flags); returns the markdown."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--calls", type=int, default=3, help="Timed calls a point.")
    parser.add_argument("--naive-steps", type=int, default=16)
    parser.add_argument("--no-keras-hub", action="store_true")
    parser.add_argument("--results", default=RESULTS, help="Output folder.")
    parser.add_argument("--speculative", action="store_true")
    parser.add_argument("--extra-blocks", type=int, default=14)
    parser.add_argument("--k", type=int, nargs="+", default=[2, 4])
    args = parser.parse_args(argv)
    backend = keras.config.backend()
    if args.speculative:
        return speculative(backend, args)
    keras.utils.set_random_seed(0)
    model = keras_attn_model()
    model.compile(jit_compile=backend != "torch")
    prompt = (
        np.random.default_rng(0).integers(1, VOCAB, (BATCH, PROMPT)).astype("int32")
    )
    rows, first_calls = [], []
    for length in args.lengths:
        medians, first = time_length(model, prompt, length, args)
        rows += [
            (length, name, t, t / medians["keras_attn cached"])
            for name, t in medians.items()
        ]
        first_calls += [(length, name, t) for name, t in first.items()]
        print(
            f"length {length}: "
            + ", ".join(f"{k} {1 / v:,.0f} tok/s" for k, v in medians.items()),
            flush=True,
        )
    numbers = new_numbers(model, prompt, args.calls)
    return write_tables(backend, rows, first_calls, numbers, args)


def time_length(model, prompt, length, args):
    """Median seconds per new position of each decoder, and the first call's
    seconds of ours."""
    new_positions = length - PROMPT
    calls = {
        name: (lambda kw=kw: generate(model, prompt, length, **kw))
        for name, kw in ours(keras.config.backend()).items()
    }
    buffer = np.zeros((BATCH, length), "int32")
    buffer[:, :PROMPT] = prompt
    naive = naive_step_function(model, length)
    steps = range(PROMPT, min(length, PROMPT + args.naive_steps))
    calls["naive"] = lambda: [naive(buffer.copy(), p) for p in steps]
    per_call = {name: new_positions for name in calls} | {"naive": len(steps)}
    if not args.no_keras_hub:
        hub = KerasHubGreedy(length)
        hub(prompt)  # builds the layers eagerly
        calls["keras-hub cached"] = lambda: hub.predict_on_batch(prompt)
        per_call["keras-hub cached"] = new_positions
    timings = time_calls(calls, args.calls)
    first = {name: timings[name].first for name in ours(keras.config.backend())}
    return {k: t.median / per_call[k] for k, t in timings.items()}, first


def sampling_numbers(call):
    """The sampling numbers of the `call`-th call: all new on each call."""
    if call == 0:
        return dict(seed=1, top_k=5, repetition_penalty=1.1)
    return dict(
        seed=1 + call,
        top_k=5 + 2 * call,
        top_p=0.5 + 0.4 / call,
        temperature=0.5 + 0.2 * call,
        repetition_penalty=1.1 + 0.1 * call,
    )


def new_numbers(model, prompt, calls, length=64):
    """Rows `(decoder, first s, median s, new traces)` of sampling calls that
    only change the numbers (temperature, top_k, top_p, seed, repetition
    penalty): the first call, then `calls` calls, each with new numbers."""
    return [
        (name, *sampling_timing(model, prompt, kw, calls, length - PROMPT))
        for name, kw in ours(keras.config.backend()).items()
    ]


def sampling_timing(model, prompt, kw, calls, new_tokens):
    count, traces = iter(range(calls + 1)), []

    def call():
        numbers = sampling_numbers(next(count))
        generate(
            model, prompt, method="sample", max_new_tokens=new_tokens, **numbers, **kw
        )
        traces.append(generator_traces(model))

    timing = time_call(call, calls)
    return timing.first, timing.median, traces[-1] - traces[0]


def generator_traces(model):
    """Traces so far of the generator `generate` made last for `model`."""
    from keras_attn import generation

    return list(generation.api._GENERATORS[model].values())[-1].traces


def write_tables(backend, rows, first_calls, numbers, args):
    lines = [
        f"### Generation, `KERAS_BACKEND={backend}` "
        f"(batch {BATCH}, prompt {PROMPT}, {LAYERS} blocks, width {WIDTH}, "
        f"vocabulary {VOCAB}, greedy)",
        "",
        f"Each row: {describe(args.calls)} (a `generate` call; for the naive "
        f"loop, {args.naive_steps} of its steps), the decoders' calls "
        "interleaved, per new position.",
        "",
        "| max_length | decoder | tokens/s per batch | ms/token "
        "| time vs keras_attn cached |",
        "|---:|---|---:|---:|---:|",
    ]
    for length, name, per_token, ratio in rows:
        lines.append(
            f"| {length} | {name} | {1 / per_token:,.0f} | {per_token * 1e3:.3f} "
            f"| {ratio:.2f}x |"
        )
    lines += ["", "First call (compiling included; the warm-up call), seconds:", ""]
    lines += ["| max_length | decoder | first call |", "|---:|---|---:|"]
    lines += [f"| {n} | {name} | {t:.2f} |" for n, name, t in first_calls]
    lines += ["", "Sampling, 56 new tokens, calls that each change temperature, "]
    lines[-1] += "top_k, top_p, seed and repetition penalty: the first call, the "
    lines[-1] += f"{describe(args.calls)} (the first), and the traces they made:"
    lines += ["", "| decoder | first call, s | new numbers, s | new traces |"]
    lines += ["|---|---:|---:|---:|"]
    lines += [f"| {n} | {a:.2f} | {b:.3f} | {t} |" for n, a, b, t in numbers]
    text = "\n".join(lines) + "\n"
    return write_report(args.results, f"generation_{backend}.md", text)


def speculative_models(extra_blocks):
    """`(target, draft)`: the draft is this benchmark's model; the target the
    same weights with `extra_blocks` pre-norm blocks after its blocks, near
    the identity (every kernel of theirs scaled by 0.1: each adds about a
    hundredth of its input's scale to the residual stream)."""
    keras.utils.set_random_seed(0)
    draft = keras_attn_model()
    target = keras_attn_model(layers=LAYERS + extra_blocks)
    ours = [*draft.layers[1 : 2 + LAYERS], *draft.layers[-2:]]
    theirs = [*target.layers[1 : 2 + LAYERS], *target.layers[-2:]]
    for mine, its in zip(ours, theirs, strict=True):
        its.set_weights(mine.get_weights())
    for block in target.layers[2 + LAYERS : -2]:
        block.set_weights([w * 0.1 if w.ndim > 1 else w for w in block.get_weights()])
    return target, draft


def speculative(backend, args):
    """Greedy tokens/s of the target alone and with the draft, per length
    and k; the acceptance rate. Writes `generation_speculative_<backend>.md`."""
    target, draft = speculative_models(args.extra_blocks)
    prompt = (
        np.random.default_rng(0).integers(1, VOCAB, (BATCH, PROMPT)).astype("int32")
    )
    rows = []
    for length in args.lengths:
        plain = generate(target, prompt, length)
        calls, acceptance = (
            {"target alone": lambda n=length: generate(target, prompt, n)},
            {},
        )
        for k in args.k:
            tokens, acceptance[k] = generate(
                target, prompt, length, draft_model=draft,
                num_speculative_tokens=k, return_acceptance=True,
            )  # fmt: skip
            assert (tokens == plain).all(), "speculative greedy != greedy"
            calls[f"draft, k={k}"] = lambda k=k, n=length: generate(
                target, prompt, n, draft_model=draft, num_speculative_tokens=k
            )
        timings = time_calls(calls, args.calls)
        alone = timings["target alone"].median
        for name, timing in timings.items():
            k = None if name == "target alone" else int(name.split("=")[1])
            rows.append(
                (length, name, (length - PROMPT) / timing.median, alone / timing.median,
                 acceptance.get(k), timing.first)
            )  # fmt: skip
            print(f"length {length}, {name}: {rows[-1][2]:,.0f} tok/s", flush=True)
    lines = [
        f"### Speculative decoding, `KERAS_BACKEND={backend}` (batch {BATCH}, "
        f"prompt {PROMPT}, target {LAYERS + args.extra_blocks} blocks, draft "
        f"{LAYERS}, width {WIDTH}, vocabulary {VOCAB}, greedy)",
        "",
        f"Each row: {describe(args.calls)}, interleaved. Tokens equal plain "
        "greedy's (checked).",
        "",
        "| max_length | decoder | tokens/s per batch | speedup | acceptance "
        "| first call, s |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for length, name, rate, speedup, accepted, first in rows:
        shown = "" if accepted is None else f"{accepted:.2f}"
        lines.append(
            f"| {length} | {name} | {rate:,.0f} | {speedup:.2f}x | {shown} "
            f"| {first:.2f} |"
        )
    text = "\n".join(lines) + "\n"
    return write_report(args.results, f"generation_speculative_{backend}.md", text)


if __name__ == "__main__":
    main()
