"""A small GPT learns to add: "123+456=" -> "579", one character at a time.

Runs on any Keras 3 backend in a few minutes on a laptop CPU:

    KERAS_BACKEND=jax python examples/gpt_addition.py

A decoder-only Transformer (`SinusoidalEmbedding`, `TransformerDecoder` blocks
without an encoder, so causal self-attention only, and a `Dense` head) reads
character tokens: the digits, "+", "=" and an end token. It is trained, like a
GPT, to predict the next character, with the loss on the answer only (the
operands are random, so predicting them teaches nothing). Operands have 1 to
`--digits` digits (up to 3 by default).

By default the answer is written least significant digit first
("123+456=975" for 579), the way one adds by hand: each digit then depends only
on the operand digits and the carry from the digit just written. It is a known
trick that makes addition easier to learn for a small model; `--no-reverse`
writes answers the usual way (with the defaults that also works, slightly less
well). Answers are printed in the usual order.

Held out: 1,000 sums whose operand pair, in either order, never appears in
training. The reloaded model answers them with cached greedy decoding
(`keras_attn.generation.generate`, prompts of different lengths left-padded,
stopping at the end token). The last line printed is
`accuracy on unseen sums: XX.X%`.
"""

import argparse
import os
import time

import console  # First: before anything imports TensorFlow.
import keras
import numpy as np

import keras_attn
from keras_attn.generation import generate

