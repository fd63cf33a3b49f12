"""The sparse families (Mixtral, Qwen3-MoE, gpt-oss, DeepSeek-V3): LLaMA's
blocks with `MixtureOfExperts` feed-forwards (DeepSeek-V3's with latent
attention too), each config read into a `DecoderLMSpec` and its tensors
linked, every number from `config.json`."""

import keras

from keras_attn.layers.mixture_of_experts import MixtureOfExperts
from keras_attn.layers.multi_head_latent_attention import MultiHeadLatentAttention
from keras_attn.models.hugging_face._families import (
    _activation,
    _attention_dropout,
    _attention_links,
    _feedforward_links,
    _fixed_biases,
    _llama_like,
    _qwen_window,
    _qwen_windows,
)
from keras_attn.models.hugging_face._links import BIAS, LINEAR, OUTPUT_LINEAR, link
from keras_attn.models.hugging_face._rope import rope_options
from keras_attn.ops.positions import yarn_mscale

# Our expert variables and the names of one expert's matrices in the
# per-expert checkpoints (Mixtral's w1/w3/w2; Qwen3-MoE's and DeepSeek's
# gate/up/down projections).
_EXPERT_KERNELS = ("gate_kernel", "intermediate_kernel", "output_kernel")
_MIXTRAL_NAMES = ("w1", "w3", "w2")
_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def _experts(config, **arguments):
    """The serialized `MixtureOfExperts` of a sparse block (the form a
    block's config holds), checked by the layer itself."""
    _refuse_router_logits(config)
    layer = MixtureOfExperts(
        top_k=config["num_experts_per_tok"], name="feedforward", **arguments
    )
    return keras.saving.serialize_keras_object(layer)


def _refuse_router_logits(config):
    """transformers adds its load-balancing loss (`router_aux_loss_coef`)
    only with `output_router_logits`, over every layer's router logits
    concatenated; ours adds one per layer (`load_balancing_loss`)."""
    config.get("router_aux_loss_coef")
    if config.get("output_router_logits", False):
        config.refuse(
            "output_router_logits",
            "transformers' load-balancing loss pools every layer's router; "
            "keras_attn's MixtureOfExperts adds one per layer "
            "(`load_balancing_loss`). Load with output_router_logits false, then "
            "set each layer's coefficient for training.",
        )


def _sparse(block, experts):
    """A LLaMA block dict with `experts` as its feed-forward."""
    block = dict(block)
    for key in ("gated_feedforward", "use_feedforward_bias", "activation"):
        block.pop(key)
    return {**block, "intermediate_dim": None, "feedforward": experts}


def _expert_links(ours, theirs, count, names):
    """Per-expert checkpoint tensors (`theirs{e}.{name}.weight`), each one
    slice of our stacked kernels, listed a variable at a time."""
    return [
        link(f"{theirs}{e}.{name}.weight", f"{ours}{kernel}", LINEAR, expert=e)
        for kernel, name in zip(_EXPERT_KERNELS, names, strict=True)
        for e in range(count)
    ]


def _moe_links(ours, theirs, block, router, experts, names):
    """A sparse feed-forward's router and per-expert matrices."""
    ours = f"{ours}feedforward/"
    count = block["feedforward"]["config"]["num_experts"]
    links = [link(f"{theirs}{router}.weight", f"{ours}router/kernel", LINEAR)]
    return links + _expert_links(ours, f"{theirs}{experts}.", count, names)


# --- Mixtral and Qwen3-MoE -------------------------------------------------------


def _mixtral(config, dtype):
    """Mixtral: Mistral's blocks, every feed-forward E experts routed by a
    softmax, the top k renormalized."""
    config.require(
        "router_jitter_noise", 0.0, "keras_attn's router multiplies no noise in."
    )
    experts = _experts(
        config,
        num_experts=config["num_local_experts"],
        intermediate_dim=config["intermediate_size"],
        activation=_activation(config, "hidden_act"),
        router="softmax",
        normalize_top_k=True,
    )

    def links(ours, theirs, block):
        return _attention_links(ours, theirs, block, False) + _moe_links(
            ours, theirs, block, "block_sparse_moe.gate",
            "block_sparse_moe.experts", _MIXTRAL_NAMES,
        )  # fmt: skip

    return _llama_like(
        config, dtype, tied=False, windows="all", **_fixed_biases(config),
        adapt=lambda i, block: _sparse(block, experts), sublayer_links=links,
    )  # fmt: skip


