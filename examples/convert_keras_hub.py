"""A keras-hub Llama 3.1 converted, LoRA-tuned, reloaded on another backend.

With internet access, the conversion is two lines:

    causal_lm = keras_hub.models.Llama3CausalLM.from_preset("llama3.2_1b")
    model = keras_attn.models.from_keras_hub(causal_lm)

This program downloads nothing: it builds a small `Llama3Backbone` from a
config (Llama 3.1's RoPE frequency adjustment included) with random weights,
and then

1. converts it and prints the largest difference from keras-hub's logits;
2. fine-tunes LoRA adapters (`enable_lora` on every block: the attention
   and feed-forward projections) for a few steps on a made-up task,
   counting upward (token `t` is followed by `t + 1`), and prints the loss
   before and after;
3. saves the model as `.keras`, reloads it in a fresh process on another
   backend (`--other-backend`), which decodes the same prompts greedily with
   `keras_attn.generation.generate`, and compares those tokens (and the
   logits of a prompt) with this process's.

    KERAS_BACKEND=jax python examples/convert_keras_hub.py

The last line printed is
`reloaded on <backend>: same logits (to 1e-4) and greedy tokens: yes`.
"""

import argparse
import json
import os
import subprocess
import sys

import console  # First: before anything imports TensorFlow.
import keras
import keras_hub
import numpy as np

import keras_attn
from keras_attn.generation import generate

PROMPTS = [[5, 6, 7], [40, 41, 42]]


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default="outputs/convert_keras_hub")
    parser.add_argument("--vocabulary-size", type=int, default=128)
    parser.add_argument("--hidden-dim", type=int, default=64)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--lora-rank", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--other-backend", default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--generate-from", default=None, help=argparse.SUPPRESS
    )  # the reloading process: print greedy tokens of this `.keras` file
    return parser.parse_args()


def hub_llama(args):
    """A small keras-hub Llama 3.1 backbone, weights drawn from its config."""
    return keras_hub.models.Llama3Backbone(
        vocabulary_size=args.vocabulary_size,
        num_layers=args.num_layers,
        num_query_heads=4,
        num_key_value_heads=2,
        hidden_dim=args.hidden_dim,
        intermediate_dim=2 * args.hidden_dim,
        rope_frequency_adjustment_factor=8.0,
        rope_low_freq_factor=1.0,
        rope_high_freq_factor=4.0,
        rope_pretraining_sequence_length=64,
    )


def largest_difference(model, backbone, token_ids):
    hidden = backbone({"token_ids": token_ids, "padding_mask": np.ones_like(token_ids)})
    theirs = keras.ops.convert_to_numpy(backbone.token_embedding(hidden, reverse=True))
    ours = keras.ops.convert_to_numpy(model(token_ids))
    return float(np.abs(ours - theirs).max()), float(np.abs(theirs).max())


def counting_batches(args, rng, batch=16, length=16):
    """Rows counting upward from a random start (mod the vocabulary, from 1)."""
    starts = rng.integers(1, args.vocabulary_size, (batch * args.steps, 1))
    rows = (starts + np.arange(length + 1)) % (args.vocabulary_size - 1) + 1
    return rows[:, :-1].astype("int32"), rows[:, 1:].astype("int32")


def fine_tune(model, args, rng):
    """LoRA on every block; the rest frozen. (Not on the token table: Keras
    3.15 cannot rebuild a `ReversibleEmbedding` with a head matrix of its own
    and a LoRA rank when it loads the model.)"""
    for layer in model.layers:
        if isinstance(layer, keras_attn.TransformerDecoder):
            layer.enable_lora(args.lora_rank)
        else:
            layer.trainable = False
    model.compile(
        optimizer=keras.optimizers.Adam(1e-2),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    inputs, labels = counting_batches(args, rng)
    before = model.evaluate(inputs[:64], labels[:64], verbose=0)
    model.fit(inputs, labels, batch_size=16, epochs=1, verbose=console.fit_verbose())
    after = model.evaluate(inputs[:64], labels[:64], verbose=0)
    trainable = sum(int(np.prod(w.shape)) for w in model.trainable_weights)
    print(
        f"LoRA ({trainable} trainable weights), {args.steps} steps: "
        f"loss {before:.3f} -> {after:.3f}"
    )


def decoded(model, args):
    """`{"tokens": greedy tokens of PROMPTS, "logits": the logits of the
    first prompt}`, as JSON-ready lists."""
    tokens = generate(model, PROMPTS, max_new_tokens=args.new_tokens)
    logits = keras.ops.convert_to_numpy(model(np.array(PROMPTS[:1], "int32")))
    return {"tokens": np.asarray(tokens).tolist(), "logits": logits.tolist()}


def on_other_backend(path, args):
    """`decoded` for the `.keras` file, reloaded in a fresh process on the
    other backend."""
    env = {**os.environ, "KERAS_BACKEND": args.other_backend}
    command = [sys.executable, os.path.abspath(__file__), "--generate-from", path]
    command += ["--new-tokens", str(args.new_tokens)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode:
        sys.exit(f"the {args.other_backend} process failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main():
    args = parse_args()
    if args.generate_from:  # the reloading process
        print(json.dumps(decoded(keras.models.load_model(args.generate_from), args)))
        return
    backend = keras.backend.backend()
    args.other_backend = args.other_backend or (
        "torch" if backend != "torch" else "jax"
    )
    keras.utils.set_random_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    print(
        f"keras {keras.__version__}, keras-hub {keras_hub.__version__}, "
        f"backend {backend}"
    )

    backbone = hub_llama(args)
    model = keras_attn.models.from_keras_hub(backbone)
    token_ids = rng.integers(1, args.vocabulary_size, (2, 12)).astype("int32")
    difference, scale = largest_difference(model, backbone, token_ids)
    print(
        f"converted {type(backbone).__name__}: logits differ by at most "
        f"{difference:.1e} (of {scale:.2f})"
    )

    fine_tune(model, args, rng)
    os.makedirs(args.output, exist_ok=True)
    path = os.path.join(args.output, "llama3_lora.keras")
    model.save(path)
    print(f"saved {path}")

    ours = decoded(model, args)
    for prompt, row in zip(PROMPTS, ours["tokens"], strict=True):
        print(f"  {prompt} -> {row[len(prompt) :]}")
    theirs = on_other_backend(path, args)
    logits = np.array(ours["logits"])
    difference = np.abs(np.array(theirs["logits"]) - logits).max()
    print(f"reloaded on {args.other_backend}: logits differ by {difference:.1e}")
    close = difference <= 1e-4 * np.abs(logits).max()
    same = theirs["tokens"] == ours["tokens"] and close
    print(
        f"reloaded on {args.other_backend}: same logits (to 1e-4) and greedy "
        f"tokens: {'yes' if same else 'no'}"
    )


if __name__ == "__main__":
    main()
