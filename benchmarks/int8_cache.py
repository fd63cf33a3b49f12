"""The int8 key/value cache against the float one: memory, accuracy, keys
per token or per channel (KIVI), and time per new token.

Run once per backend, each in its own process, threads pinned, on a quiet
machine:

    KERAS_BACKEND=jax OMP_NUM_THREADS=1 python benchmarks/int8_cache.py
    KERAS_BACKEND=tensorflow OMP_NUM_THREADS=1 python benchmarks/int8_cache.py
    KERAS_BACKEND=torch OMP_NUM_THREADS=1 python benchmarks/int8_cache.py

`keras_attn.cache.Int8Cache` stores each key and value vector as int8 with a
float32 scale per token and head (`q = round(x / s)`, `s = max|x| / 127`).
Four measurements, each against its target:

1. Memory: the self-attention caches' bytes (`cache.nbytes` summed over the
   decoders, from `get_empty_self_attention_cache`) of the decoder of
   `shared/gpu/FINDINGS.md` (4 pre-norm blocks, width 512, 8 heads, FFN
   2048, vocabulary 8000, float32, batch 8) at a 2,048-token context: int8
   at most 0.3x float32 and 0.55x bfloat16. Exact arithmetic.
2. Accuracy, on a model trained to be confident: 2 blocks, width 64, 4
   heads, trained with `fit` on sequences of a fixed random second-order
   transition table (`x[t] = table[x[t - 2], x[t - 1]]`, so attention to the
   previous token matters), seeded. On held-out prompts, greedy `generate`
   with the float cache and with `cache_dtype="int8"`: the share of new
   tokens that agree (target at least 98%). Then both caches along the
   float path, step by step (`decode_unchecked`, as `generate` drives the
   decoders; teacher-forced on the float tokens), for the whole logit
   vector at each new position: `max |int8 - float| / max |float|` (target
   at most 2%). The untrained model, as a contrast.
3. Keys per token (ours) or per channel over groups of 32 tokens (KIVI, Liu
   et al. 2024), both int8, values per token in both: on the trained
   model's caches after a prompt and on the FINDINGS decoder's (random
   weights), read back and quantized in numpy: the keys' error, the
   attention logits' and probabilities' error, and the next token's logits
   over the reconstructed caches.
4. Time per new token of `generate`, float cache against `cache_dtype=
   "int8"` (target: int8 at most 1.1x): (a call of N new tokens - a call of
   1) / (N - 1), medians of interleaved calls after a warm-up call
   (`benchmarks/timing.py`), on the model of `benchmarks/generation.py` and
   on the FINDINGS decoder, with `jit_compile` left to its default (on
   PyTorch also `jit_compile=False`, the eager path said explicitly). A
   2,048-token context costs a prefill of tens of seconds on a CPU, so there
   the part of a step that grows with the context is timed alone: one
   decoder's self-attention for one new token over a full cache (and the
   cache's `read`, where int8 dequantizes), compiled as `generate` compiles
   its loop (`jax.jit`, `tf.function(jit_compile=True)`, eager PyTorch).

The report is markdown, written to `benchmarks/results/int8_cache_<backend>.md`
(or `--results DIR`). `--quick` is a smoke run of seconds (tiny sizes, one
call a point, a small stand-in for the FINDINGS decoder): its numbers mean
nothing, and its file goes to a temporary folder unless `--results` is given.
"""

import argparse
import contextlib
import os
import sys
import tempfile
import time

import keras
import numpy as np
from keras import ops

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import keras_attn  # noqa: E402
from benchmarks import generation as decoding  # noqa: E402
from benchmarks.report import write_report  # noqa: E402
from benchmarks.run import versions  # noqa: E402
from benchmarks.timing import describe, time_calls  # noqa: E402
from keras_attn.cache import DenseCache, as_cache, quantize  # noqa: E402
from keras_attn.generation import generate  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
QUICK_RESULTS = os.path.join(tempfile.gettempdir(), "keras_attn_benchmarks_quick")
# The decoder of shared/gpu/FINDINGS.md, section 4, and its batch and prompt.
FINDINGS = dict(vocab=8000, width=512, heads=8, ffn=2048, layers=4)
FINDINGS_QUICK = dict(vocab=256, width=128, heads=2, ffn=128, layers=2)
FINDINGS_BATCH, FINDINGS_PROMPT = 8, 16
# The trained model: 2 blocks, width 64, 4 heads, a 32-token vocabulary.
TOY = dict(vocab=32, width=64, heads=4, ffn=128, layers=2)
TOY_PROMPT, GROUP = 16, 32  # held-out prompt; KIVI's tokens per key scale
TARGETS = {
    "int8 / float32 bytes": 0.3,
    "int8 / bfloat16 bytes": 0.55,
    "greedy agreement": 0.98,
    "logits rel. diff": 0.02,
    "int8 / float time": 1.1,
}


