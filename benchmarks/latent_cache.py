"""The cache of multi-head latent attention against a key/value cache of the
same heads: bytes per token that `generate` keeps, and time per new token.

Run once per backend, each in its own process, threads pinned:

    KERAS_BACKEND=jax OMP_NUM_THREADS=1 python benchmarks/latent_cache.py --save

`keras_attn.cache.LatentCache` (`MultiHeadLatentAttention`, DeepSeek-V2/V3)
keeps per token and layer the normalized latent and the shared rotated key,
`kv_lora_rank + qk_rope_head_dim` numbers; a `MultiHeadAttention` cache
keeps every head's key and value, `2 * heads * head_dim`. Two decoder
language models (`keras_attn.models.decoder_lm`), alike but for their
self-attention: DeepSeek-V3's attention shapes with 16 heads instead of 128
(`qk_nope_head_dim=128`, `qk_rope_head_dim=64`, `v_head_dim=128`,
`kv_lora_rank=512`, `q_lora_rank=192`) against 16 heads of 192 (keys as wide
as MLA's, values as wide as its keys: a cache stacks both), width 256, 2
pre-norm blocks, a 256-token vocabulary, float32, batch 1.

1. Memory (exact arithmetic, the target: at most 1/8): each decoder's cache
   as `generate` holds it, read at every step (`cache.nbytes / cache.length`,
   from a spy on the decoders' `decode_unchecked`), summed over the decoders;
   then DeepSeek-V3's own 128 heads and 61 layers in bfloat16, from the
   formulas.
2. Time per new token of greedy `generate` (`jit_compile` left to its
   default): (a call of N new tokens - a call of 1) / (N - 1), medians of
   interleaved calls after a warm-up call (`benchmarks/timing.py`). MLA's
   steps attend in the absorbed form (one key/value head of width 576 for
   every query head): on a CPU at short contexts its extra matrix products
   can cost more than the smaller cache saves; the cache's size is the
   point here, not the CPU time.

`--save` writes markdown to `benchmarks/results/latent_cache.md`. `--quick`
is a smoke run (fewer tokens, one timed call).
"""

import argparse
import os
import sys

import keras
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import keras_attn  # noqa: E402
from benchmarks.report import write_report  # noqa: E402
from benchmarks.run import versions  # noqa: E402
from benchmarks.timing import describe, time_calls  # noqa: E402
from keras_attn.generation import generate  # noqa: E402
from keras_attn.models import DecoderLMSpec, decoder_lm  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
HEADS, NOPE, ROPE, VALUE, LATENT, QUERY_LATENT = 16, 128, 64, 128, 512, 192
WIDTH, VOCAB, BLOCKS, PROMPT = 256, 256, 2, 8
# DeepSeek-V3 (config.json of deepseek-ai/DeepSeek-V3): the full model.
V3_HEADS, V3_LAYERS = 128, 61


def block(self_attention=None):
    arguments = dict(
        intermediate_dim=512,
        num_heads=HEADS,
        normalize_first=True,
        normalization="rms_norm",
        gated_feedforward=True,
        activation="silu",
    )
    if self_attention is None:
        return dict(arguments, key_dim=NOPE + ROPE, rope_max_wavelength=10000.0)
    return dict(arguments, self_attention=self_attention)


def models():
    """`{"MLA": model, "MHA": model}`, seeded."""
    keras.utils.set_random_seed(0)
    mla = keras.saving.serialize_keras_object(
        keras_attn.layers.MultiHeadLatentAttention(
            num_heads=HEADS,
            kv_lora_rank=LATENT,
            qk_nope_head_dim=NOPE,
            qk_rope_head_dim=ROPE,
            v_head_dim=VALUE,
            q_lora_rank=QUERY_LATENT,
        )
    )
    built = {}
    for name, attention in (("MLA", mla), ("MHA", None)):
        blocks = (block(attention),) * BLOCKS
        spec = DecoderLMSpec(vocabulary_size=VOCAB, hidden_dim=WIDTH, blocks=blocks)
        built[name] = decoder_lm(spec, name=name.lower())
    return built


