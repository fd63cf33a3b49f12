"""The pieces every keras-hub family reader builds from (`converters` for the
dense families, `_sparse_converters` for the mixtures of experts): the
LLaMA-like block and its weight names, and the `(our path, their path,
transform)` lists `converters.copy_weights` assigns."""

import keras

from keras_attn.models.decoder_lm import DecoderLMSpec


def _same(*paths):
    return {path: path for path in paths}


QKVO = ("query", "key", "value", "attention_output")
# Per block, our weight path: keras-hub's (in its block of the same index).
LLAMA_ATTENTION = {
    **_same(*(f"self_attention/{p}/kernel" for p in QKVO)),
    "self_attention_layer_norm/scale": "self_attention_layernorm/scale",
    "feedforward_layer_norm/scale": "feedforward_layernorm/scale",
}
LLAMA_BLOCK = {
    **LLAMA_ATTENTION,
    **_same(
        *(f"feedforward_{p}_dense/kernel" for p in ("intermediate", "gate", "output"))
    ),
}
QWEN3_NORMS = {
    "self_attention/query_norm/scale": "self_attention/query_dense_layernorm/scale",
    "self_attention/key_norm/scale": "self_attention/key_dense_layernorm/scale",
}
QWEN3_BLOCK = {**LLAMA_BLOCK, **QWEN3_NORMS}


def llama_block(config, **options):
    """The arguments of a LLaMA-like block (pre-norm RMS, gated SiLU, no
    biases, rotary) from the config's entries, with `options` added."""
    return dict(
        intermediate_dim=config["intermediate_dim"],
        num_heads=config["num_query_heads"],
        num_key_value_heads=config["num_key_value_heads"],
        dropout=config["dropout"],
        activation="silu",
        layer_norm_epsilon=config["layer_norm_epsilon"],
        normalize_first=True,
        normalization="rms_norm",
        gated_feedforward=True,
        use_bias=False,
        rope_max_wavelength=float(config["rope_max_wavelength"]),
        **options,
    )


def qwen3_attention(config, backbone):
    """The attention options of Qwen3 and Qwen3-MoE: QK-norm (of the
    attention layer's own epsilon) and a head width of its own. No sliding
    window: keras-hub 0.32 applies `sliding_window_size` only on TensorFlow
    (its fused JAX and PyTorch path skips it), and Hugging Face's Qwen3 has
    none unless asked."""
    attention = backbone.transformer_layers[0]._self_attention_layer
    window = config["sliding_window_size"]
    if window and keras.config.backend() == "tensorflow":
        config.ignored_by_keras_hub(
            "sliding_window_size",
            "only its TensorFlow path applies it: sequences longer than "
            f"{window} tokens differ from keras-hub's on TensorFlow",
        )
    return dict(
        rope_scaling_factor=float(config["rope_scaling_factor"]),
        key_dim=config["head_dim"],
        normalize_qk=True,
        qk_norm_epsilon=attention._query_dense_layer_norm.epsilon,
    )


def llama_like(config, backbone, blocks, names):
    """The spec and names of a LLaMA-like model of `blocks` (their names
    `names`): RMS norms, the token table reversed as head, tied or with a head
    matrix of its own."""
    tied = backbone.token_embedding.tie_weights
    spec = DecoderLMSpec(
        vocabulary_size=config["vocabulary_size"],
        hidden_dim=config["hidden_dim"],
        blocks=tuple(blocks),
        layer_norm_epsilon=config["layer_norm_epsilon"],
        tie_weights=tied,
        dtype=dtype_of(backbone),
    )
    names = names + pairs(
        ("token_embedding/embeddings", "token_embedding/embeddings"),
        ("final_norm/scale", "sequence_output_layernorm/scale"),
    )
    if not tied:
        names += pairs(
            ("token_embedding/reverse_embeddings", "token_embedding/reverse_embeddings")
        )
    return spec, names


def block_names(count, table, theirs="transformer_layer_{}", transform=None):
    """`(our path, their path, transform)` for every block's weights."""
    return [
        (
            f"transformer_layer_{i}/{ours}",
            f"{theirs.format(i)}/{their}",
            transform(ours) if transform else None,
        )
        for i in range(count)
        for ours, their in table.items()
    ]


def pairs(*pairs):
    return [(ours, theirs, None) for ours, theirs in pairs]


def dtype_of(backbone):
    """The backbone's one dtype policy (a `DTypePolicyMap` of several is
    refused by `converters._backbone`)."""
    return backbone.dtype_policy.name
