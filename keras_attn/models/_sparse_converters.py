"""keras-hub's mixture-of-experts language models (Mixtral, Qwen3-MoE,
gpt-oss) as `DecoderLMSpec`s: LLaMA-like blocks whose feed-forward network
is a `keras_attn.layers.MixtureOfExperts`, and their weight names.

`converters.from_keras_hub` reads the config and copies the weights; each
reader here returns `(spec, names)` as the dense families' readers do. What
keras-hub 0.32 computes, entry by entry (its inference; training noted):

- Mixtral: softmax over the experts, the `top_k` largest renormalized to sum
  to 1; experts `W_out (silu(x W_gate) * x W_in)`; Mistral's attention.
- Qwen3-MoE: the same routing, renormalized only with `norm_top_k_prob`;
  experts hold gate and up in one `(E, D, 2F)` kernel, gate first; blocks
  listed in `mlp_only_layers`, or not a multiple of `decoder_sparse_step`,
  keep a dense gated FFN of `intermediate_dim`; Qwen3's attention.
- gpt-oss: top-k of the router logits (the router has a bias), softmax over
  those k; biased experts with gate and up interleaved in one kernel (gate at
  even columns), `(clip(up, -7, 7) + 1) * g * sigmoid(1.702 g)` with
  `g = min(gate, 7)`; biased attention with a learned sink logit per head,
  YaRN positions, and a window on the odd blocks.
"""

import keras

from keras_attn.layers import MixtureOfExperts
from keras_attn.models._hub_parts import (
    LLAMA_ATTENTION,
    QKVO,
    QWEN3_NORMS,
    block_names,
    llama_block,
    llama_like,
    qwen3_attention,
)

# gpt-oss's constants in keras-hub 0.32 (`GptOssExperts`, `GptOssAttention`):
# the clamp and slope of its SwiGLU, and its YaRN's fixed settings.
GPT_OSS_SWIGLU_LIMIT = 7.0
GPT_OSS_SWIGLU_ALPHA = 1.702
GPT_OSS_YARN = {
    "rope_type": "yarn",
    "original_max_position_embeddings": 4096,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
}


def _experts(**arguments):
    """A `MixtureOfExperts`' serialized form, one per block (a block dict
    may be shared by several blocks, a layer may not)."""
    return keras.saving.serialize_keras_object(
        MixtureOfExperts(name="feedforward", **arguments)
    )


def _sparse_block(block, experts):
    """`block` with `experts` as its feed-forward network (the dense
    network's options dropped: the experts carry their own)."""
    block = {k: v for k, v in block.items() if k not in _DENSE_FEEDFORWARD}
    return {**block, "intermediate_dim": None, "feedforward": experts}


_DENSE_FEEDFORWARD = ("gated_feedforward", "activation")


# --- Mixtral -------------------------------------------------------------------


def _mixtral(config, backbone):
    """Mixtral: Mistral's block (head width `hidden_dim // num_query_heads`)
    with softmax-routed SwiGLU experts, the top `top_k` renormalized."""
    _check_jitter(config)
    experts = _experts(
        num_experts=config["num_experts"],
        intermediate_dim=config["intermediate_dim"],
        top_k=config["top_k"],
        activation="silu",
        gated=True,
        use_bias=False,
        router="softmax",
        normalize_top_k=True,
        load_balancing_loss=_load_balancing(config, "router_aux_loss_coef"),
    )
    block = llama_block(
        config,
        rope_scaling_factor=float(config["rope_scaling_factor"]),
        sliding_window=config["sliding_window"],
    )
    count = config["num_layers"]
    names = block_names(count, LLAMA_ATTENTION)
    for i, layer in enumerate(backbone.transformer_layers):
        moe = layer._sparse_moe_block
        bank = moe.expert_bank
        names += _moe_names(
            i,
            router=moe._sparse_feedforward_gate_dense.kernel,
            gate_kernel=bank._expert_feedforward_gate_dense,
            intermediate_kernel=bank._expert_feedforward_intermediate_dense,
            output_kernel=bank._expert_feedforward_output_dense,
        )
    return llama_like(config, backbone, [_sparse_block(block, experts)] * count, names)


