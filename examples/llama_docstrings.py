"""A small LLaMA-style language model learns the standard library's docstrings.

Runs on any Keras 3 backend in a few minutes on a laptop CPU, no download (the
text ships with Python):

    KERAS_BACKEND=jax python examples/llama_docstrings.py

The text: the docstrings of the standard library's public modules and of the
classes, functions and methods they define (each object's own `__doc__`,
cleaned by `inspect.cleandoc`; close to a million characters on Python 3.11).
Tokens are UTF-8 bytes (id = byte + 1; id 0 is padding), which for this almost
all-ASCII text are its characters. Modules are split by a hash of their name,
so the held-out text (`asyncio`, `json`, `math`, `threading`, ... on 3.11)
comes from modules the model never saw; held-out docstrings that also occur in
a training module are dropped. Each module is cut into windows of `--length`
bytes, its last window right-padded.

The model is the LLaMA recipe at a small scale, from keras_attn and Keras parts:
a `ReversibleEmbedding` of the tokens (no absolute positions), pre-norm
`TransformerDecoder` blocks with rotary position embeddings (RoPE),
grouped-query attention, RMSNorm, a SwiGLU feed-forward network and no biases,
every other block attending only to a sliding window, a final `RMSNormalization`
and the embedding again, reversed, as the output layer (tied weights). A
Transformer of 2017 with about as many parameters (`SinusoidalEmbedding`,
post-norm blocks with LayerNorm, ReLU and biases, a `Dense` head) trains on
the same windows for comparison.

Both train with `model.fit` to predict the next byte. The program reports each
model's held-out perplexity (exp of the mean negative log-likelihood per
predicted byte), saves the LLaMA-style model as `.keras` and checks that the
reloaded model gives the same logits, then lets it continue a few held-out
docstrings with top-k sampling (`keras_attn.generation.generate`, KV-cached).
The last line printed is `held-out perplexity: X.XX (2017 baseline: Y.YY)`.
"""

import argparse
import importlib
import inspect
import os
import sys
import time
import warnings
import zlib

import console  # First: before anything imports TensorFlow.
import keras
import numpy as np

import keras_attn
from keras_attn.generation import generate

PAD = 0  # byte b has id b + 1
VOCABULARY_SIZE = 257
# Importing these does something: open a web browser, print the Zen of Python.
SKIPPED_MODULES = {"antigravity", "this"}


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--output", default="outputs/llama_docstrings")
    parser.add_argument(
        "--train-chars",
        type=int,
        default=640_000,
        help="Train on at most this many bytes of the training modules.",
    )
    parser.add_argument(
        "--eval-chars",
        type=int,
        default=60_000,
        help="Evaluate on at most this many bytes of the held-out modules.",
    )
    parser.add_argument(
        "--held-out-percent",
        type=int,
        default=10,
        help="Share of the modules held out, chosen by a hash of their name.",
    )
    parser.add_argument("--length", type=int, default=128, help="Window length.")
    parser.add_argument("--width", type=int, default=96)
    parser.add_argument("--num-layers", type=int, default=3)
    parser.add_argument("--num-heads", type=int, default=4)
    parser.add_argument("--num-key-value-heads", type=int, default=2)
    parser.add_argument(
        "--intermediate-dim",
        type=int,
        default=256,
        help="Hidden width of the SwiGLU networks (8/3 of the width).",
    )
    parser.add_argument(
        "--sliding-window",
        type=int,
        default=32,
        help="Attention window of every other block (the odd ones).",
    )
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--learning-rate", type=float, default=5e-3)
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--prompt-chars", type=int, default=40)
    parser.add_argument("--new-chars", type=int, default=80)
    parser.add_argument("--top-k", type=int, default=5)
    parser.add_argument("--seed", type=int, default=42)
    return parser.parse_args()


# ---------------------------------------------------------------- data


