"""Translate English number words into French with a Transformer encoder-decoder.

The `make demo` example. It trains a real Transformer end to end, in about two
minutes on a laptop CPU, on any Keras 3 backend:

    KERAS_BACKEND=jax python examples/translate_numbers.py
    KERAS_BACKEND=tensorflow python examples/translate_numbers.py
    KERAS_BACKEND=torch python examples/translate_numbers.py

The pairs come from `num2words`: "three hundred and forty-two thousand, one
hundred and ninety-seven" -> "trois cent quarante-deux mille cent
quatre-vingt-dix-sept". The model trains on a random sample of the integers
0..999,999 (the number of digits drawn uniformly, so small numbers are common
too) and is evaluated on 1,000 numbers that never appear in training. It has to
learn French's counting: "quatre-vingt-dix-sept" (4 x 20 + 17) for 97, "et" in
"vingt et un" but not in "quatre-vingt-un", "deux cents" but "deux cent mille".

What it shows:

- WordPiece vocabularies computed from the training text with keras-hub
  (`compute_word_piece_vocabulary`, `WordPieceTokenizer`); punctuation, and so
  every hyphen, is a token of its own. Id 0 is padding.
- A functional-API encoder-decoder: `SinusoidalEmbedding(mask_zero=True)`
  (padding masks flow from there), `TransformerEncoder` blocks,
  `TransformerDecoder` blocks with cross-attention, a `Dense` head.
- `model.fit` with teacher forcing and a warmup + cosine learning-rate schedule.
- Held-out exact match and chrF, with batched, KV-cached greedy decoding by
  `keras_attn.generation.generate` (compiled on JAX and TensorFlow).
- `.keras` save and load, then translations by the reloaded model.
- A heatmap of one cross-attention head (`--output`/cross_attention.png): which
  English word pieces it looked at while producing each French word piece.
- With `--quantize int8` (or `int4`): `model.quantize`, the share of the
  parameters converted, the quantized model's held-out exact match, and its
  `.keras` round trip.

Your own parallel corpus: `--data pairs.tsv` reads `source<TAB>target` lines
(the Tatoeba / manythings.org Anki format; further columns are ignored),
shuffles them with `--seed` and holds out the last 10% (at most 1,000 pairs).
Outputs go to `--output` (default `outputs/translate_numbers`): the model, the
two vocabularies and the picture. The last line printed is
`held-out exact match: XX.X% (n=1000)`.
"""

import argparse
import os
import re
import time
from collections import Counter

import console  # First: before anything imports TensorFlow.
import keras
import keras_hub
import numpy as np
import tensorflow as tf  # keras-hub's vocabulary learner reads a tf.data.Dataset
from num2words import num2words

import keras_attn
from keras_attn.generation import generate

RESERVED_TOKENS = ["[PAD]", "[UNK]", "[START]", "[END]"]
PAD, UNK, START, END = range(4)  # Their ids: the first entries of each vocabulary.


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--data",
        help="TSV file of `source<TAB>target` pairs to train on instead of the "
        "numbers (extra columns are ignored).",
    )
    parser.add_argument("--output", default="outputs/translate_numbers")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument(
        "--train-size",
        type=int,
        help="Training pairs. Defaults to 20000 numbers, or every pair of --data.",
    )
    parser.add_argument("--test-size", type=int, default=1000)
    parser.add_argument("--vocabulary-size", type=int, default=2000)
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=48,
        help="With --data, drop pairs longer than this many word pieces.",
    )
    parser.add_argument("--embedding-dim", type=int, default=128)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--num-heads", type=int, default=4)
    parser.add_argument("--intermediate-dim", type=int, default=256)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--learning-rate", type=float, default=3e-3)
    parser.add_argument("--decode-batch-size", type=int, default=200)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument(
        "--quantize",
        choices=["int8", "int4"],
        help="After the float evaluation, quantize the model (`model.quantize`), "
        "report how many parameters were converted, evaluate it again and save "
        "and reload it. (float8 keeps float kernels, scaled in the matmuls.)",
    )
    return parser.parse_args()


# ---------------------------------------------------------------- data


def sample_numbers(rng, size, exclude=frozenset()):
    """`size` distinct integers in 0..999,999 not in `exclude`.

    The number of digits (1 to 6) is uniform, then the number is uniform among
    those with that many digits; duplicates are drawn again.
    """
    chosen, seen = [], set(exclude)
    while len(chosen) < size:
        digits = rng.integers(1, 7, size)
        low = np.where(digits == 1, 0, 10 ** (digits - 1))
        for n in rng.integers(low, 10**digits).tolist():
            if n not in seen and len(chosen) < size:
                seen.add(n)
                chosen.append(n)
    return chosen