def parse_args(argv):
    """The flags; `--quick` overrides the sizes with a smoke run's."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--calls", type=int, default=9, help="Timed calls a FINDINGS decoder point."
    )
    parser.add_argument(
        "--small-calls", type=int, default=25,
        help="Timed calls a generation.py model point (short calls: more of them).",
    )  # fmt: skip
    parser.add_argument("--new-tokens", type=int, default=129)
    parser.add_argument("--findings-new-tokens", type=int, default=65)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--attention-calls", type=int, default=20)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--train-sequences", type=int, default=3072)
    parser.add_argument("--generated", type=int, default=64, help="Accuracy's N.")
    parser.add_argument("--quick", action="store_true", help="A smoke run.")
    parser.add_argument("--results", help="Output folder.")
    args = parser.parse_args(argv)
    args.findings = FINDINGS_QUICK if args.quick else FINDINGS
    if args.quick:
        args.calls = args.small_calls = args.attention_calls = args.epochs = 1
        args.new_tokens = args.findings_new_tokens = 5
        args.context, args.train_sequences, args.generated = 256, 128, 8
    if args.results is None:
        args.results = QUICK_RESULTS if args.quick else RESULTS
    return args


def main(argv=None):
    """Run the benchmark (`argv`: command-line flags); returns the markdown."""
    args = parse_args(argv)
    backend = keras.config.backend()
    loads = [os.getloadavg()[0]]
    start = time.perf_counter()
    keras.utils.set_random_seed(0)
    findings = decoding.keras_attn_model(**args.findings)
    sections = [memory_section(findings, args)]
    print(sections[-1], flush=True)
    trained, training, data = trained_model(args)
    sections.append(accuracy_section(trained, training, data, args))
    print(sections[-1], flush=True)
    sections.append(kivi_section(trained, findings, data, args))
    print(sections[-1], flush=True)
    loads.append(os.getloadavg()[0])
    sections.append(speed_section(findings, args))
    loads.append(os.getloadavg()[0])
    header = report_header(backend, args, loads, time.perf_counter() - start)
    text = "\n\n".join([header, summary(sections), *sections]) + "\n"
    return write_report(args.results, f"int8_cache_{backend}.md", text)


def report_header(backend, args, loads, seconds):
    threads = os.environ.get("OMP_NUM_THREADS", "unset")
    command = f"KERAS_BACKEND={backend} OMP_NUM_THREADS={threads} python "
    command += "benchmarks/int8_cache.py " + " ".join(sys.argv[1:])
    lines = [
        f"## The int8 key/value cache against the float one, "
        f"`KERAS_BACKEND={backend}`, CPU",
        "",
        f"{versions(backend)}; OMP_NUM_THREADS={threads}.",
        "",
        f"Command: `{command.strip()}` ({seconds:.0f} s).",
        "",
        "Load average (1 minute) at the start, before the timings and at the "
        f"end: {', '.join(f'{x:.2f}' for x in loads)} on {os.cpu_count()} cores"
        + (
            "." if max(loads) <= os.cpu_count() - 0.5 else
            " (shared with other work: the times were taken under contention; "
            "the ratios of interleaved calls hold better than the times)."
        ),
    ]  # fmt: skip
    if args.quick:
        lines += ["", "Smoke run (`--quick`): these numbers mean nothing."]
    return "\n".join(lines)


def summary(sections):
    """The targets table, from the `Target:` lines the sections end with."""
    rows = [
        line.removeprefix("Target: ")
        for section in sections
        for line in section.splitlines()
        if line.startswith("Target: ")
    ]
    lines = ["### Targets", "", "| target | measured | met |", "|---|---:|---|"]
    return "\n".join(lines + [f"| {row} |" for row in rows])


def target_line(name, value, met, form="{:.3f}"):
    bound = "at least" if name == "greedy agreement" else "at most"
    shown = form.format(value)
    return (
        f"Target: {name} {bound} {form.format(TARGETS[name])} | {shown} | "
        f"{'yes' if met else 'no'}"
    )


# --- The model's parts, and decoding it step by step -------------------------


def parts(model):
    """`(embedding, decoder blocks, head layers)` of a `keras_attn_model`."""
    layers = [layer for layer in model.layers if layer.weights]
    blocks = [x for x in layers if isinstance(x, keras_attn.TransformerDecoder)]
    last = layers.index(blocks[-1])
    return layers[0], blocks, layers[last + 1 :]


def no_grad():
    """No gradients recorded (PyTorch's eager layers otherwise record them)."""
    if keras.config.backend() != "torch":
        return contextlib.nullcontext()
    import torch

    return torch.no_grad()


def logits_along(model, tokens, prompt_width, cache_dtype=None):
    """Logits `(B, T, V)` (numpy) at each position of `tokens` `(B, T)`: the
    first `prompt_width` in one pass (the prefill), then one position a step,
    through the decoders' `decode_unchecked` over caches of `cache_dtype`, as
    `generate` drives them (teacher-forced on `tokens`)."""
    embedding, blocks, head = parts(model)
    batch, length = tokens.shape
    with no_grad():
        x = embedding(tokens)  # (B, T, W): positions 0, ..., T - 1
        caches = [
            as_cache(b.get_empty_self_attention_cache(batch, length, cache_dtype))
            for b in blocks
        ]
        spans = [(0, prompt_width)] + [(i, i + 1) for i in range(prompt_width, length)]
        outputs = []
        for start, stop in spans:
            h = x[:, start:stop]
            for i, block in enumerate(blocks):
                mask = caches[i].mask(start, stop - start)
                h, caches[i] = block.decode_unchecked(h, caches[i], start, mask=mask)
            for layer in head:
                h = layer(h)
            outputs.append(ops.convert_to_numpy(ops.cast(h, "float32")))
    return np.concatenate(outputs, axis=1)


def relative_difference(logits, reference):
    """`max |logits - reference| / max |reference|` of each logit vector."""
    return np.abs(logits - reference).max(-1) / np.abs(reference).max(-1)


# --- 1. Memory ---------------------------------------------------------------


def memory_section(model, args):
    blocks = parts(model)[1]
    sizes = {}
    for dtype in ("float32", "bfloat16", "int8"):
        caches = [
            as_cache(
                b.get_empty_self_attention_cache(FINDINGS_BATCH, args.context, dtype)
            )
            for b in blocks
        ]
        sizes[dtype] = sum(cache.nbytes for cache in caches)
        del caches
    width, heads = args.findings["width"], args.findings["heads"]
    lines = [
        f"### 1. Memory: the self-attention caches at a {args.context:,}-token context",
        "",
        f"The FINDINGS decoder ({len(blocks)} blocks, width {width}, {heads} "
        f"heads of {width // heads}, batch {FINDINGS_BATCH}): `cache.nbytes` "
        "summed over the decoders' `get_empty_self_attention_cache(batch, "
        "length, dtype)`.",
        "",
        "| cache dtype | bytes | MiB | vs float32 | vs bfloat16 |",
        "|---|---:|---:|---:|---:|",
    ]
    for dtype, size in sizes.items():
        lines.append(
            f"| {dtype} | {size:,} | {size / 2**20:.1f} | "
            f"{size / sizes['float32']:.4f}x | {size / sizes['bfloat16']:.4f}x |"
        )
    ratios = [sizes["int8"] / sizes[d] for d in ("float32", "bfloat16")]
    lines += [
        "",
        target_line("int8 / float32 bytes", ratios[0], ratios[0] <= 0.3, "{:.4f}x"),
        target_line("int8 / bfloat16 bytes", ratios[1], ratios[1] <= 0.55, "{:.4f}x"),
    ]
    return "\n".join(lines)


# --- 2. Accuracy -------------------------------------------------------------


def sequences(table, count, length, rng):
    """`count` int32 sequences of `length` following the second-order
    `table`: `x[t] = table[x[t - 2], x[t - 1]]` from two random tokens (ids
    from 1: 0 is `generate`'s padding)."""
    x = np.empty((count, length), "int32")
    x[:, :2] = rng.integers(1, len(table), (count, 2))
    for t in range(2, length):
        x[:, t] = table[x[:, t - 2], x[:, t - 1]]
    return x


def trained_model(args):
    """The toy model trained on the table's sequences (seeded): `(model,
    training facts, held-out sequences)`."""
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    table = rng.integers(1, TOY["vocab"], (TOY["vocab"], TOY["vocab"]))
    length = TOY_PROMPT + args.generated
    train = sequences(table, args.train_sequences, length + 1, rng)
    held_out = sequences(table, 64, max(length, 2 * GROUP) + 1, rng)
    model = decoding.keras_attn_model(**TOY)
    model.compile(
        optimizer=keras.optimizers.Adam(3e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    weights = np.ones(train[:, 1:].shape, "float32")
    weights[:, 0] = 0.0  # the second token is random: nothing to learn
    start = time.perf_counter()
    history = model.fit(
        train[:, :-1], train[:, 1:], sample_weight=weights, batch_size=64,
        epochs=args.epochs, verbose=0,
    )  # fmt: skip
    seconds = time.perf_counter() - start
    logits = model.predict(held_out[:, :length], verbose=0)[:, 1:]
    probabilities = ops.convert_to_numpy(ops.softmax(logits, axis=-1))
    facts = {
        "seconds": seconds,
        "loss": history.history["loss"][-1],
        "accuracy": float((logits.argmax(-1) == held_out[:, 2 : length + 1]).mean()),
        "confidence": float(probabilities.max(-1).mean()),
        "train_shape": train.shape,
    }
    return model, facts, {"held_out": held_out}


def agreement(model, prompts, new_tokens, truth=None):
    """Greedy `generate` with the float and the int8 cache, and both caches'
    logits along the float path: a dict of figures."""
    width = prompts.shape[1]
    exact = generate(model, prompts, max_new_tokens=new_tokens)
    int8 = generate(model, prompts, max_new_tokens=new_tokens, cache_dtype="int8")
    float_logits = logits_along(model, exact, width)[:, width - 1 : -1]
    int8_logits = logits_along(model, exact, width, "int8")[:, width - 1 : -1]
    with no_grad():
        whole = ops.convert_to_numpy(model(exact))[:, width - 1 : -1]
    difference = relative_difference(int8_logits, float_logits)  # (B, N)
    figures = {
        "agreement": float((exact[:, width:] == int8[:, width:]).mean()),
        "rows": int((exact == int8).all(-1).sum()),
        "worst": float(difference.max()),
        "median": float(np.median(difference)),
        "forced": float((int8_logits.argmax(-1) == float_logits.argmax(-1)).mean()),
        "path": float(relative_difference(float_logits, whole).max()),
        "replays": bool((float_logits.argmax(-1) == exact[:, width:]).all()),
    }
    if truth is not None:
        figures["correct"] = [
            float((t[:, width:] == truth[:, width:]).mean()) for t in (exact, int8)
        ]
    return figures


def accuracy_section(model, training, data, args):
    held_out = data["held_out"][:, : TOY_PROMPT + args.generated]
    prompts = held_out[:, :TOY_PROMPT]
    trained = agreement(model, prompts, args.generated, truth=held_out)
    keras.utils.set_random_seed(1)
    untrained = agreement(decoding.keras_attn_model(**TOY), prompts, args.generated)
    rows = prompts.shape[0]
    lines = [
        "### 2. Accuracy: greedy tokens and logits, float cache against int8",
        "",
        f"The model: `SinusoidalEmbedding` + {TOY['layers']} pre-norm "
        f"`TransformerDecoder` blocks (width {TOY['width']}, {TOY['heads']} heads "
        f"of {TOY['width'] // TOY['heads']}, FFN {TOY['ffn']}), vocabulary "
        f"{TOY['vocab']}, trained with `fit` (Adam 3e-3, batch 64, "
        f"{args.epochs} epochs, {training['train_shape'][0]:,} sequences of "
        f"{training['train_shape'][1] - 1} tokens, seed 0, "
        f"{training['seconds']:.0f} s) on `x[t] = table[x[t - 2], x[t - 1]]`, "
        "a fixed random table. Final loss "
        f"{training['loss']:.4f}; on held-out sequences the next token is "
        f"right at {training['accuracy']:.2%} of positions, with a mean "
        f"probability of {training['confidence']:.3f} for the argmax.",
        "",
        f"{rows} held-out prompts of {TOY_PROMPT} tokens, {args.generated} new "
        "tokens each, greedy. Agreement: the share of new tokens that are the "
        "same with both caches (a first difference changes the rest of its "
        "row). Logits: each new position's whole logit vector from both caches "
        "along the float path (teacher-forced on the float cache's tokens, the "
        "prompt in one pass then a step a token, through `decode_unchecked`); "
        "rel. diff = max |int8 - float| / max |float| of that vector; argmax "
        "agreement: of those teacher-forced steps.",
        "",
        "| model | greedy agreement | rows identical | rel. diff, worst "
        "| rel. diff, median | teacher-forced argmax agreement |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, f in (("trained", trained), ("untrained (random)", untrained)):
        lines.append(
            f"| {name} | {f['agreement']:.2%} | {f['rows']}/{rows} | "
            f"{f['worst']:.4%} | {f['median']:.4%} | {f['forced']:.2%} |"
        )
    lines += [
        "",
        "Checks: the float cache's step-by-step logits against the model's own "
        f"pass over the whole sequence, worst rel. diff {trained['path']:.1e} "
        f"(trained), {untrained['path']:.1e} (untrained); their argmax replays "
        "the float `generate` tokens: "
        f"{'yes' if trained['replays'] and untrained['replays'] else 'no'}. "
        "The trained model's greedy tokens are the table's at "
        f"{trained['correct'][0]:.2%} (float cache) and "
        f"{trained['correct'][1]:.2%} (int8) of new positions.",
        "",
        target_line(
            "greedy agreement", trained["agreement"], trained["agreement"] >= 0.98,
            "{:.2%}",
        ),
        target_line(
            "logits rel. diff", trained["worst"], trained["worst"] <= 0.02, "{:.2%}"
        ),
    ]  # fmt: skip
    return "\n".join(lines)


# --- 3. Keys per token or per channel (KIVI) --------------------------------


def per_token(x):
    """`x` `(..., D)` through `keras_attn.cache.quantize` (the int8 cache's
    own: a scale per vector) and back, numpy."""
    q, scale = quantize(x)
    return ops.convert_to_numpy(ops.cast(q, "float32") * scale)


def per_channel(x, group=GROUP):
    """`x` `(B, K, S, D)` quantized to int8 with a scale per channel over
    each `group` of tokens (KIVI's keys: `s = max|x| / 127` over the group),
    and back, numpy."""
    out = np.empty_like(x)
    for start in range(0, x.shape[2], group):
        block = x[:, :, start : start + group]
        scale = np.abs(block).max(axis=2, keepdims=True) / 127.0
        q = np.clip(np.round(block / np.where(scale > 0, scale, 1.0)), -127, 127)
        out[:, :, start : start + group] = q * scale
    return out


def prefill(model, tokens):
    """The float caches (numpy `(B, 2, K, S, D)`) after `tokens` `(B, S)` in
    one pass, and each decoder's queries (numpy `(B, H, S, D)`)."""
    embedding, blocks, _ = parts(model)
    batch, length = tokens.shape
    caches, queries = [], []
    with no_grad():
        x = embedding(tokens)
        for block in blocks:
            hidden = block.self_attention_layer_norm(x)  # pre-norm blocks
            q = block.self_attention.query_dense(hidden)  # (B, S, H, D)
            queries.append(np.transpose(ops.convert_to_numpy(q), (0, 2, 1, 3)))
            cache = as_cache(block.get_empty_self_attention_cache(batch, length))
            x, cache = block.decode_unchecked(x, cache, 0, mask=cache.mask(0, length))
            caches.append(ops.convert_to_numpy(cache.kv))
            keys = ops.convert_to_numpy(block.self_attention.key_dense(hidden))
            assert np.allclose(  # the queries' path reads the keys' as the cache
                np.transpose(keys, (0, 2, 1, 3)), caches[-1][:, 0], atol=1e-4
            ), "keys by hand differ from the cache's: the queries would too"
    return caches, queries


def next_logits(model, tokens, caches):
    """The logits `(B, V)` at the next position of `tokens` `(B, S + 1)`
    over the first `S` positions' caches `caches` (numpy, one a decoder)."""
    embedding, blocks, head = parts(model)
    index = tokens.shape[1] - 1
    with no_grad():
        h = embedding(tokens)[:, index:]
        for block, kv in zip(blocks, caches, strict=True):
            widths = [[0, 0]] * 3 + [[0, 1], [0, 0]]
            cache = DenseCache(ops.convert_to_tensor(np.pad(kv, widths)))
            h, _ = block.decode_unchecked(h, cache, index, mask=cache.mask(index, 1))
        for layer in head:
            h = layer(h)
    return ops.convert_to_numpy(ops.cast(h, "float32"))[:, -1]


def kivi_figures(model, tokens):
    """Errors of keys per token and per channel, for `model` after `tokens`
    `(B, S + 1)` (`S` the prompt, the last the next token)."""
    caches, queries = prefill(model, tokens[:, :-1])
    blocks = parts(model)[1]
    exact = next_logits(model, tokens, caches)
    figures = {}
    for name, keys_of in (("per token", per_token), ("per channel", per_channel)):
        rebuilt, errors = [], []
        for block, kv, q in zip(blocks, caches, queries, strict=True):
            keys = keys_of(kv[:, 0])
            rebuilt.append(np.stack([keys, per_token(kv[:, 1])], axis=1))
            scale = block.self_attention.attention_scale or q.shape[-1] ** -0.5
            errors.append(attention_errors(q, kv[:, 0], keys, scale))
        logits = next_logits(model, tokens, rebuilt)
        figures[name] = {
            key: max(e[key] for e in errors) for key in errors[0]
        } | {
            "next": float(relative_difference(logits, exact).max()),
            "argmax": float((logits.argmax(-1) == exact.argmax(-1)).mean()),
        }  # fmt: skip
    figures["spread"] = channel_spread([kv[:, 0] for kv in caches])
    return figures


def attention_errors(queries, keys, rebuilt, scale):
    """The keys' and the causal attention logits' and probabilities' errors
    with `rebuilt` keys; all `(B, H, S, D)`."""
    causal = np.tril(np.ones((keys.shape[2],) * 2, bool))
    exact, approx = (
        scale * np.einsum("bhqd,bhkd->bhqk", queries, k) for k in (keys, rebuilt)
    )
    seen = np.broadcast_to(causal, exact.shape)
    difference = np.abs(approx - exact)[seen]
    probabilities = [softmax(np.where(causal, x, -np.inf)) for x in (approx, exact)]
    return {
        "keys": float(np.linalg.norm(rebuilt - keys) / np.linalg.norm(keys)),
        "logits max": float(difference.max() / np.abs(exact[seen]).max()),
        "logits rms": float(
            np.sqrt((difference**2).mean() / (exact[seen] ** 2).mean())
        ),
        "probabilities": float(np.abs(probabilities[0] - probabilities[1]).max()),
    }


def softmax(x):
    x = np.exp(x - x.max(-1, keepdims=True))
    return x / x.sum(-1, keepdims=True)


def channel_spread(keys):
    """The keys' largest channel RMS over their median channel RMS, per
    head, averaged (KIVI's case: a few channels far larger than the rest)."""
    ratios = []
    for k in keys:  # (B, K, S, D)
        rms = np.sqrt((k**2).mean(axis=(0, 2)))  # (K, D)
        ratios.append((rms.max(-1) / np.median(rms, -1)).mean())
    return float(np.mean(ratios))


def with_outlier_keys(model, sizes, channels=2, factor=8.0):
    """A copy of `model` (a `keras_attn_model` of `sizes`) whose keys have
    `channels` channels a head `factor` times larger (those columns of the
    key projection scaled): keys shaped like a large language model's, with a
    few outlier channels, KIVI's case."""
    copy = decoding.keras_attn_model(**sizes)
    copy.set_weights(model.get_weights())
    for block in parts(copy)[1]:
        for weight in block.self_attention.key_dense.weights:  # (..., K, D)
            value = ops.convert_to_numpy(weight)
            value[..., :channels] *= factor
            weight.assign(value)
    return copy


def kivi_section(trained, findings, data, args):
    length = 2 * GROUP if args.quick else 4 * GROUP
    toy_tokens = data["held_out"][:, : 2 * GROUP + 1]
    rng = np.random.default_rng(1)
    vocab = args.findings["vocab"]
    random_tokens = rng.integers(1, vocab, (FINDINGS_BATCH, length + 1)).astype("int32")
    cases = [
        ("trained toy", f"{toy_tokens.shape[0]} held-out rows of {2 * GROUP}",
         trained, toy_tokens),
        ("FINDINGS decoder", f"random weights, {FINDINGS_BATCH} random rows of "
         f"{length}", findings, random_tokens),
        ("FINDINGS decoder, outlier keys", "the same, 2 key channels a head "
         "scaled 8x", with_outlier_keys(findings, args.findings), random_tokens),
    ]  # fmt: skip
    lines = [
        "### 3. Keys per token (ours) or per channel (KIVI), both int8",
        "",
        "Each model's float caches after a prompt, read back and quantized in "
        "numpy: keys per token (`keras_attn.cache.quantize`, a scale per key "
        f"vector and head: 4 bytes a token and head) or per channel over groups "
        f"of {GROUP} tokens (KIVI: a scale per channel and group, 4 x head_dim / "
        f"{GROUP} bytes a token and head; every group quantized, no float window "
        "of recent tokens), values per token in both. Keys: ||K' - K|| / ||K||. "
        "Attention logits (`q . k * scale`, every causal pair, each decoder's "
        "own queries): max |error| / max |logit| and RMS error / RMS logit; "
        "probabilities: max |error|. Next token: the logits at the position "
        "after the prompt, run over the rebuilt caches, max |error| / max "
        "|logit| (worst row), and whether its argmax agrees (share of rows). "
        "Each column: the worst decoder. Key channel spread: the largest "
        "channel RMS over the median one, per head (KIVI's premise: a few "
        "channels far larger).",
        "",
        "| model | keys | keys error | attention logits, max | attention "
        "logits, RMS | probabilities, max | next token logits | next token "
        "argmax agreement | key channel spread |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    verdicts = []
    for name, detail, model, tokens in cases:
        figures = kivi_figures(model, tokens)
        for keys in ("per token", "per channel"):
            f = figures[keys]
            lines.append(
                f"| {name} ({detail}) | {keys} | {f['keys']:.4f} | "
                f"{f['logits max']:.4f} | "
                f"{f['logits rms']:.4f} | {f['probabilities']:.4f} | "
                f"{f['next']:.4%} | {f['argmax']:.0%} | {figures['spread']:.1f} |"
            )
        better = min(("per token", "per channel"), key=lambda k: figures[k]["next"])
        verdicts.append(f"{name}: keys {better}")
    lines += ["", "Smaller next-token logits error: " + "; ".join(verdicts) + "."]
    return "\n".join(lines)


# --- 4. Time per new token ---------------------------------------------------


def variants():
    """`generate` options by row name: the default, and on PyTorch eager."""
    rows = {"default (`auto`)": {}}
    if keras.config.backend() == "torch":
        rows["`jit_compile=False`"] = {"jit_compile": False}
    return rows


def time_per_token(model, prompt, new_tokens, calls):
    """Rows `(variant, float ms/token, int8 ms/token, first calls)` for the
    `generate` calls of `model`, all interleaved."""
    functions = {}
    for name, options in variants().items():
        for dtype in (None, "int8"):
            for n in (new_tokens, 1):
                functions[name, dtype, n] = lambda o=options, d=dtype, n=n: generate(
                    model, prompt, max_new_tokens=n, cache_dtype=d, **o
                )
    timings = time_calls(functions, calls)
    rows = []
    for name in variants():
        per_token = [
            (timings[name, d, new_tokens].median - timings[name, d, 1].median)
            / (new_tokens - 1)
            for d in (None, "int8")
        ]
        first = [timings[name, d, new_tokens].first for d in (None, "int8")]
        rows.append((name, *per_token, first))
    return rows


def compiled_steps(model):
    """Whether PyTorch's `jit_compile="auto"` compiled a step of `model`."""
    from keras_attn.generation import api

    generators = api._GENERATORS.get(model, {}).values()
    return any(g.forms is not None and g.forms.compiled for g in generators)


def compiled(function):
    """`function` compiled as `generate` compiles its loop: XLA on JAX and
    TensorFlow, eager on PyTorch (its default steps)."""
    backend = keras.config.backend()
    if backend == "jax":
        import jax

        return jax.jit(function)
    if backend == "tensorflow":
        import tensorflow as tf

        return tf.function(function, jit_compile=True)
    return function


def attention_times(model, context, calls):
    """Milliseconds of the first decoder's self-attention for one new token
    over a full cache of `context` slots, of the cache's `read` alone and of
    the cast of its tensor to float32 (each summed, so it is computed), float
    cache and int8: a dict by (piece, dtype)."""
    block = parts(model)[1][0]
    width = block.self_attention.query_dense.kernel.shape[0]
    rng = np.random.default_rng(0)
    with no_grad():
        caches = {
            dtype: as_cache(
                block.get_empty_self_attention_cache(FINDINGS_BATCH, context, dtype)
            )
            for dtype in ("float32", "int8")
        }
        heads, dim = caches["float32"].kv.shape[2], caches["float32"].kv.shape[4]
        keys, values = (
            rng.standard_normal((FINDINGS_BATCH, context, heads, dim), "float32")
            for _ in range(2)
        )
        caches = {d: c.update(keys, values, 0) for d, c in caches.items()}
        x = ops.convert_to_tensor(
            rng.standard_normal((FINDINGS_BATCH, 1, width), "float32")
        )
        mask = caches["float32"].mask(context - 1, 1)

    def attention(x, cache, mask):
        return block.self_attention.decode_unchecked(x, cache, mask=mask)[0]

    def read(cache):
        return sum(ops.sum(t) for t in cache.read("float32"))

    def cast(cache):
        return ops.sum(ops.cast(cache.kv, "float32"))

    attention = compiled(attention)
    pieces = {
        "attention": lambda cache: attention(x, cache, mask),
        "read": compiled(read),
        "cast": compiled(cast),
    }
    functions = {}
    for piece, function in pieces.items():
        for dtype, cache in caches.items():
            functions[piece, dtype] = lambda f=function, c=cache: ops.convert_to_numpy(
                f(c)
            )
    with no_grad():
        timings = time_calls(functions, calls)
    return {key: t.median * 1e3 for key, t in timings.items()}


def speed_section(findings, args):
    keras.utils.set_random_seed(0)
    bench = decoding.keras_attn_model()
    bench_prompt = (
        np.random.default_rng(0)
        .integers(1, decoding.VOCAB, (decoding.BATCH, decoding.PROMPT))
        .astype("int32")
    )
    vocab = args.findings["vocab"]
    findings_prompt = (
        np.random.default_rng(0)
        .integers(1, vocab, (FINDINGS_BATCH, FINDINGS_PROMPT))
        .astype("int32")
    )
    cases = [
        (f"generation.py model (batch {decoding.BATCH}, prompt {decoding.PROMPT}, "
         f"{args.new_tokens} new)", bench, bench_prompt, args.new_tokens,
         args.small_calls),
        (f"FINDINGS decoder (batch {FINDINGS_BATCH}, prompt {FINDINGS_PROMPT}, "
         f"{args.findings_new_tokens} new)", findings, findings_prompt,
         args.findings_new_tokens, args.calls),
    ]  # fmt: skip
    if args.quick:  # a smoke run: one model's calls, one context
        cases = cases[1:]
    rows = []
    for name, model, prompt, new_tokens, calls in cases:
        for row in time_per_token(model, prompt, new_tokens, calls):
            rows.append((name, *row))
            print(f"{name}, {row[0]}: {row[1] * 1e3:.3f} / {row[2] * 1e3:.3f} ms")
    auto = [compiled_steps(case[1]) for case in cases]
    contexts = (FINDINGS_PROMPT + args.findings_new_tokens, args.context)
    contexts = contexts[len(cases) == 1 :]
    times = {n: attention_times(findings, n, args.attention_calls) for n in contexts}
    return speed_lines(rows, auto, times, args)


def speed_lines(rows, auto, times, args):
    lines = [
        "### 4. Time per new token, float cache against int8",
        "",
        f"Greedy `generate`; a time per token is (a call of N new tokens - a call "
        f"of 1) / (N - 1), each call the {describe(args.small_calls)} (the "
        f"generation.py model) or the {describe(args.calls)} (the FINDINGS "
        "decoder), all calls of a model interleaved. The generation.py model: "
        "2 blocks, width 64, 4 "
        "heads, FFN 128, vocabulary 1000. First call: of N tokens, compiling "
        "included (float / int8).",
        "",
        "| model | jit_compile | float ms/token | int8 ms/token | int8 / float "
        "| first call, s |",
        "|---|---|---:|---:|---:|---:|",
    ]
    ratios = []
    for name, variant, exact, int8, first in rows:
        ratios.append(int8 / exact)
        lines.append(
            f"| {name} | {variant} | {exact * 1e3:.3f} | {int8 * 1e3:.3f} | "
            f"{int8 / exact:.2f}x | {first[0]:.1f} / {first[1]:.1f} |"
        )
    if keras.config.backend() == "torch":
        lines += [
            "",
            "On PyTorch the default (`auto`) compiled a step: "
            f"{', '.join('yes' if a else 'no' for a in auto)} (the two models): "
            "where no, it ran the eager step, as `jit_compile=False` does.",
        ]
    lines += attention_lines(times, args)
    worst = max(ratios)
    lines += ["", target_line("int8 / float time", worst, worst <= 1.1, "{:.2f}x")]
    lines[-1] += " (the worst `generate` row)"
    return "\n".join(lines)


def attention_lines(times, args):
    """The table of `attention_times` by context (`times`: context -> dict)."""
    width, heads = args.findings["width"], args.findings["heads"]
    slots = " and ".join(f"{n:,}" for n in times)
    lines = [
        "",
        f"Where the time goes, over caches of {slots} slots (the FINDINGS "
        "decoder's `generate` length above, and a long context): its first "
        "self-attention sublayer for one new token per row (`attention`: "
        "projections and attention over a full cache, batch "
        f"{FINDINGS_BATCH}, {heads} heads of {width // heads}; no cache write); "
        "of it, the cache's `read` alone (keys and values in float32, summed); "
        "and of that, the cast of the cache's tensor to float32 (`cast`, "
        "summed; for the float cache a sum of its tensor, as its read). "
        f"Each the {describe(args.attention_calls)}, interleaved, compiled as "
        "`generate` compiles its loop (`jax.jit`, `tf.function(jit_compile="
        "True)`, eager PyTorch). A token's step runs each once per decoder.",
        "",
        "| slots | part | float ms | int8 ms | int8 - float, ms | int8 / float |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for context, pieces in times.items():
        for part in ("attention", "read", "cast"):
            exact, int8 = pieces[part, "float32"], pieces[part, "int8"]
            lines.append(
                f"| {context:,} | {part} | {exact:.3f} | {int8:.3f} | "
                f"{int8 - exact:+.3f} | {int8 / exact:.2f}x |"
            )
    return lines


if __name__ == "__main__":
    main()
