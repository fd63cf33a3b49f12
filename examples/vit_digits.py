"""A Vision Transformer classifies scikit-learn's 8x8 handwritten digits.

Runs on any Keras 3 backend in a minute or two on a laptop CPU, no download
(the 1,797 digits ship with scikit-learn):

    KERAS_BACKEND=jax python examples/vit_digits.py

Each 8x8 image is cut into 2x2 patches: 16 tokens of 4 pixels. A `Dense` layer
projects each patch to the model width, `SinusoidalEmbedding` (without a
vocabulary: it adds the position encoding to float inputs) says where each patch
sits, `TransformerEncoder` blocks let every patch attend to every other, and the
mean over the patches goes to a softmax over the 10 classes. The script holds
out 20% of the digits, trains with `model.fit` on the rest plus 8 copies of
each training image shifted by one pixel (1,437 images are few for a
Transformer), evaluates on the held-out digits, saves the model as `.keras` and
checks that the reloaded model gives the same predictions. The last line
printed is `test accuracy: XX.X%`.
"""

import argparse
import os
import time

import console  # First: before anything imports TensorFlow.
import keras
import numpy as np
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import keras_attn


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--output", default="outputs/vit_digits")
    parser.add_argument(
        "--train-size", type=int, help="Use only this many training images."
    )
    parser.add_argument("--test-fraction", type=float, default=0.2)
    parser.add_argument("--patch-size", type=int, default=2, choices=(1, 2, 4, 8))
    parser.add_argument("--embedding-dim", type=int, default=64)
    parser.add_argument("--num-layers", type=int, default=3)
    parser.add_argument("--num-heads", type=int, default=4)
    parser.add_argument("--intermediate-dim", type=int, default=128)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--learning-rate", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=42)
    return parser.parse_args()


def patches(images, size):
    """`(n, 8, 8)` images -> `(n, tokens, size * size)` patches, row by row."""
    n, height, width = images.shape
    grid = images.reshape(n, height // size, size, width // size, size)
    grid = grid.transpose(0, 1, 3, 2, 4)  # (n, rows, columns, size, size)
    return grid.reshape(n, (height // size) * (width // size), size * size)


def with_shifts(images, labels):
    """The images and 8 copies moved by one pixel (across and diagonally).

    A cheap augmentation (the digits are not all centred alike): 9x the data.
    """
    padded = np.pad(images, [(0, 0), (1, 1), (1, 1)])
    shifted = [
        padded[:, 1 + dy : 9 + dy, 1 + dx : 9 + dx]
        for dy in (-1, 0, 1)
        for dx in (-1, 0, 1)
    ]
    return np.concatenate(shifted), np.tile(labels, len(shifted))


def build_model(args, tokens, patch_pixels, classes=10):
    """Functional ViT: patches -> Dense -> positions -> encoders -> mean -> softmax."""
    inputs = keras.Input(shape=(tokens, patch_pixels), name="patches")
    x = keras.layers.Dense(args.embedding_dim, name="patch_projection")(inputs)
    x = keras_attn.SinusoidalEmbedding(name="positions")(x)  # float inputs
    for i in range(args.num_layers):
        x = keras_attn.TransformerEncoder(
            intermediate_dim=args.intermediate_dim,
            num_heads=args.num_heads,
            dropout=args.dropout,
            normalize_first=True,  # Pre-norm, as in ViT.
            name=f"encoder_{i}",
        )(x)
    x = keras.layers.LayerNormalization(name="final_norm")(x)
    x = keras.layers.GlobalAveragePooling1D(name="mean_over_patches")(x)
    outputs = keras.layers.Dense(classes, activation="softmax", name="classes")(x)
    return keras.Model(inputs, outputs, name="vit_digits")


def load_data(args):
    """`(x_train, y_train, x_test, y_test)`: patches and labels, train shifted."""
    digits = load_digits()
    images = (digits.images / 16.0).astype("float32")  # Pixels are 0..16.
    x_train, x_test, y_train, y_test = train_test_split(
        images,
        digits.target.astype("int32"),
        test_size=args.test_fraction,
        stratify=digits.target,
        random_state=args.seed,
    )
    x_train, y_train = x_train[: args.train_size], y_train[: args.train_size]
    print(f"{len(x_train)} training and {len(x_test)} test images")
    x_train, y_train = with_shifts(x_train, y_train)
    x_train, x_test = (patches(x, args.patch_size) for x in (x_train, x_test))
    print(
        f"with shifted copies, {len(x_train)} training images, each "
        f"{x_train.shape[1]} patches of {x_train.shape[2]} pixels"
    )
    return x_train, y_train, x_test, y_test


def compile_model(model, args, steps):
    warmup = steps // 10
    schedule = keras.optimizers.schedules.CosineDecay(
        0.0,
        decay_steps=max(1, steps - warmup),
        warmup_target=args.learning_rate,
        warmup_steps=warmup,
    )
    model.compile(
        optimizer=keras.optimizers.AdamW(schedule, weight_decay=0.05),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )


def main():
    args = parse_args()
    keras.utils.set_random_seed(args.seed)
    print(f"keras {keras.__version__}, backend {keras.backend.backend()}")
    x_train, y_train, x_test, y_test = load_data(args)

    model = build_model(args, x_train.shape[1], x_train.shape[2])
    compile_model(model, args, args.epochs * -(-len(x_train) // args.batch_size))
    model.summary()
    started = time.perf_counter()
    model.fit(
        x_train,
        y_train,
        batch_size=args.batch_size,
        epochs=args.epochs,
        verbose=console.fit_verbose(),
    )
    print(f"trained in {time.perf_counter() - started:.0f} s")
    print(f"evaluating on the {len(x_test)} held-out digits:")
    _, accuracy = model.evaluate(x_test, y_test, verbose=2)  # one line

    os.makedirs(args.output, exist_ok=True)
    path = os.path.join(args.output, "vit_digits.keras")
    model.save(path)
    restored = keras.models.load_model(path)  # keras_attn layers are registered.
    predictions = restored.predict(x_test, verbose=0)
    difference = np.max(np.abs(predictions - model.predict(x_test, verbose=0)))
    print(f"saved {path}; reloaded, max |probability difference| {difference:.2g}")

    confusion = np.zeros((10, 10), "int32")
    np.add.at(confusion, (y_test, predictions.argmax(axis=-1)), 1)
    print("confusion matrix of the reloaded model (rows: true digit):")
    for digit, row in enumerate(confusion):
        print(f"  {digit}: " + " ".join(f"{count:3d}" for count in row))
    print(f"test accuracy: {100 * accuracy:.1f}%")


if __name__ == "__main__":
    main()