def number_pairs(numbers):
    return [(num2words(n, lang="en"), num2words(n, lang="fr")) for n in numbers]


def read_pairs(path):
    """`(source, target)` pairs of a TSV file; columns after the second ignored."""
    pairs = []
    with open(path, encoding="utf-8") as file:
        for line in file:
            columns = line.rstrip("\n").split("\t")
            if len(columns) >= 2 and columns[0].strip() and columns[1].strip():
                pairs.append((columns[0].strip(), columns[1].strip()))
    if not pairs:
        raise ValueError(f"No `source<TAB>target` lines in {path}.")
    return pairs


def load_data(args, rng):
    """Training and held-out `(source, target)` text pairs."""
    if args.data is None:
        train_size = args.train_size or 20000
        train_numbers = sample_numbers(rng, train_size)
        test_numbers = sample_numbers(rng, args.test_size, exclude=train_numbers)
        return number_pairs(train_numbers), number_pairs(test_numbers)
    pairs = read_pairs(args.data)
    order = rng.permutation(len(pairs))  # Corpora are often sorted (by length).
    pairs = [pairs[i] for i in order]
    held_out = min(args.test_size, max(1, len(pairs) // 10))
    train, test = pairs[:-held_out], pairs[-held_out:]
    return train[: args.train_size], test


# ---------------------------------------------------------------- tokens


def make_tokenizer(texts, vocabulary_size, path):
    """A WordPiece tokenizer whose vocabulary is learned from `texts`."""
    dataset = tf.data.Dataset.from_tensor_slices(texts).batch(1000)
    keras_hub.tokenizers.compute_word_piece_vocabulary(
        dataset,
        vocabulary_size,
        lowercase=True,
        reserved_tokens=RESERVED_TOKENS,
        vocabulary_output_file=path,  # Written out to reuse the saved model.
    )
    return keras_hub.tokenizers.WordPieceTokenizer(
        vocabulary=path, lowercase=True, special_tokens=RESERVED_TOKENS
    )


def token_lists(tokenizer, texts):
    ids = tokenizer.tokenize(texts)
    ids = ids.to_list() if hasattr(ids, "to_list") else ids
    return [[int(i) for i in row] for row in ids]


def pad(rows, length):
    out = np.zeros((len(rows), length), "int32")
    for i, row in enumerate(rows):
        out[i, : len(row)] = row
    return out


def encode(source_ids, target_ids, source_length, target_length):
    """`((source, decoder_input), labels)` arrays for teacher forcing.

    The decoder reads `[START] t1 t2 ...` and must predict `t1 t2 ... [END]`.
    """
    source = pad(source_ids, source_length)
    decoder_input = pad([[START, *row] for row in target_ids], target_length)
    labels = pad([[*row, END] for row in target_ids], target_length)
    return (source, decoder_input), labels


def detokenize(tokenizer, ids):
    """Text of token ids, up to the first [END]; start and padding dropped."""
    words = []
    for i in ids:
        if i == END:
            break
        if i not in (PAD, START):
            words.append(int(i))
    text = tokenizer.detokenize([words])[0] if words else ""
    text = text.decode("utf-8") if isinstance(text, bytes) else str(text)
    return normalize(text)


def normalize(text):
    """Lowercase, single spaces, no space around hyphens or before punctuation.

    Detokenized word pieces come back space-separated ("vingt - deux"); this
    makes them compare equal to the reference ("vingt-deux").
    """
    text = " ".join(text.lower().split())
    text = re.sub(r" ?([-'’]) ?", r"\1", text)
    return re.sub(r" ([,.!?;:)])", r"\1", text)


def chrf(hypotheses, references, max_order=6, beta=2.0):
    """Corpus chrF (Popovic, 2015) as in sacrebleu: character n-gram F-beta.

    Spaces are removed; for each order n = 1..6 the n-gram matches, hypothesis
    and reference counts are summed over the corpus, and the F-beta scores of
    the orders are averaged. In 0..100.
    """
    stats = np.zeros((max_order, 3))  # per order: matches, hypothesis, reference
    for hypothesis, reference in zip(hypotheses, references, strict=True):
        hypothesis, reference = hypothesis.replace(" ", ""), reference.replace(" ", "")
        for n in range(1, max_order + 1):
            h = Counter(hypothesis[i : i + n] for i in range(len(hypothesis) - n + 1))
            r = Counter(reference[i : i + n] for i in range(len(reference) - n + 1))
            stats[n - 1] += (sum((h & r).values()), sum(h.values()), sum(r.values()))
    matches, hypothesis_total, reference_total = stats.T
    precision = matches / np.maximum(hypothesis_total, 1)
    recall = matches / np.maximum(reference_total, 1)
    denominator = np.maximum(beta**2 * precision + recall, 1e-16)
    f_scores = (1 + beta**2) * precision * recall / denominator
    return 100 * float(np.mean(f_scores))


# ---------------------------------------------------------------- model


def build_model(args, source_vocabulary_size, target_vocabulary_size):
    """Functional encoder-decoder: `[source ids, decoder ids] -> logits`."""
    source = keras.Input(shape=(None,), dtype="int32", name="source")
    decoder_input = keras.Input(shape=(None,), dtype="int32", name="decoder_input")
    blocks = dict(
        intermediate_dim=args.intermediate_dim,
        num_heads=args.num_heads,
        dropout=args.dropout,
    )

    x = keras_attn.SinusoidalEmbedding(
        embedding_dim=args.embedding_dim,
        vocabulary_size=source_vocabulary_size,
        mask_zero=True,  # Id 0 is padding: a Keras mask flows to every block.
        name="source_embedding",
    )(source)
    for i in range(args.num_layers):
        x = keras_attn.TransformerEncoder(**blocks, name=f"encoder_{i}")(x)

    y = keras_attn.SinusoidalEmbedding(
        embedding_dim=args.embedding_dim,
        vocabulary_size=target_vocabulary_size,
        mask_zero=True,
        name="target_embedding",
    )(decoder_input)
    for i in range(args.num_layers):
        # Causal self-attention, then cross-attention into the encoder output.
        y = keras_attn.TransformerDecoder(**blocks, name=f"decoder_{i}")(y, x)
    logits = keras.layers.Dense(target_vocabulary_size, name="logits")(y)
    return keras.Model([source, decoder_input], logits, name="translator")


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
        # Weighted by `fit`'s sample weights: the accuracy over real tokens.
        weighted_metrics=[
            keras.metrics.SparseCategoricalAccuracy(name="token_accuracy")
        ],
    )


# ---------------------------------------------------------------- decoding


def translate(model, source, target_length, batch_size, progress=None):
    """Greedy, KV-cached decoding of `source` ids: `(n, target_length)` ids.

    The decoder-side input is a column of start tokens; `generate` runs the
    encoder once per batch and stops a batch when every row has produced
    [END] (the rest of a finished row is padding). `progress(tokens)` is
    called with each batch's output.
    """
    outputs = []
    for begin in range(0, len(source), batch_size):
        batch = source[begin : begin + batch_size]
        start = np.full((len(batch), 1), START, "int32")
        tokens = generate(
            model,
            [batch, start],
            max_length=target_length,
            end_token_id=END,
            pad_token_id=PAD,
        )
        outputs.append(tokens)
        if progress is not None:
            progress(tokens)
    return np.concatenate(outputs)


def evaluate(model, tokenizer, source, references, target_length, batch_size):
    """Exact match and chrF of greedy translations against `references`."""
    references = [normalize(text) for text in references]
    hypotheses, started = [], time.perf_counter()

    def progress(tokens):
        hypotheses.extend(detokenize(tokenizer, row) for row in tokens)
        done = len(hypotheses)
        right = [h == r for h, r in zip(hypotheses, references[:done], strict=True)]
        exact = np.mean(right)
        print(
            f"  translated {done}/{len(source)} held-out sentences, exact match "
            f"so far {100 * exact:.1f}% ({time.perf_counter() - started:.1f} s)",
            flush=True,
        )

    translate(model, source, target_length, batch_size, progress)
    exact = np.mean([h == r for h, r in zip(hypotheses, references, strict=True)])
    return float(exact), chrf(hypotheses, references), hypotheses


# ---------------------------------------------------------------- attention


def blocks(model, kind):
    """The model's layers of type `kind`, in the order they are applied."""
    return [layer for layer in model.layers if isinstance(layer, kind)]


def cross_attention_scores(model, source, decoder_input):
    """Cross-attention weights of the last decoder block, by calling the layers.

    Runs the trained layers of `model` one by one (eagerly, explicit padding
    masks), the last `TransformerDecoder` with `return_attention_scores=True`,
    which then returns `(outputs, self_scores, cross_scores)`. Returns the
    cross scores as numpy `(batch, heads, target_length, source_length)`.

    (A second functional model on the same layers would be the other way, but
    Keras 3.15 cannot build one on an output that only the second call of a
    layer returns: the attention scores here.)
    """
    source_mask, decoder_mask = source != PAD, decoder_input != PAD
    x = model.get_layer("source_embedding")(source)
    for encoder in blocks(model, keras_attn.TransformerEncoder):
        x = encoder(x, padding_mask=source_mask)
    y = model.get_layer("target_embedding")(decoder_input)
    for decoder in blocks(model, keras_attn.TransformerDecoder):
        outputs = decoder(
            y,
            x,
            decoder_padding_mask=decoder_mask,
            encoder_padding_mask=source_mask,
            return_attention_scores=True,
        )
        y, cross_scores = outputs[0], outputs[2]
    return keras.ops.convert_to_numpy(cross_scores)


def plot_cross_attention(model, source_tokenizer, target_tokenizer, source, output,
                         path):  # fmt: skip
    """Save a heatmap of the sharpest cross-attention head for one sentence.

    `source` `(source_length,)` ids; `output` the ids the model produced, from
    the start token on. Row i is the decoder position that produced the i-th
    French word piece.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    produced = [int(i) for i in output[1:] if i != PAD]
    produced = produced[: produced.index(END) + 1] if END in produced else produced
    decoder_input = np.array([[START, *produced[:-1]]], "int32")
    source_ids = [int(i) for i in source if i != PAD]
    source = np.array([source_ids], "int32")
    scores = cross_attention_scores(model, source, decoder_input)[0]  # (H, T, S)
    head = int(np.argmax(scores.max(axis=-1).mean(axis=-1)))  # most focused head
    rows = [target_tokenizer.id_to_token(i) for i in produced]
    columns = [source_tokenizer.id_to_token(i) for i in source_ids]

    figure, axes = plt.subplots(
        figsize=(2.5 + 0.45 * len(columns), 2.0 + 0.38 * len(rows))
    )
    image = axes.imshow(scores[head], cmap="viridis", vmin=0.0, vmax=1.0)
    axes.set_xticks(range(len(columns)), columns, rotation=60, ha="right")
    axes.set_yticks(range(len(rows)), rows)
    axes.set_xlabel("English word piece (source, attended to)")
    axes.set_ylabel("French word piece being produced")
    axes.set_title(f"Cross-attention weights, last decoder block, head {head}")
    figure.colorbar(image, ax=axes, fraction=0.04, pad=0.03, label="weight")
    figure.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(figure)
    return head


# ---------------------------------------------------------------- main


def prepare(args, rng):
    """Text pairs, tokenizers and padded id arrays, in a namespace."""
    train_pairs, test_pairs = load_data(args, rng)
    data = argparse.Namespace()
    data.train_source = [source for source, _ in train_pairs]
    data.train_target = [target for _, target in train_pairs]
    data.test_source = [source for source, _ in test_pairs]
    data.test_target = [target for _, target in test_pairs]
    print(f"{len(train_pairs)} training pairs, {len(test_pairs)} held out, e.g.")
    for source_text, target_text in train_pairs[:3]:
        print(f"  {source_text}  ->  {target_text}")

    data.source_tokenizer, data.target_tokenizer = (
        make_tokenizer(texts, args.vocabulary_size, os.path.join(args.output, file))
        for texts, file in (
            (data.train_source, "source_vocabulary.txt"),
            (data.train_target, "target_vocabulary.txt"),
        )
    )
    source_ids = token_lists(data.source_tokenizer, data.train_source)
    target_ids = token_lists(data.target_tokenizer, data.train_target)
    if args.data is not None:  # Keep training batches a sensible size.
        kept = [
            i
            for i, (s, t) in enumerate(zip(source_ids, target_ids, strict=True))
            if len(s) <= args.max_tokens and len(t) < args.max_tokens
        ]
        source_ids = [source_ids[i] for i in kept]
        target_ids = [target_ids[i] for i in kept]
    pieces = [data.target_tokenizer.id_to_token(i) for i in target_ids[0]]
    print(
        f"vocabularies: {data.source_tokenizer.vocabulary_size()} source and "
        f"{data.target_tokenizer.vocabulary_size()} target word pieces; e.g. "
        f"{data.train_target[0]!r} -> {pieces}"
    )

    test_ids = token_lists(data.source_tokenizer, data.test_source)
    source_length = max(len(row) for row in source_ids + test_ids)
    target_length = max(len(row) for row in target_ids) + 1  # [START] or [END]
    data.decode_length = target_length + 2  # Room for a longer held-out sentence.
    inputs, labels = encode(source_ids, target_ids, source_length, target_length)
    # Whole batches only: a smaller last batch would be compiled once more.
    whole = len(labels) // args.batch_size * args.batch_size or len(labels)
    data.train_inputs, data.train_labels = [x[:whole] for x in inputs], labels[:whole]
    data.test_inputs = pad(test_ids, source_length)
    return data


def train(args, data):
    model = build_model(
        args,
        data.source_tokenizer.vocabulary_size(),
        data.target_tokenizer.vocabulary_size(),
    )
    steps = args.epochs * -(-len(data.train_labels) // args.batch_size)
    compile_model(model, args, steps)
    model.summary()
    started = time.perf_counter()
    model.fit(
        data.train_inputs,
        data.train_labels,
        sample_weight=(data.train_labels != PAD).astype("float32"),
        batch_size=args.batch_size,
        epochs=args.epochs,
        verbose=console.fit_verbose(),
    )
    print(f"trained in {time.perf_counter() - started:.0f} s")
    return model


def save_and_reload(model, path, inputs):
    """Save as `.keras`, load back, and compare the two models' logits."""
    model.save(path)
    restored = keras.models.load_model(path)  # keras_attn layers are registered.
    check = [inputs[:8], np.full((len(inputs[:8]), 1), START, "int32")]
    difference = np.max(
        np.abs(model.predict_on_batch(check) - restored.predict_on_batch(check))
    )
    print(f"saved {path}; reloaded, max |logit difference| {difference:.2g}")
    return restored


def quantized_share(model, float_parameters):
    """The share of the float model's parameters that quantization converted
    to integers: those no longer stored as floats (quantization scales and zero
    points, which it adds, do not count)."""
    added = ("_scale", "_zero", "g_idx")
    still_float = sum(
        int(np.prod(w.shape))
        for w in model.weights
        if "float" in keras.backend.standardize_dtype(w.dtype)
        and not w.path.endswith(added)
    )
    return 1 - still_float / float_parameters


def quantize_and_evaluate(model, data, args):
    """`model.quantize(args.quantize)`, then the held-out exact match, and a
    `.keras` round trip of the quantized model."""
    float_parameters = model.count_params()
    model.quantize(args.quantize)
    share = quantized_share(model, float_parameters)
    print(
        f"quantized to {args.quantize}: {100 * share:.1f}% of the "
        f"{float_parameters:,} parameters converted"
    )
    exact, chrf_score, _ = evaluate(
        model,
        data.target_tokenizer,
        data.test_inputs,
        data.test_target,
        data.decode_length,
        args.decode_batch_size,
    )
    path = os.path.join(args.output, f"translate_numbers_{args.quantize}.keras")
    save_and_reload(model, path, data.test_inputs)
    print(
        f"{args.quantize} held-out exact match: {100 * exact:.1f}%, "
        f"chrF {chrf_score:.1f}"
    )


def show_translations(model, data, count):
    """Translate the first held-out sentences; the output ids of each."""
    tokens = translate(model, data.test_inputs[:count], data.decode_length, count)
    print("translations by the reloaded model (held-out sentences):")
    for row in range(len(tokens)):
        output = detokenize(data.target_tokenizer, tokens[row])
        mark = "ok" if output == normalize(data.test_target[row]) else "WRONG"
        print(f"  input:     {data.test_source[row]}")
        print(f"  reference: {data.test_target[row]}")
        print(f"  output:    {output}  [{mark}]")
    return tokens


def main():
    args = parse_args()
    keras.utils.set_random_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    print(f"keras {keras.__version__}, backend {keras.backend.backend()}")
    os.makedirs(args.output, exist_ok=True)
    data = prepare(args, rng)
    model = train(args, data)

    print("greedy decoding of the held-out set (cached, batched):")
    exact, chrf_score, _ = evaluate(
        model,
        data.target_tokenizer,
        data.test_inputs,
        data.test_target,
        data.decode_length,
        args.decode_batch_size,
    )
    print(f"held-out chrF: {chrf_score:.1f}")

    path = os.path.join(args.output, "translate_numbers.keras")
    restored = save_and_reload(model, path, data.test_inputs)
    tokens = show_translations(restored, data, count=min(6, len(data.test_inputs)))

    # Show French's base-20 counting if an example has it ("quatre-vingt").
    row = next(
        (i for i in range(len(tokens)) if "quatre-vingt" in data.test_target[i]), 0
    )
    picture = os.path.join(args.output, "cross_attention.png")
    head = plot_cross_attention(
        restored,
        data.source_tokenizer,
        data.target_tokenizer,
        data.test_inputs[row],
        tokens[row],
        picture,
    )
    print(f"cross-attention of head {head} for {data.test_source[row]!r}: {picture}")
    if args.quantize:
        quantize_and_evaluate(restored, data, args)
    print(f"held-out exact match: {100 * exact:.1f}% (n={len(data.test_inputs)})")


if __name__ == "__main__":
    main()
