"""keras-hub's language models as keras_attn models: each family's config
read into a `DecoderLMSpec`, its weights copied by name."""

import warnings

import keras
import numpy as np

from keras_attn.layers._machinery import quantized_layers
from keras_attn.layers.mixture_of_experts import state_paths
from keras_attn.models._config_entries import ConfigEntries
from keras_attn.models._hub_parts import (
    LLAMA_BLOCK,
    QKVO,
    QWEN3_BLOCK,
    block_names,
    dtype_of,
    llama_block,
    llama_like,
    pairs,
    qwen3_attention,
)
from keras_attn.models._sparse_converters import SPARSE_FAMILIES
from keras_attn.models.activations import gelu_approximate
from keras_attn.models.decoder_lm import DecoderLMSpec, decoder_lm

# Config entries every Keras model has, which say nothing about the maths.
_LAYER_ENTRIES = ("name", "trainable", "dtype")


def _same(*paths):
    return {path: path for path in paths}


GPT2_BLOCK = _same(
    *(f"self_attention/{p}/{w}" for p in QKVO for w in ("kernel", "bias")),
    *(
        f"{n}_layer_norm/{w}"
        for n in ("self_attention", "feedforward")
        for w in ("gamma", "beta")
    ),
    *(
        f"feedforward_{p}_dense/{w}"
        for p in ("intermediate", "output")
        for w in ("kernel", "bias")
    ),
)
GEMMA_BLOCK = {
    **{f"self_attention/{p}/kernel": f"attention/{p}/kernel" for p in QKVO},
    "self_attention_layer_norm/scale": "pre_attention_norm/scale",
    "feedforward_gate_dense/kernel": "ffw_gating/kernel",
    "feedforward_intermediate_dense/kernel": "ffw_gating_2/kernel",
    "feedforward_output_dense/kernel": "ffw_linear/kernel",
    "feedforward_layer_norm/scale": "pre_ffw_norm/scale",
}
GEMMA_OUTPUT_NORMS = {
    "self_attention_output_norm/scale": "post_attention_norm/scale",
    "feedforward_output_norm/scale": "post_ffw_norm/scale",
}


def from_keras_hub(model):
    """A keras-hub language model as a keras_attn model with the same weights.

    Takes a keras-hub causal LM (`keras_hub.models.Llama3CausalLM`, ...) or
    its backbone, of a family below, and returns a functional `keras.Model`
    (`keras_attn.models.decoder_lm`): int token ids `(batch, length)` to
    logits `(batch, length, vocabulary_size)`, the causal LM's logits (the
    token table reversed, Gemma 2's final soft-cap included), which
    `keras_attn.generation.generate` decodes with key/value caches. The
    configuration is read from the keras-hub object, the weights are copied
    (every one of them, each once), and the model has the keras-hub model's
    dtype policy. Preprocessing (the tokenizer) stays keras-hub's; the model
    takes no padding mask: `generate` pads prompts itself. Dropout (training
    only) keeps keras-hub's rate at keras_attn's places in the blocks, which
    are not keras-hub's.

    Families: GPT-2 (`GPT2Backbone`), LLaMA and Llama 3 (`LlamaBackbone`,
    `Llama3Backbone`, with Llama 3.1's frequency adjustment), Mistral
    (`MistralBackbone`), Gemma and Gemma 2 (`GemmaBackbone`, with its
    post-sublayer norms, soft-caps and alternating sliding windows), Qwen3
    (`Qwen3Backbone`), and the mixtures of experts (their feed-forward
    networks `keras_attn.layers.MixtureOfExperts`): Mixtral
    (`MixtralBackbone`), Qwen3-MoE (`Qwen3MoeBackbone`, dense blocks where
    keras-hub puts them) and gpt-oss (`GptOssBackbone`, with its attention
    sinks, YaRN and windows on the odd blocks, as keras-hub places them,
    not as Hugging Face does).

    Raises:
        ValueError: for another kind of model, and for an option of a known
            family that keras_attn's blocks do not compute exactly (the
            message names it): the converted model never computes something
            different from the original.

    Example (`from_preset` downloads the weights; a model built from a
    config converts the same way):
    >>> import keras_hub
    >>> hub = keras_hub.models.Llama3Backbone(
    ...     vocabulary_size=64, num_layers=1, num_query_heads=4,
    ...     num_key_value_heads=2, hidden_dim=16, intermediate_dim=32)
    >>> model = keras_attn.models.from_keras_hub(hub)
    >>> tuple(model(np.array([[1, 2, 3]])).shape)
    (1, 3, 64)
    """
    backbone = _backbone(model)
    read = _FAMILIES[type(backbone).__name__]
    config = _Config(backbone)
    spec, names = read(config, backbone)
    config.check_all_read()
    ours = decoder_lm(spec, name=f"{backbone.name}_keras_attn")
    copy_weights(ours, backbone, names)
    return ours