def module_docstrings(name):
    """The docstrings of module `name` and of what it defines, in name order.

    The module's own, then those of its public classes and functions and of
    the classes' public methods. `[]` if the module cannot be imported here
    (e.g. `winreg` off Windows).
    """
    try:
        module = importlib.import_module(name)
    except ImportError:
        return []
    objects = [module]
    for key, value in sorted(vars(module).items()):
        if key.startswith("_") or getattr(value, "__module__", None) != name:
            continue
        if inspect.isclass(value) or inspect.isroutine(value):
            objects.append(value)
        if inspect.isclass(value):
            objects += [
                method
                for key, method in sorted(vars(value).items())
                if not key.startswith("_") and inspect.isroutine(method)
            ]
    # Their own docstrings only: `inspect.getdoc` would also find inherited
    # ones, and so the same text under many modules.
    docs = [getattr(o, "__doc__", None) for o in objects]
    docs = [inspect.cleandoc(doc) for doc in docs if isinstance(doc, str)]
    return list(dict.fromkeys(doc for doc in docs if doc))  # in order, once each


def read_docstrings(held_out_percent):
    """`(train, held_out)`: dicts module name -> its docstrings.

    A module is held out when the CRC-32 of its name, mod 100, is below
    `held_out_percent`: the same split on every run and machine. Held-out
    docstrings that also appear in a training module are dropped.
    """
    train, held_out = {}, {}
    for name in sorted(sys.stdlib_module_names):
        if name.startswith("_") or name in SKIPPED_MODULES:
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # deprecated modules say so
            docs = module_docstrings(name)
        if docs:
            held = zlib.crc32(name.encode()) % 100 < held_out_percent
            (held_out if held else train)[name] = docs
    seen = {doc for docs in train.values() for doc in docs}
    held_out = {
        name: [d for d in docs if d not in seen] for name, docs in held_out.items()
    }
    return train, {name: docs for name, docs in held_out.items() if docs}


def characters(modules):
    return sum(len(doc) for docs in modules.values() for doc in docs)


def encode(text):
    return np.frombuffer(text.encode("utf-8"), np.uint8).astype("int32") + 1


def decode(ids):
    data = bytes(int(i) - 1 for i in ids if i != PAD)
    return data.decode("utf-8", errors="replace")


def windows(modules, length):
    """`(inputs, labels)`, each `(windows, length)`: next-byte prediction.

    Each module's docstrings, joined by blank lines, are cut into windows of
    `length` inputs; the labels are the inputs shifted by one byte. A window
    never spans two modules, so the last one of each module is right-padded
    with `PAD`, which the loss ignores.
    """
    inputs, labels = [], []
    for docs in modules.values():
        ids = encode("\n\n".join(docs))
        for start in range(0, len(ids) - 1, length):
            chunk = ids[start : start + length + 1]
            inputs.append(np.pad(chunk[:-1], (0, length + 1 - len(chunk))))
            labels.append(np.pad(chunk[1:], (0, length + 1 - len(chunk))))
    return np.stack(inputs), np.stack(labels)