PAD = 0
CHARACTERS = "0123456789+="  # ids 1..12
END = len(CHARACTERS) + 1  # 13
VOCABULARY_SIZE = END + 1


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--output", default="outputs/gpt_addition")
    parser.add_argument("--digits", type=int, default=3)
    parser.add_argument("--train-size", type=int, default=40000)
    parser.add_argument("--test-size", type=int, default=1000)
    parser.add_argument(
        "--reverse",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Write answers least significant digit first (default).",
    )
    parser.add_argument("--embedding-dim", type=int, default=128)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--num-heads", type=int, default=4)
    parser.add_argument("--intermediate-dim", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--learning-rate", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=42)
    return parser.parse_args()


def ids(text):
    return [CHARACTERS.index(c) + 1 for c in text]


def text(token_ids):
    """Characters up to the first end token or padding."""
    out = []
    for i in token_ids:
        if i in (PAD, END):
            break
        out.append(CHARACTERS[i - 1])
    return "".join(out)


def sample_pairs(rng, size, digits, exclude=frozenset()):
    """`size` distinct `(a, b)` operand pairs, neither order in `exclude`.

    The number of digits of each operand (1 to `digits`) is uniform, then the
    operand is uniform among the numbers with that many digits.
    """
    chosen, seen = [], set(exclude)
    while len(chosen) < size:
        lengths = rng.integers(1, digits + 1, (size, 2))
        low = np.where(lengths == 1, 0, 10 ** (lengths - 1))
        for a, b in rng.integers(low, 10**lengths).tolist():
            if (a, b) not in seen and (b, a) not in seen and len(chosen) < size:
                seen.add((a, b))
                chosen.append((a, b))
    return chosen


def answer(a, b, reverse):
    total = str(a + b)
    return total[::-1] if reverse else total


def training_arrays(pairs, reverse, length):
    """`(inputs, labels)`: next-character prediction, loss on the answer only.

    The row for "12+7=" with answer "91" (19 reversed) is
    `inputs = "12+7=91"` and `labels` the next character after each input
    position, padding (ignored by the loss) before the "=".
    """
    inputs = np.zeros((len(pairs), length), "int32")
    labels = np.zeros((len(pairs), length), "int32")
    for row, (a, b) in enumerate(pairs):
        prompt, target = ids(f"{a}+{b}="), ids(answer(a, b, reverse)) + [END]
        sequence = prompt + target
        inputs[row, : len(sequence) - 1] = sequence[:-1]
        labels[row, len(prompt) - 1 : len(sequence) - 1] = target
    return inputs, labels


def prompts(pairs):
    """Left-padded prompt ids: each row ends with its "="."""
    rows = [ids(f"{a}+{b}=") for a, b in pairs]
    width = max(len(row) for row in rows)
    out = np.zeros((len(rows), width), "int32")
    for i, row in enumerate(rows):
        out[i, width - len(row) :] = row
    return out


def build_model(args):
    """Functional GPT: ids -> embedding -> causal decoder blocks -> logits."""
    token_ids = keras.Input(shape=(None,), dtype="int32", name="token_ids")
    x = keras_attn.SinusoidalEmbedding(
        embedding_dim=args.embedding_dim,
        vocabulary_size=VOCABULARY_SIZE,
        mask_zero=True,
        name="embedding",
    )(token_ids)
    for i in range(args.num_layers):
        x = keras_attn.TransformerDecoder(  # No encoder: decoder-only.
            intermediate_dim=args.intermediate_dim,
            num_heads=args.num_heads,
            normalize_first=True,  # Pre-norm, as in GPT-2.
            name=f"decoder_{i}",
        )(x)
    x = keras.layers.LayerNormalization(name="final_norm")(x)
    logits = keras.layers.Dense(VOCABULARY_SIZE, name="logits")(x)
    return keras.Model(token_ids, logits, name="gpt_addition")


def solve(model, pairs, reverse, digits, batch_size=250):
    """Greedy answers, as ints (-1 where the output is no number).

    Prints a line of progress after each batch of `batch_size` sums.
    """
    answers, started = [], time.perf_counter()
    new_tokens = digits + 2  # the longest sum, then the end token
    for begin in range(0, len(pairs), batch_size):
        prompt = prompts(pairs[begin : begin + batch_size])
        tokens = generate(
            model,
            prompt,
            max_new_tokens=new_tokens,
            end_token_id=END,
            pad_token_id=PAD,
        )
        for row in tokens[:, prompt.shape[1] :]:
            digits_out = text(row)
            digits_out = digits_out[::-1] if reverse else digits_out
            answers.append(int(digits_out) if digits_out.isdigit() else -1)
        print(
            f"  answered {len(answers)}/{len(pairs)} sums "
            f"({time.perf_counter() - started:.1f} s)",
            flush=True,
        )
    return answers


def compile_model(model, args, steps):
    warmup = steps // 10
    schedule = keras.optimizers.schedules.CosineDecay(
        0.0,
        decay_steps=max(1, steps - warmup),
        warmup_target=args.learning_rate,
        warmup_steps=warmup,
        alpha=0.02,
    )
    model.compile(
        optimizer=keras.optimizers.AdamW(schedule, weight_decay=1e-4, clipnorm=1.0),
        loss=keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, ignore_class=PAD
        ),
        # Weighted by `fit`'s sample weights: the accuracy on answer characters.
        weighted_metrics=[keras.metrics.SparseCategoricalAccuracy(name="accuracy")],
    )


def self_attention_scores(model, token_ids):
    """Self-attention weights of every decoder block, by calling the layers.

    Returns numpy `(blocks, heads, length, length)` for one sequence `(1, length)`.
    """
    x = model.get_layer("embedding")(token_ids)
    scores = []
    for layer in model.layers:
        if isinstance(layer, keras_attn.TransformerDecoder):
            x, block_scores = layer(
                x, decoder_padding_mask=token_ids != PAD, return_attention_scores=True
            )
            scores.append(keras.ops.convert_to_numpy(block_scores)[0])
    return np.stack(scores)