def _backbone(model):
    """`model`'s keras-hub backbone, of a family we convert, with float
    weights under one dtype policy; else a `ValueError` says which."""
    backbone = getattr(model, "backbone", model)
    cls = type(backbone)
    if not cls.__module__.startswith("keras_hub.") or cls.__name__ not in _FAMILIES:
        raise ValueError(
            "`from_keras_hub` converts a keras-hub causal LM or backbone of "
            f"the families {sorted(_FAMILIES)}. Received: {type(model).__name__}"
            + (f" (backbone {cls.__name__})" if backbone is not model else "")
            + "."
        )
    if isinstance(backbone.dtype_policy, keras.dtype_policies.DTypePolicyMap):
        raise ValueError(
            "`from_keras_hub` converts a model of one dtype policy; this one "
            "has a DTypePolicyMap. Convert the model built with one policy, "
            "then give the keras_attn model its map."
        )
    quantized = quantized_layers(backbone)
    if quantized:
        raise ValueError(
            "`from_keras_hub` converts float weights; these layers are "
            f"quantized: {quantized[:3]}. Convert the float model, then call "
            "`quantize` on the keras_attn model."
        )
    return backbone


class _Config(ConfigEntries):
    """A keras-hub backbone's config, read entry by entry: an entry no family
    reader read is an option keras_attn does not convert (`check_all_read`)."""

    def __init__(self, backbone):
        family = type(backbone).__name__
        super().__init__(
            backbone.get_config(), family, "from_keras_hub", _LAYER_ENTRIES
        )

    def ignored_by_keras_hub(self, key, how):
        """Warn that the keras-hub model does not compute what `key` says
        (`how`): the conversion computes what the keras-hub model computes."""
        warnings.warn(
            f"{self.family} has {key}={self.values[key]!r}, which keras-hub "
            f"does not apply ({how}). The converted model computes what the "
            "keras-hub model computes, without it.",
            stacklevel=4,
        )


def copy_weights(ours, backbone, names):
    """Assign `backbone`'s weights to `ours`: `names` is a list of `(our path,
    their path, transform or None)`; every weight of each side takes part
    exactly once, or a `ValueError` names the ones left over. Our state
    variables (`state_paths`: an experts' load record) have no counterpart
    and keep their initial value."""
    state = state_paths(ours)
    mine = {w.path: w for w in ours.weights if w.path not in state}
    theirs = {w.path: w for w in backbone.weights}
    left_mine = sorted(set(mine) - {o for o, _, _ in names})
    left_theirs = sorted(set(theirs) - {t for _, t, _ in names})
    if left_mine or left_theirs:
        raise ValueError(
            f"`from_keras_hub` found weights it does not convert: keras-hub's "
            f"{left_theirs}, keras_attn's {left_mine}."
        )
    for our_path, their_path, transform in names:
        value = keras.ops.convert_to_numpy(theirs[their_path])
        mine[our_path].assign(transform(value) if transform else value)


# --- The families: config to spec, and weight names ----------------------------