def _check_jitter(config):
    """Mixtral's router jitter multiplies the MoE input by uniform noise in
    training only; keras_attn's experts have none."""
    if config["router_jitter_noise"]:
        config.refuse(
            "router_jitter_noise",
            "keras_attn's MixtureOfExperts has no router jitter; the converted "
            "model would train without it. Convert the model built with "
            "router_jitter_noise=0.0 (inference is the same).",
        )


# --- Qwen3-MoE -------------------------------------------------------------------


def _qwen3_moe(config, backbone):
    """Qwen3-MoE: Qwen3's attention (QK-norm, a head width of its own), and
    softmax-routed SwiGLU experts (the top `top_k` renormalized with
    `norm_top_k_prob`) in the sparse blocks, a dense SwiGLU in the others."""
    dense = llama_block(config, **qwen3_attention(config, backbone))
    config.get("tie_word_embeddings")  # read from the token table
    experts = _experts(
        num_experts=config["num_experts"],
        intermediate_dim=config["moe_intermediate_dim"],
        top_k=config["top_k"],
        activation="silu",
        gated=True,
        use_bias=False,
        router="softmax",
        normalize_top_k=bool(config["norm_top_k_prob"]),
        load_balancing_loss=_load_balancing(config, "router_aux_loss_coefficient"),
    )
    blocks, names = [], []
    for i, layer in enumerate(backbone.transformer_layers):
        if _qwen3_sparse(config, i):
            blocks.append(_sparse_block(dense, experts))
            names += _qwen3_moe_names(i, layer.mlp)
        else:
            blocks.append(dense)
            names += _qwen3_dense_names(i, layer.mlp)
    names += block_names(config["num_layers"], {**LLAMA_ATTENTION, **QWEN3_NORMS})
    return llama_like(config, backbone, blocks, names)


def _qwen3_sparse(config, index):
    """Whether block `index` is sparse, as `Qwen3MoeBackbone` decides."""
    listed = config.get("mlp_only_layers", [])
    step = config["decoder_sparse_step"]
    experts = config["num_experts"]
    return index not in listed and experts > 0 and (index + 1) % step == 0


def _qwen3_moe_names(index, moe):
    bank = moe.expert_bank
    both = bank._expert_feedforward_gate_dense  # (E, D, 2F): gate, then up
    width = both.shape[-1] // 2
    return _moe_names(
        index,
        router=moe._sparse_feedforward_gate_dense.kernel,
        gate_kernel=(both, lambda value: value[..., :width]),
        intermediate_kernel=(both, lambda value: value[..., width:]),
        output_kernel=bank._expert_feedforward_output_dense,
    )


def _qwen3_dense_names(index, mlp):
    table = {
        f"feedforward_{part}_dense/kernel": getattr(
            mlp, f"_feedforward_{part}_dense"
        ).kernel.path
        for part in ("intermediate", "gate", "output")
    }
    return [
        (f"transformer_layer_{index}/{ours}", theirs, None)
        for ours, theirs in table.items()
    ]


# --- gpt-oss -----------------------------------------------------------------------


def _gpt_oss(config, backbone):
    """gpt-oss: biased attention with a learned sink logit per head and YaRN
    positions, a window on the odd blocks, and top-k-then-softmax routed
    experts with gpt-oss's clamped SwiGLU."""
    block = _gpt_oss_block(config)
    experts = _experts(
        num_experts=config["num_experts"],
        intermediate_dim=config["intermediate_dim"],
        top_k=config["top_k"],
        gated=True,
        use_bias=True,
        router="top_k_softmax",
        use_router_bias=True,
        swiglu_limit=GPT_OSS_SWIGLU_LIMIT,
        swiglu_alpha=GPT_OSS_SWIGLU_ALPHA,
    )
    # keras-hub's mask lets query i see keys j >= i - sliding_window: the
    # window's width is one more than the entry (Hugging Face's is the entry).
    window = config["sliding_window"]
    windows = [
        window + 1 if window and window > 0 and i % 2 == 1 else None
        for i in range(config["num_layers"])
    ]
    blocks = [_sparse_block({**block, "sliding_window": w}, experts) for w in windows]
    names = []
    for i, layer in enumerate(backbone.transformer_layers):
        names += _gpt_oss_names(i, layer)
    return llama_like(config, backbone, blocks, names)