def take(inputs, labels, chars, rng, multiple=1):
    """Random windows holding at most `chars` bytes in all (at least one),
    as many as a multiple of `multiple` where there are enough."""
    order = rng.permutation(len(inputs))[: max(1, chars // inputs.shape[1])]
    if len(order) >= multiple:
        order = order[: len(order) // multiple * multiple]
    return inputs[order], labels[order]


def prepare(args, rng):
    """Training and held-out windows, and the held-out modules' docstrings."""
    train, held_out = read_docstrings(args.held_out_percent)
    print(
        f"{len(train)} modules ({characters(train):,} characters of docstrings) "
        f"to train on, {len(held_out)} held out ({characters(held_out):,}): "
        f"{', '.join(held_out)}"
    )
    train_inputs, train_labels = take(
        *windows(train, args.length), args.train_chars, rng, args.batch_size
    )
    test_inputs, test_labels = take(
        *windows(held_out, args.length), args.eval_chars, rng
    )
    print(
        f"{len(train_inputs)} training windows of {args.length} bytes, "
        f"{len(test_inputs)} held-out windows; e.g. {decode(train_inputs[0])!r}"
    )
    return (train_inputs, train_labels), (test_inputs, test_labels), held_out


# ---------------------------------------------------------------- models


def build_llama(args):
    """LLaMA-style: tied embedding, RoPE, GQA, RMSNorm, SwiGLU, pre-norm."""
    token_ids = keras.Input(shape=(None,), dtype="int32", name="token_ids")
    embedding = keras.layers.ReversibleEmbedding(
        VOCABULARY_SIZE, args.width, mask_zero=True, name="embedding"
    )
    x = embedding(token_ids)  # no positions here: the blocks rotate q and k
    for i in range(args.num_layers):
        x = keras_attn.TransformerDecoder(
            args.intermediate_dim,
            args.num_heads,
            activation="silu",
            normalize_first=True,
            num_key_value_heads=args.num_key_value_heads,
            normalization="rms_norm",
            gated_feedforward=True,  # SwiGLU
            use_bias=False,
            rope_max_wavelength=10000.0,
            sliding_window=args.sliding_window if i % 2 else None,
            name=f"decoder_{i}",
        )(x)  # decoder-only: causal self-attention, no cross-attention
    x = keras.layers.RMSNormalization(name="final_norm")(x)
    logits = embedding(x, reverse=True)  # the same table, as the output layer
    return keras.Model(token_ids, logits, name="llama")


def build_baseline(args, intermediate_dim):
    """A 2017 Transformer decoder: sinusoids, post-norm, ReLU, biases."""
    token_ids = keras.Input(shape=(None,), dtype="int32", name="token_ids")
    x = keras_attn.SinusoidalEmbedding(
        vocabulary_size=VOCABULARY_SIZE,
        embedding_dim=args.width,
        mask_zero=True,
        name="embedding",
    )(token_ids)
    for i in range(args.num_layers):
        x = keras_attn.TransformerDecoder(
            intermediate_dim, args.num_heads, name=f"decoder_{i}"
        )(x)
    logits = keras.layers.Dense(VOCABULARY_SIZE, name="logits")(x)
    return keras.Model(token_ids, logits, name="transformer_2017")


def matched_baseline(args, parameters):
    """The baseline whose feed-forward width brings it closest to `parameters`.

    Each unit of that width adds `2 * width + 1` weights per block.
    """
    smallest = build_baseline(args, 1).count_params()
    per_unit = (2 * args.width + 1) * args.num_layers
    return build_baseline(args, 1 + max(0, round((parameters - smallest) / per_unit)))


def compile_model(model, args, steps):
    warmup = max(1, steps // 10)
    schedule = keras.optimizers.schedules.CosineDecay(
        initial_learning_rate=0.0,
        warmup_target=args.learning_rate,
        warmup_steps=warmup,
        decay_steps=max(1, steps - warmup),
        alpha=0.02,
    )
    model.compile(
        optimizer=keras.optimizers.AdamW(schedule, weight_decay=1e-4, clipnorm=1.0),
        loss=keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, ignore_class=PAD
        ),
        # Weighted by `fit`'s sample weights: the accuracy over real bytes.
        weighted_metrics=[keras.metrics.SparseCategoricalAccuracy(name="accuracy")],
    )


def train(model, args, inputs, labels):
    keras.utils.set_random_seed(args.seed)  # the same batches for both models
    compile_model(model, args, args.epochs * (len(inputs) // args.batch_size or 1))
    started = time.perf_counter()
    model.fit(
        inputs,
        labels,
        sample_weight=(labels != PAD).astype("float32"),
        batch_size=args.batch_size,
        epochs=args.epochs,
        verbose=console.fit_verbose(),
    )
    print(f"trained {model.name} in {time.perf_counter() - started:.0f} s")


# ---------------------------------------------------------------- evaluation


def perplexity(model, inputs, labels, batch_size):
    """exp(mean negative log-likelihood per predicted, non-padding byte)."""
    total, count = 0.0, 0
    for begin in range(0, len(inputs), batch_size):
        logits = np.asarray(
            model.predict_on_batch(inputs[begin : begin + batch_size]), "float64"
        )
        target = labels[begin : begin + batch_size]
        logits -= logits.max(axis=-1, keepdims=True)
        log_probabilities = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        picked = np.take_along_axis(log_probabilities, target[..., None], -1)[..., 0]
        total -= picked[target != PAD].sum()
        count += int((target != PAD).sum())
    return float(np.exp(total / count))


def save_and_reload(model, path, inputs):
    """Save as `.keras`, load back, and compare the two models' logits."""
    model.save(path)
    restored = keras.models.load_model(path)  # keras_attn layers are registered.
    difference = np.max(
        np.abs(model.predict_on_batch(inputs) - restored.predict_on_batch(inputs))
    )
    print(f"saved {path}; reloaded, max |logit difference| {difference:.2g}")
    assert difference < 1e-4, f"the reloaded model differs by {difference}"
    return restored


def prompts(held_out, count, chars):
    """Left-padded ids `(count, chars)` with their modules: the first whole
    words (at most `chars` bytes) of held-out docstrings, one per module.

    Each is the module's first docstring after its own that is twice as long,
    so the prompts have different lengths and a real continuation.
    """
    chosen = []
    for name, docs in held_out.items():
        doc = next((d for d in docs[1:] if len(d) > 2 * chars), None)
        if doc is not None and len(chosen) < count:
            words = doc[: chars + 1].rsplit(" ", 1)[0]  # up to the last space
            chosen.append((name, encode(words)[:chars]))
    ids = np.zeros((len(chosen), chars), "int32")
    for row, (_, prompt) in enumerate(chosen):
        ids[row, chars - len(prompt) :] = prompt
    return ids, [name for name, _ in chosen]


def continue_docstrings(model, held_out, args):
    """Print sampled continuations of a few held-out docstrings."""
    prompt, names = prompts(held_out, args.prompts, args.prompt_chars)
    tokens = generate(
        model,
        prompt,
        max_new_tokens=args.new_chars,
        method="sample",
        top_k=args.top_k,
        seed=args.seed,
    )
    print(f"the reloaded model continues held-out docstrings (top-{args.top_k}):")
    for name, row in zip(names, tokens, strict=True):
        print(f"  {name}: {decode(row[: prompt.shape[1]])!r}")
        print(f"    -> {decode(row[prompt.shape[1] :])!r}")


def main():
    args = parse_args()
    # Keras' RMSNormalization drops the padding mask (and says so). The logits
    # need none: the loss and the perplexity skip padding by the labels.
    warnings.filterwarnings("ignore", "Layer 'final_norm'.*does not support masking")
    keras.utils.set_random_seed(args.seed)
    print(f"keras {keras.__version__}, backend {keras.backend.backend()}")
    (inputs, labels), (test_inputs, test_labels), held_out = prepare(
        args, np.random.default_rng(args.seed)
    )

    llama = build_llama(args)
    baseline = matched_baseline(args, llama.count_params())
    print(
        f"parameters: LLaMA-style {llama.count_params():,}, 2017 baseline "
        f"{baseline.count_params():,} (feed-forward width "
        f"{baseline.get_layer('decoder_0').intermediate_dim})"
    )
    scores = {}
    for model in (llama, baseline):
        train(model, args, inputs, labels)
        scores[model.name] = perplexity(model, test_inputs, test_labels, 64)
        print(f"{model.name}: held-out perplexity {scores[model.name]:.2f}")

    os.makedirs(args.output, exist_ok=True)
    path = os.path.join(args.output, "llama_docstrings.keras")
    restored = save_and_reload(llama, path, test_inputs[:8])
    continue_docstrings(restored, held_out, args)
    print(
        f"held-out perplexity: {scores['llama']:.2f} "
        f"(2017 baseline: {scores['transformer_2017']:.2f})"
    )


if __name__ == "__main__":
    main()