def _gpt2(config, backbone):
    """GPT-2: pre-norm blocks with biases, tanh-GELU, learned positions, the
    token table as head."""
    first = backbone.transformer_layers[0]
    _check_activation(config, first.activation, "gelu_approximate")
    block = dict(
        intermediate_dim=config["intermediate_dim"],
        num_heads=config["num_heads"],
        dropout=config["dropout"],
        activation=gelu_approximate,
        layer_norm_epsilon=first.layer_norm_epsilon,
        normalize_first=True,
    )
    spec = DecoderLMSpec(
        vocabulary_size=config["vocabulary_size"],
        hidden_dim=config["hidden_dim"],
        blocks=(block,) * config["num_layers"],
        normalization="layer_norm",
        layer_norm_epsilon=backbone.layer_norm.epsilon,
        use_bias=True,
        positions=config["max_sequence_length"],
        dropout=config["dropout"],
        dtype=dtype_of(backbone),
    )
    names = block_names(config["num_layers"], GPT2_BLOCK)
    names += pairs(
        ("token_embedding/embeddings", "token_embedding/embeddings"),
        ("position_embedding/embeddings", "position_embedding/embeddings"),
        ("final_norm/gamma", "layer_norm/gamma"),
        ("final_norm/beta", "layer_norm/beta"),
    )
    return spec, names


def _llama(config, backbone):
    """LLaMA and Llama 3 (3.1's frequency adjustment as `rope_scaling`)."""
    if config["rope_position_scaling_factor"] != 1.0:
        config.ignored_by_keras_hub(
            "rope_position_scaling_factor",
            "its `LlamaRotaryEmbedding` does not divide the frequencies by it",
        )
    scaling = _llama3_scaling(config)
    block = llama_block(config, rope_scaling=scaling)
    return _llama_like(config, backbone, block, LLAMA_BLOCK)


def _llama3_scaling(config):
    """Llama 3.1's frequency adjustment as a `rope_scaling` dict; None
    without one (keras-hub sets its four entries together or none)."""
    factor, low, high, original = (
        config[f"rope_{key}"]
        for key in (
            "frequency_adjustment_factor",
            "low_freq_factor",
            "high_freq_factor",
            "pretraining_sequence_length",
        )
    )
    if factor is None:
        return None
    return {
        "rope_type": "llama3",
        "factor": float(factor),
        "low_freq_factor": float(low),
        "high_freq_factor": float(high),
        "original_max_position_embeddings": int(original),
    }


def _mistral(config, backbone):
    """Mistral: LLaMA's block with a sliding window."""
    block = llama_block(
        config,
        rope_scaling_factor=float(config["rope_scaling_factor"]),
        sliding_window=config["sliding_window"],
        key_dim=config["head_dim"],
    )
    return _llama_like(config, backbone, block, LLAMA_BLOCK)


def _qwen3(config, backbone):
    """Qwen3: LLaMA's block with QK-norm and a head width of its own
    (`_hub_parts.qwen3_attention`)."""
    block = llama_block(config, **qwen3_attention(config, backbone))
    config.get("tie_word_embeddings")  # read from the token table below
    return _llama_like(config, backbone, block, QWEN3_BLOCK)


def _llama_like(config, backbone, block, table):
    count = config["num_layers"]
    return llama_like(config, backbone, (block,) * count, block_names(count, table))


def _gemma(config, backbone):
    """Gemma and Gemma 2: GeGLU, RMS norms scaling by `1 + scale`, embeddings
    scaled by `sqrt(hidden_dim)`, and Gemma 2's post-sublayer norms, soft-caps
    and sliding windows on every other block."""
    _check_gemma(config, backbone)
    config.get("layer_norm_epsilon")  # the final norm's: read from that norm
    block = _gemma_block(config, backbone)
    window = config["sliding_window_size"]
    windowed = config["use_sliding_window_attention"]
    blocks = tuple(
        {**block, "sliding_window": window if windowed and i % 2 == 0 else None}
        for i in range(config["num_layers"])
    )
    spec = DecoderLMSpec(
        vocabulary_size=config["vocabulary_size"],
        hidden_dim=config["hidden_dim"],
        blocks=blocks,
        layer_norm_epsilon=backbone.layer_norm.epsilon,
        embedding_scale=float(np.sqrt(config["hidden_dim"])),
        final_logit_soft_cap=config["final_logit_soft_cap"],
        dtype=dtype_of(backbone),
    )
    table = {
        **GEMMA_BLOCK,
        **(GEMMA_OUTPUT_NORMS if block["normalize_sublayer_outputs"] else {}),
    }
    names = block_names(config["num_layers"], table, "decoder_block_{}", _from_gemma)
    names += pairs(("token_embedding/embeddings", "token_embedding/embeddings"))
    names += [("final_norm/scale", "final_normalization/scale", _plus_one)]
    return spec, names