def _qwen3_moe(config, dtype):
    """Qwen3-MoE: Qwen3's blocks (QK-norm), sparse where `mlp_only_layers`
    and `decoder_sparse_step` say, the top k renormalized by
    `norm_topk_prob`."""
    # transformers 5 writes `num_local_experts`, earlier configs `num_experts`.
    key = "num_experts" if "num_experts" in config.values else "num_local_experts"
    count = config[key]
    experts = _experts(
        config,
        num_experts=count,
        intermediate_dim=config["moe_intermediate_size"],
        activation=_activation(config, "hidden_act"),
        router="softmax",
        normalize_top_k=bool(config.get("norm_topk_prob", False)),
    )
    dense_layers = set(config.get("mlp_only_layers") or ())
    step = config.get("decoder_sparse_step", 1)

    def sparse(i):
        return i not in dense_layers and count > 0 and (i + 1) % step == 0

    def links(ours, theirs, block):
        attention = _attention_links(ours, theirs, block, False)
        if block.get("feedforward") is None:
            return attention + _feedforward_links(ours, theirs, block, False)
        return attention + _moe_links(
            ours, theirs, block, "mlp.gate", "mlp.experts", _PROJECTIONS
        )

    return _llama_like(
        config, dtype, tied=False, qk_norm=True, mlp_bias=False,
        windows=_qwen_windows, window=_qwen_window,
        adapt=lambda i, block: _sparse(block, experts) if sparse(i) else block,
        sublayer_links=links,
    )  # fmt: skip


# --- gpt-oss ------------------------------------------------------------------------


def _gpt_oss(config, dtype):
    """gpt-oss: biased attention with a learned sink logit per head,
    alternating sliding and full layers, YaRN positions; experts with biases,
    a biased router (top k of the logits, then their softmax) and the
    clamped SwiGLU `(up + 1) * gate * sigmoid(alpha * gate)`."""
    config.get("hidden_act")  # the experts' clamped SwiGLU reads no activation
    if "rope_parameters" not in config.values and "rope_scaling" not in config.values:
        config.refuse(
            "rope_parameters",
            "gpt-oss's positions are YaRN's by its config class's default, "
            "which this loader does not assume: write them in config.json.",
        )
    experts = _experts(
        config,
        num_experts=config["num_local_experts"],
        intermediate_dim=config["intermediate_size"],
        use_bias=True,
        router="top_k_softmax",
        use_router_bias=True,
        swiglu_limit=float(config["swiglu_limit"]),
        swiglu_alpha=float(config.get("swiglu_alpha", 1.702)),
    )

    def adapt(i, block):
        return {**_sparse(block, experts), "use_sink_logits": True}

    def links(ours, theirs, block):
        # One tensor per kind holds every expert; gate and up alternate.
        moe, fused = f"{ours}feedforward/", f"{theirs}mlp.experts."
        return _attention_links(ours, theirs, block, False) + [
            link(f"{theirs}mlp.router.weight", f"{moe}router/kernel", LINEAR),
            link(f"{theirs}mlp.router.bias", f"{moe}router/bias"),
            link(
                f"{fused}gate_up_proj",
                (f"{moe}gate_kernel", f"{moe}intermediate_kernel"),
                axis=2,
                interleaved=True,
            ),
            link(
                f"{fused}gate_up_proj_bias",
                (f"{moe}gate_bias", f"{moe}intermediate_bias"),
                axis=1,
                interleaved=True,
            ),
            link(f"{fused}down_proj", f"{moe}output_kernel"),
            link(f"{fused}down_proj_bias", f"{moe}output_bias"),
        ]

    return _llama_like(
        config, dtype, tied=False, windows=_gpt_oss_windows, mlp_bias=False,
        adapt=adapt, sublayer_links=links,
    )  # fmt: skip


def _gpt_oss_windows(config, i):
    """gpt-oss before `layer_types`: sliding on even layers."""
    del config
    return "sliding_attention" if (i + 1) % 2 else "full_attention"


# --- DeepSeek-V3 ------------------------------------------------------------------


def _deepseek_v3(config, dtype):
    """DeepSeek-V3: multi-head latent attention in every block; dense
    feed-forwards in the first `first_k_dense_replace` blocks, then experts
    routed by sigmoid scores (group-limited, with a correction bias for the
    choice) plus shared experts."""
    for key in ("head_dim", "qk_head_dim"):  # derived from the head widths
        config.get(key)
    config.get("num_nextn_predict_layers")  # their tensors skipped: `mtp_layers`
    attention = _latent_attention(config)
    experts = _experts(
        config,
        num_experts=config["n_routed_experts"],
        intermediate_dim=config["moe_intermediate_size"],
        activation=_activation(config, "hidden_act"),
        router="sigmoid",
        use_score_correction_bias=True,
        num_expert_groups=config["n_group"],
        top_k_groups=config["topk_group"],
        normalize_top_k=bool(config.get("norm_topk_prob", True)),
        routed_scaling_factor=float(config.get("routed_scaling_factor", 1.0)),
        num_shared_experts=config.get("n_shared_experts") or 0,
    )
    first_sparse = config.get("first_k_dense_replace", 0)

    def adapt(i, block):
        block = {key: block[key] for key in _LATENT_BLOCK_KEYS if key in block}
        block["self_attention"] = attention
        return _sparse(block, experts) if i >= first_sparse else block

    return _llama_like(
        config, dtype, tied=False, windows="none", **_fixed_biases(config),
        adapt=adapt, sublayer_links=_deepseek_links,
    )  # fmt: skip