def _gpt_oss_block(config):
    head_dim = config.get("head_dim", config["hidden_dim"] // config["num_query_heads"])
    if head_dim % 2:
        config.refuse(
            "head_dim",
            "keras-hub rotates the first head_dim - 1 channels of an odd "
            "head width; keras_attn's rotary positions take even widths.",
            value=head_dim,
        )
    # Read, and nothing to convert: it changes what keras-hub's blocks return,
    # not the logits.
    config.get("output_router_logits")
    factor = float(config["rope_scaling_factor"])
    block = llama_block(
        config,
        key_dim=head_dim,
        rope_scaling={**GPT_OSS_YARN, "factor": factor} if factor != 1.0 else None,
        use_sink_logits=True,
    )
    return {**block, "use_bias": True}


def _gpt_oss_names(index, layer):
    moe = layer.sparse_moe_block
    experts = moe.experts
    attention = layer.self_attention_layer
    ours_theirs = [
        (f"self_attention/{p}/{w}", getattr(attention, f"{d}_dense"), w)
        for p, d in zip(QKVO, ("query", "key", "value", "output"), strict=True)
        for w in ("kernel", "bias")
    ]
    names = [
        (f"transformer_layer_{index}/{ours}", getattr(dense, w).path, None)
        for ours, dense, w in ours_theirs
    ]
    names += [
        (f"transformer_layer_{index}/{ours}", weight.path, None)
        for ours, weight in (
            ("self_attention/sink_logits", attention.sinks),
            ("self_attention_layer_norm/scale", layer.input_layernorm.scale),
            ("feedforward_layer_norm/scale", layer.post_attention_layernorm.scale),
        )
    ]
    gates, ups = (lambda v: v[..., ::2]), (lambda v: v[..., 1::2])
    return names + _moe_names(
        index,
        router=moe.router.router_dense.kernel,
        router_bias=moe.router.router_dense.bias,
        gate_kernel=(experts.gate_up_proj, gates),
        intermediate_kernel=(experts.gate_up_proj, ups),
        gate_bias=(experts.gate_up_proj_bias, gates),
        intermediate_bias=(experts.gate_up_proj_bias, ups),
        output_kernel=experts.down_proj,
        output_bias=experts.down_proj_bias,
    )


# --- Shared ----------------------------------------------------------------------

# Our weight under the block's `feedforward`, by the keyword `_moe_names` takes.
_MOE_WEIGHTS = {"router": "router/kernel", "router_bias": "router/bias"}


def _moe_names(index, **theirs):
    """`(our path, their path, transform)` of block `index`'s experts: each
    keyword names our weight (`gate_kernel`, ...; `router`, `router_bias`),
    its value keras-hub's variable, or `(variable, transform)`."""
    names = []
    for ours, value in theirs.items():
        weight, transform = value if isinstance(value, tuple) else (value, None)
        path = _MOE_WEIGHTS.get(ours, ours)
        names.append(
            (f"transformer_layer_{index}/feedforward/{path}", weight.path, transform)
        )
    return names


def _load_balancing(config, key):
    """keras-hub's router auxiliary-loss coefficient as our
    `load_balancing_loss` (training only). keras-hub's loss averages over
    the `top_k` slots where ours (transformers') sums over them: the same
    loss takes a coefficient `top_k` times smaller."""
    return float(config[key]) / config["top_k"]


SPARSE_FAMILIES = {
    "MixtralBackbone": _mixtral,
    "Qwen3MoeBackbone": _qwen3_moe,
    "GptOssBackbone": _gpt_oss,
}