def _gemma_block(config, backbone):
    """A Gemma block's arguments. The norms' epsilon is the block's own:
    keras-hub's `GemmaBackbone` gives `layer_norm_epsilon` to the final norm
    only."""
    first = backbone.transformer_layers[0]
    return dict(
        intermediate_dim=config["intermediate_dim"] // 2,  # each branch's
        num_heads=config["num_query_heads"],
        num_key_value_heads=config["num_key_value_heads"],
        key_dim=config["head_dim"],
        dropout=config["dropout"],
        activation=gelu_approximate,
        layer_norm_epsilon=first.pre_attention_norm.epsilon,
        normalize_first=True,
        normalization="rms_norm",
        gated_feedforward=True,
        use_bias=False,
        rope_max_wavelength=_gemma_wavelength(backbone),
        logit_soft_cap=config["attention_logit_soft_cap"],
        attention_scale=_gemma_scale(config, backbone),
        normalize_sublayer_outputs=config["use_post_attention_norm"],
    )


def _check_gemma(config, backbone):
    if config["use_post_attention_norm"] != config["use_post_ffw_norm"]:
        config.refuse(
            "use_post_ffw_norm",
            "keras_attn's blocks normalize every sublayer's output or none "
            f"(use_post_attention_norm={config['use_post_attention_norm']}).",
        )
    if backbone.dtype_policy.variable_dtype != "float32":
        config.refuse(
            "dtype",
            "Gemma's RMS norms scale by 1 + w, which keras_attn's (Keras') "
            "norms hold as one weight: in a "
            f"{backbone.dtype_policy.variable_dtype} variable, 1 + w loses w's "
            "low bits. Load the keras-hub model with dtype='float32' or a "
            "mixed policy ('mixed_bfloat16') and convert that.",
            value=backbone.dtype_policy.name,
        )


def _gemma_scale(config, backbone):
    """`attention_scale`: None (`head_dim ** -0.5`) or Gemma's other choice,
    `(hidden_dim // heads) ** -0.5`, as keras-hub's attention layers do it."""
    attention = backbone.transformer_layers[0].attention
    if config["query_head_dim_normalize"] != attention.query_head_dim_normalize:
        config.ignored_by_keras_hub(
            "query_head_dim_normalize",
            "its `GemmaDecoderBlock` builds the attention with "
            f"query_head_dim_normalize={attention.query_head_dim_normalize}",
        )
    if attention.query_head_dim_normalize:
        return None
    return float(1 / np.sqrt(attention.hidden_dim // attention.num_query_heads))


def _gemma_wavelength(backbone):
    """Gemma's rotary base, from its first attention layer's RoPE."""
    return float(backbone.transformer_layers[0].attention.rope_layer.max_wavelength)


def _from_gemma(our_path):
    """Gemma's layouts: query/key/value kernels `(heads, width, dim)` where
    ours are `(width, heads, dim)`; RMS norms scale by `1 + scale`."""
    if our_path.endswith(("query/kernel", "key/kernel", "value/kernel")):
        return lambda value: np.transpose(value, (1, 0, 2))
    return _plus_one if our_path.endswith("norm/scale") else None


def _plus_one(value):
    return value.astype("float32") + 1.0


# --- Helpers --------------------------------------------------------------------


def _check_activation(config, activation, expected):
    name = getattr(activation, "__name__", activation)
    if name != expected:
        config.refuse("activation", f"keras_attn converts {expected} here.", name)


_FAMILIES = {
    "GPT2Backbone": _gpt2,
    "LlamaBackbone": _llama,
    "Llama3Backbone": _llama,
    "MistralBackbone": _mistral,
    "GemmaBackbone": _gemma,
    "Qwen3Backbone": _qwen3,
    **SPARSE_FAMILIES,
}