def cache_bytes_per_token(model, new_tokens):
    """Bytes per token of the decoders' caches as `generate` holds them
    (each decoder's largest `nbytes / length` over the steps, summed)."""
    seen = {}
    decoders = [
        layer
        for layer in model.layers
        if isinstance(layer, keras_attn.TransformerDecoder)
    ]
    for decoder in decoders:

        def spy(x, cache, *args, _call=decoder.decode_unchecked, _name=decoder.name,
                **kwargs):  # fmt: skip
            seen[_name] = max(seen.get(_name, 0), cache.nbytes / cache.length)
            return _call(x, cache, *args, **kwargs)

        decoder.decode_unchecked = spy
    try:
        generate(model, prompt(), max_length=PROMPT + new_tokens, jit_compile=False)
    finally:
        for decoder in decoders:
            del decoder.decode_unchecked
    return sum(seen.values())


def prompt():
    return np.arange(1, PROMPT + 1, dtype="int32")[None]


def per_token_times(model, new_tokens, calls):
    """Seconds per new token: `(N new - 1 new) / (N - 1)`, medians."""
    timings = time_calls(
        {
            n: (lambda n=n: generate(model, prompt(), max_length=PROMPT + n))
            for n in (1, new_tokens)
        },
        calls,
    )
    return (timings[new_tokens].median - timings[1].median) / (new_tokens - 1)


def v3_bytes_per_token():
    """DeepSeek-V3's caches per token, bfloat16, every layer: `(latent,
    dense)`."""
    latent = (LATENT + ROPE) * V3_LAYERS * 2
    dense = 2 * V3_HEADS * (NOPE + ROPE) * V3_LAYERS * 2
    return latent, dense


def report(memory, times, args):
    backend = keras.config.backend()
    ratio = memory["MLA"] / memory["MHA"]
    latent, dense = v3_bytes_per_token()
    lines = [
        f"# Latent cache against a key/value cache ({backend})",
        "",
        f"{versions(backend)}. `python benchmarks/latent_cache.py"
        f"{' --quick' if args.quick else ''}`.",
        "",
        f"Models: width {WIDTH}, {BLOCKS} pre-norm blocks, {HEADS} heads, float32, "
        f"batch 1, a {PROMPT}-token prompt. MLA: kv_lora_rank {LATENT}, "
        f"qk_nope {NOPE}, qk_rope {ROPE}, v {VALUE}, q_lora_rank {QUERY_LATENT}; "
        f"MHA: key_dim {NOPE + ROPE}.",
        "",
        "| cache | bytes per token (all decoders) | ratio to MHA |",
        "|---|---|---|",
        f"| MLA `LatentCache` | {memory['MLA']:.0f} | {ratio:.4f} |",
        f"| MHA `DenseCache` | {memory['MHA']:.0f} | 1 |",
        "",
        f"Target: ratio at most 1/8 = 0.125: {'met' if ratio <= 1 / 8 else 'MISSED'}"
        f" ((512 + 64) / (2 * 16 * 192) = {(LATENT + ROPE) / (2 * HEADS * 192):.4f}).",
        "",
        f"DeepSeek-V3 ({V3_HEADS} heads, {V3_LAYERS} layers, bfloat16), per token: "
        f"latent {latent / 1024:.1f} KiB against {dense / 2**20:.2f} MiB for "
        f"every head's keys and values ({latent / dense:.4f}).",
        "",
        f"Time per new token of greedy `generate` ({args.new_tokens} new tokens; "
        f"{describe(args.calls)}):",
        "",
        "| model | ms per new token |",
        "|---|---|",
        *(f"| {name} | {seconds * 1e3:.2f} |" for name, seconds in times.items()),
        "",
    ]
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="A smoke run.")
    parser.add_argument("--save", action="store_true", help="Write the markdown.")
    parser.add_argument("--results", default=RESULTS, help="Folder of --save.")
    args = parser.parse_args(argv)
    args.new_tokens, args.calls = (4, 1) if args.quick else (32, 5)
    built = models()
    memory = {n: cache_bytes_per_token(m, args.new_tokens) for n, m in built.items()}
    times = {
        n: per_token_times(m, args.new_tokens, args.calls) for n, m in built.items()
    }
    text = report(memory, times, args)
    if args.save:
        return write_report(args.results, "latent_cache.md", text)
    print(text)
    return text


if __name__ == "__main__":
    main()