def plot_attention(model, a, b, reverse, path):
    """Heatmaps: which characters each head looks at as it writes the answer.

    The model reads `a+b=` and the correct answer; in each panel (one per block
    and head), row i is the position that predicts answer character i (the
    last row predicts the end).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = ids(f"{a}+{b}=") + ids(answer(a, b, reverse))
    scores = self_attention_scores(model, np.array([written], "int32"))
    # Query i predicts character i + 1: the answer is predicted from "=" on.
    first = len(ids(f"{a}+{b}=")) - 1
    rows = scores[:, :, first:, :]  # (blocks, heads, answer + end, length)
    labels = [CHARACTERS[i - 1] for i in written]
    produced = labels[first + 1 :] + ["end"]

    blocks, heads = rows.shape[:2]
    figure, axes = plt.subplots(
        blocks,
        heads,
        figsize=(0.3 * len(labels) * heads + 1, 0.3 * len(produced) * blocks + 1),
        squeeze=False,
    )
    for (block, head), panel in np.ndenumerate(axes):
        image = panel.imshow(rows[block, head], cmap="viridis", vmin=0, vmax=1)
        panel.set_xticks(range(len(labels)), labels, fontsize=7)
        panel.set_yticks(range(len(produced)), produced, fontsize=7)
        panel.set_title(f"block {block}, head {head}", fontsize=8)
    for panel in axes[-1]:
        panel.set_xlabel("character attended to", fontsize=8)
    for panel in axes[:, 0]:
        panel.set_ylabel("answer character\nbeing written", fontsize=8)
    figure.suptitle(f"Self-attention while writing the answer of {a}+{b}")
    figure.colorbar(image, ax=axes, fraction=0.02, pad=0.01, label="weight")
    figure.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(figure)


def main():
    args = parse_args()
    keras.utils.set_random_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    print(f"keras {keras.__version__}, backend {keras.backend.backend()}")

    train_pairs = sample_pairs(rng, args.train_size, args.digits)
    test_pairs = sample_pairs(rng, args.test_size, args.digits, exclude=train_pairs)
    length = 2 * args.digits + 2 + args.digits + 1  # a+b= , sum, end
    inputs, labels = training_arrays(train_pairs, args.reverse, length)
    whole = len(inputs) // args.batch_size * args.batch_size or len(inputs)
    inputs, labels = inputs[:whole], labels[:whole]  # one compiled batch shape
    print(f"{len(inputs)} training sums, {len(test_pairs)} held out; e.g.")
    for row in range(3):
        a, b = train_pairs[row]
        note = f"  ({a + b} written backwards)" if args.reverse else ""
        print(f"  {text(inputs[row])}{note}")

    model = build_model(args)
    compile_model(model, args, args.epochs * (len(inputs) // args.batch_size or 1))
    model.summary()
    started = time.perf_counter()
    model.fit(
        inputs,
        labels,
        sample_weight=(labels != PAD).astype("float32"),
        batch_size=args.batch_size,
        epochs=args.epochs,
        verbose=console.fit_verbose(),
    )
    print(f"trained in {time.perf_counter() - started:.0f} s")

    os.makedirs(args.output, exist_ok=True)
    path = os.path.join(args.output, "gpt_addition.keras")
    model.save(path)
    restored = keras.models.load_model(path)  # keras_attn layers are registered.
    print(f"saved and reloaded {path}")

    started = time.perf_counter()
    answers = solve(restored, test_pairs, args.reverse, args.digits)
    correct = [a + b == got for (a, b), got in zip(test_pairs, answers, strict=True)]
    seconds = time.perf_counter() - started
    print(
        f"the reloaded model answered {len(test_pairs)} unseen sums in {seconds:.1f} s"
    )
    for (a, b), got, ok in list(zip(test_pairs, answers, correct, strict=True))[:8]:
        shown = got if got >= 0 else "(no number)"
        print(f"  {a}+{b}={shown}  {'ok' if ok else f'WRONG, expected {a + b}'}")

    # The longest sum of the first few, to see the digits line up.
    a, b = max(test_pairs[:8], key=lambda pair: len(f"{pair[0]}+{pair[1]}"))
    picture = os.path.join(args.output, "self_attention.png")
    plot_attention(restored, a, b, args.reverse, picture)
    print(f"self-attention while writing {a}+{b}: {picture}")
    print(f"accuracy on unseen sums: {100 * np.mean(correct):.1f}%")


if __name__ == "__main__":
    main()