# A latent-attention block keeps these of LLaMA's block arguments (the
# attention's own are the latent layer's).
_LATENT_BLOCK_KEYS = (
    "intermediate_dim",
    "num_heads",
    "dropout",
    "activation",
    "layer_norm_epsilon",
    "normalize_first",
    "normalization",
    "gated_feedforward",
    "use_bias",
    "use_feedforward_bias",
)


def _latent_attention(config):
    """The serialized `MultiHeadLatentAttention` of every block."""
    rope = rope_options(config)
    scale = config["qk_nope_head_dim"] + config["qk_rope_head_dim"]
    layer = MultiHeadLatentAttention(
        num_heads=config["num_attention_heads"],
        kv_lora_rank=config["kv_lora_rank"],
        qk_nope_head_dim=config["qk_nope_head_dim"],
        qk_rope_head_dim=config["qk_rope_head_dim"],
        v_head_dim=config["v_head_dim"],
        q_lora_rank=config.get("q_lora_rank"),
        rope_max_wavelength=rope["rope_max_wavelength"],
        rope_scaling=rope.get("rope_scaling"),
        rope_interleave=bool(config.get("rope_interleave", True)),
        attention_scale=_latent_scale(config, scale**-0.5),
        norm_epsilon=float(config["rms_norm_eps"]),
        use_bias=bool(config.get("attention_bias", False)),
        dropout=_attention_dropout(config),
        name="self_attention",
    )
    heads = config.get("num_key_value_heads")
    if heads is not None and heads != config["num_attention_heads"]:
        config.refuse("num_key_value_heads", "latent attention has one latent.")
    return keras.saving.serialize_keras_object(layer)


def _latent_scale(config, scale):
    """DeepSeek's softmax scale: with YaRN's `mscale_all_dim`, `scale`
    times `yarn_mscale(factor, mscale_all_dim)^2` (transformers'
    `yarn_apply_mscale`; the rotary scaling read it already)."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    mscale = params.get("mscale_all_dim")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default" or not mscale:
        return scale
    return scale * yarn_mscale(params["factor"], mscale) ** 2


def _deepseek_links(ours, theirs, block):
    attention = _latent_links(ours, theirs, block)
    if block.get("feedforward") is None:
        return attention + _feedforward_links(ours, theirs, block, False)
    moe, shared = f"{ours}feedforward/", f"{theirs}mlp.shared_experts."
    links = _moe_links(ours, theirs, block, "mlp.gate", "mlp.experts", _PROJECTIONS)
    links.append(
        link(f"{theirs}mlp.gate.e_score_correction_bias", f"{moe}score_correction_bias")
    )
    if block["feedforward"]["config"]["num_shared_experts"]:
        links += [
            link(f"{shared}{name}.weight", f"{moe}shared_{part}_dense/kernel", LINEAR)
            for name, part in zip(
                _PROJECTIONS, ("gate", "intermediate", "output"), strict=True
            )
        ]
    return attention + links


def _latent_links(ours, theirs, block):
    ours, theirs = f"{ours}self_attention/", f"{theirs}self_attn."
    has_query_rank = block["self_attention"]["config"]["q_lora_rank"] is not None
    query = (
        {"q_a_proj": "query_a", "q_b_proj": "query_b"}
        if has_query_rank
        else {"q_proj": "query"}
    )
    kernels = {**query, "kv_a_proj_with_mqa": "key_value_a", "kv_b_proj": "key_value_b"}
    links = [
        link(f"{theirs}{t}.weight", f"{ours}{o}/kernel", LINEAR)
        for t, o in kernels.items()
    ]
    norms = {"kv_a_layernorm": "key_value_a_norm"}
    if has_query_rank:
        norms["q_a_layernorm"] = "query_a_norm"
    links += [link(f"{theirs}{t}.weight", f"{ours}{o}/scale") for t, o in norms.items()]
    links.append(
        link(f"{theirs}o_proj.weight", f"{ours}attention_output/kernel", OUTPUT_LINEAR)
    )
    if block["self_attention"]["config"]["use_bias"]:
        links.append(link(f"{theirs}o_proj.bias", f"{ours}attention_output/bias", BIAS))
    return links


def mtp_layers(config):
    """DeepSeek-V3's multi-token-prediction layers (`model.layers.{n}.` from
    `num_hidden_layers` on): transformers' model does not read them."""
    if config.family != "deepseek_v3":
        return ()
    first, count = config["num_hidden_layers"], config.get("num_nextn_predict_layers")
    return tuple(f"model.layers.{first + i}." for i in range(count or 0))


SPARSE_FAMILIES = {
    "mixtral": _mixtral,
    "qwen3_moe": _qwen3_moe,
    "gpt_oss": _gpt_oss,
    "deepseek_v3": _deepseek_v3,
}
