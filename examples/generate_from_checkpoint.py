"""Text from a Hugging Face checkpoint folder, generated on any Keras backend.

Nothing here downloads: fetch a folder with the hub's own tool first, e.g.

    hf download Qwen/Qwen3-0.6B --include "*.json" "*.safetensors" \\
        --local-dir checkpoints/qwen3-0.6b
    KERAS_BACKEND=jax python examples/generate_from_checkpoint.py \\
        checkpoints/qwen3-0.6b --prompt "The capital of France is"

The folder's `config.json` and safetensors weights become a keras_attn model
(`keras_attn.models.from_hugging_face(folder, dtype)`: GPT-2, Llama, Mistral,
Qwen2, Qwen3, Gemma 1/2/3, Phi-3, SmolLM3); its `tokenizer.json` turns the
prompts into ids and the ids back into text (`load_tokenizer(folder)`, which
adds a BOS where the model's own tokenizer does); cached decoding
(`keras_attn.generation.generate`) continues each prompt until the folder's
end token or `--new-tokens`, greedily unless `--method sample`. Chat models
want their chat template applied to the prompt first: see the model card.

Each prompt is printed with its continuation; the texts are written to
`--output`/generated.txt. The last line printed is
`generated N new tokens for P prompt(s) in S s on <backend>`.
"""

import argparse
import os
import time

import console  # noqa: F401  First: before anything imports TensorFlow.
import keras
import numpy as np

import keras_attn
from keras_attn.generation import generate


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", help="a checkpoint folder with tokenizer.json")
    parser.add_argument(
        "--prompt",
        action="append",
        help="a prompt (repeat for a batch); default: one short sentence",
    )
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument(
        "--dtype",
        default=None,
        help='e.g. "bfloat16"; default: Keras\' global dtype policy',
    )
    parser.add_argument("--method", choices=("greedy", "sample"), default="greedy")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-p", type=float, default=0.9)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default="outputs/generate_from_checkpoint")
    return parser.parse_args()


def special_ids(tokenizer):
    """`(end ids, padding id)` as the folder declares them; without a padding
    id, the first end id pads (as transformers' `generate` does), else 0."""
    ends = tokenizer.eos_token_id
    ends = [] if ends is None else np.atleast_1d(ends).tolist()
    pad = tokenizer.pad_token_id
    return ends, pad if pad is not None else (ends[0] if ends else 0)


def continuation(tokenizer, prompt_ids, row, ends, new_tokens):
    """`(text, count)`: the text and the number of the new tokens of `row` (the
    prompt's ids, then at most `new_tokens` new ones, then padding) up to its
    first end token. The whole row is decoded and the prompt's text cut off,
    so that a first piece that starts with a space keeps it (a decoder may
    strip a text's first space)."""
    new = row[len(prompt_ids) :][:new_tokens].tolist()
    new = new[: next((i for i, t in enumerate(new) if t in ends), len(new))]
    prefix = tokenizer.decode(prompt_ids)
    text = tokenizer.decode([*prompt_ids, *new])
    if not text.startswith(prefix):
        text = prefix + tokenizer.decode(new)
    return text[len(prefix) :], len(new)


def main():
    args = parse_args()
    backend = keras.backend.backend()
    print(f"keras {keras.__version__}, backend {backend}")
    start = time.perf_counter()
    model = keras_attn.models.from_hugging_face(args.folder, dtype=args.dtype)
    tokenizer = keras_attn.models.load_tokenizer(args.folder)
    # The layers' policy (a functional Model keeps Keras' global one).
    policy = model.get_layer("token_embedding").dtype_policy
    print(
        f"loaded {args.folder}: {model.count_params():,} weights "
        f"({policy.compute_dtype}) in {time.perf_counter() - start:.1f} s;"
        f" {tokenizer}"
    )

    prompts = args.prompt or ["The quick brown fox"]
    ids = tokenizer.encode(prompts)
    if not all(ids):
        raise SystemExit(f"a prompt encodes to no tokens: {prompts}")
    ends, pad = special_ids(tokenizer)
    start = time.perf_counter()
    sampling = dict(temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    tokens = generate(
        model,
        ids,  # rows of different lengths: `generate` pads them
        max_new_tokens=args.new_tokens,
        method=args.method,
        end_token_id=ends or None,
        pad_token_id=pad,
        **(sampling if args.method == "sample" else {}),
    )
    seconds = time.perf_counter() - start

    texts, count = [], 0
    for prompt, prompt_ids, row in zip(prompts, ids, tokens, strict=True):
        text, new = continuation(tokenizer, prompt_ids, row, ends, args.new_tokens)
        texts.append(prompt + text)
        count += new
        print(f"{prompt!r} -> {text!r}")
    os.makedirs(args.output, exist_ok=True)
    with open(os.path.join(args.output, "generated.txt"), "w", encoding="utf-8") as f:
        f.write("\n\n".join(texts) + "\n")
    print(
        f"generated {count} new tokens for {len(prompts)} prompt(s) in "
        f"{seconds:.1f} s on {backend}"
    )


if __name__ == "__main__":
    main()
