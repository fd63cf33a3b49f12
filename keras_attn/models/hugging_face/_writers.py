"""Each family's `config.json` entries for a `DecoderLMSpec` (the inverse of
`_families`; `_save` reads each config back to prove it)."""

import math

from keras_attn.layers import TransformerDecoder
from keras_attn.models.hugging_face._families import FULL, SLIDING, activation_name

# Block entries that change no number of a forward pass.
NOT_MATHS = ("name", "trainable", "dtype", "kernel_initializer", "bias_initializer")
# The tokenizer's ids are not the model's to know: written as none (else
# transformers fills in its family defaults, which may lie outside a small
# vocabulary); `generation_config.json` and the tokenizer files carry them.
SPECIAL_IDS = {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}


def resolved(block, width):
    """A block's arguments that change its numbers, each resolved to the
    value it takes (`None` defaults filled in, linear scaling as a dict)."""
    layer = TransformerDecoder(**block)
    config = layer.get_config()
    for key in (*NOT_MATHS, "flash_attention"):
        config.pop(key)
    config["activation"] = getattr(layer.activation, "__name__", layer.activation)
    if config["rope_scaling_factor"] != 1.0:
        factor = config["rope_scaling_factor"]
        config.update(
            rope_scaling={"rope_type": "linear", "factor": factor},
            rope_scaling_factor=1.0,
        )
    for key in ("use_output_bias", "use_feedforward_bias"):
        if config[key] is None:
            config[key] = config["use_bias"]
    if not config["normalize_qk"]:
        config["qk_norm_epsilon"] = None
    elif config["qk_norm_epsilon"] is None:
        config["qk_norm_epsilon"] = config["layer_norm_epsilon"]
    config["num_key_value_heads"] = config["num_key_value_heads"] or config["num_heads"]
    config["key_dim"] = config["key_dim"] or width // config["num_heads"]
    return config


def _rope(block):
    scaling = dict(block["rope_scaling"] or {"rope_type": "default"})
    return {**scaling, "rope_theta": block["rope_max_wavelength"]}


def _first(blocks, condition, default):
    return next((b for b in blocks if condition(b)), default)


def _common(spec, blocks, activation_key="hidden_act"):
    first = blocks[0]
    with_rope = _first(blocks, lambda b: b["rope_max_wavelength"], first)
    return {
        "vocab_size": spec.vocabulary_size,
        "hidden_size": spec.hidden_dim,
        "intermediate_size": first["intermediate_dim"],
        "num_hidden_layers": len(blocks),
        "num_attention_heads": first["num_heads"],
        "num_key_value_heads": first["num_key_value_heads"],
        "head_dim": first["key_dim"],
        "rms_norm_eps": spec.layer_norm_epsilon,
        "tie_word_embeddings": spec.tie_weights,
        "attention_dropout": first["dropout"],
        **SPECIAL_IDS,
        activation_key: activation_name(first["activation"]),
        "rope_parameters": _rope(with_rope) if with_rope["rope_max_wavelength"] else {},
    }


def _windows(blocks, flag=None):
    """`layer_types` and `sliding_window` (and the family's switch)."""
    windows = {b["sliding_window"] for b in blocks} - {None}
    entries = {
        "layer_types": [SLIDING if b["sliding_window"] else FULL for b in blocks],
        "sliding_window": windows.pop() if len(windows) == 1 else None,
    }
    if flag:
        entries[flag] = bool(entries["sliding_window"])
    return entries


def llama(spec, blocks):
    first = blocks[0]
    return _common(spec, blocks) | {
        "attention_bias": first["use_bias"],
        "mlp_bias": first["use_feedforward_bias"],
    }


def mistral(spec, blocks):
    return _common(spec, blocks) | {
        "sliding_window": _windows(blocks)["sliding_window"]
    }


def qwen2(spec, blocks):
    return _common(spec, blocks) | _windows(blocks, "use_sliding_window")


def qwen3(spec, blocks):
    return qwen2(spec, blocks) | {"attention_bias": blocks[0]["use_bias"]}


def smollm3(spec, blocks):
    no_rope = [int(bool(b["rope_max_wavelength"])) for b in blocks]
    return (
        llama(spec, blocks)
        | _windows(blocks, "use_sliding_window")
        | {"no_rope_layers": no_rope}
    )


def phi3(spec, blocks):
    return (
        _common(spec, blocks)
        | {"sliding_window": _windows(blocks)["sliding_window"]}
        | {
            "resid_pdrop": blocks[0]["dropout"],
            "embd_pdrop": spec.dropout,
        }
    )


def gemma(spec, blocks):
    return _common(spec, blocks) | {"attention_bias": blocks[0]["use_bias"]}


def gemma2(spec, blocks):
    first = blocks[0]
    scale = first["attention_scale"] or first["key_dim"] ** -0.5
    scalar = round(scale**-2)
    if not math.isclose(scale**-2, scalar, rel_tol=1e-9):  # transformers: an int
        raise ValueError(f"attention_scale {scale} is not 1/sqrt of an integer")
    config = _common(spec, blocks, "hidden_activation") | _windows(blocks)
    return config | {
        "attention_bias": first["use_bias"],
        "query_pre_attn_scalar": scalar,
        "attn_logit_softcapping": first["logit_soft_cap"],
        "final_logit_softcapping": spec.final_logit_soft_cap,
    }


def gemma3_text(spec, blocks):
    full = _first(blocks, lambda b: b["sliding_window"] is None, blocks[0])
    local = _first(blocks, lambda b: b["sliding_window"] is not None, blocks[0])
    ropes = {FULL: _rope(full), SLIDING: _rope(local)}
    return gemma2(spec, blocks) | {"rope_parameters": ropes}


def gpt2(spec, blocks):
    first = blocks[0]
    return {
        "vocab_size": spec.vocabulary_size,
        "n_embd": spec.hidden_dim,
        "n_layer": len(blocks),
        "n_head": first["num_heads"],
        "n_inner": first["intermediate_dim"],
        "n_positions": spec.positions,
        "layer_norm_epsilon": first["layer_norm_epsilon"],
        "activation_function": activation_name(first["activation"], "gelu_new"),
        "attn_pdrop": first["dropout"],
        "resid_pdrop": first["dropout"],
        "embd_pdrop": spec.dropout,
        "tie_word_embeddings": spec.tie_weights,
        **SPECIAL_IDS,
    }


# Each family's transformers class and config writer.
WRITERS = {
    "gpt2": ("GPT2LMHeadModel", gpt2),
    "llama": ("LlamaForCausalLM", llama),
    "mistral": ("MistralForCausalLM", mistral),
    "qwen2": ("Qwen2ForCausalLM", qwen2),
    "qwen3": ("Qwen3ForCausalLM", qwen3),
    "phi3": ("Phi3ForCausalLM", phi3),
    "smollm3": ("SmolLM3ForCausalLM", smollm3),
    "gemma": ("GemmaForCausalLM", gemma),
    "gemma2": ("Gemma2ForCausalLM", gemma2),
    "gemma3_text": ("Gemma3ForCausalLM", gemma3_text),
}
