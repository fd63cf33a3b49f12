"""A config's rotary positions as our blocks' `rope_max_wavelength` and
`rope_scaling`, from either form transformers writes: `rope_parameters`
(transformers 5, per layer type for Gemma 3) or `rope_theta` with
`rope_scaling` (transformers 4)."""

from keras_attn.ops.positions import yarn_mscale

# Keys of each scaling type that we compute, beside `rope_type` and
# `rope_theta` (transformers' names are ours).
_KEYS = {
    "default": (),
    "linear": ("factor",),
    "llama3": (
        "factor",
        "low_freq_factor",
        "high_freq_factor",
        "original_max_position_embeddings",
    ),
    "yarn": (
        "factor",
        "original_max_position_embeddings",
        "beta_fast",
        "beta_slow",
        "truncate",
        "attention_factor",
        "mscale",
        "mscale_all_dim",
    ),
}
_REFUSED = {
    "dynamic": "its frequencies change with the length of each call "
    "(transformers' dynamic NTK), which a fixed rotary table cannot follow",
    "longrope": "keras_attn's rotary positions have no per-channel factors yet",
}


def rope_options(config, layer_type=None, default_theta=10000.0):
    """`{"rope_max_wavelength": ..., "rope_scaling": ...}` of the layers of
    `layer_type` (`"full_attention"`/`"sliding_attention"`, for configs with
    parameters per type)."""
    params = _parameters(config, layer_type, default_theta)
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    theta = params.pop("rope_theta")
    if not isinstance(theta, (int, float)) or theta <= 0:
        config.refuse("rope_theta", "the rotary base must be a positive number.", theta)
    partial = params.pop("partial_rotary_factor", 1.0)
    if partial != 1.0:
        config.refuse(
            "partial_rotary_factor",
            "keras_attn rotates every channel of a head.",
            partial,
        )
    if rope_type in _REFUSED or rope_type not in _KEYS:
        config.refuse(
            "rope_parameters",
            _REFUSED.get(rope_type, f"rope_type {rope_type!r} is not one of {_KEYS}"),
            {"rope_type": rope_type, **params},
        )
    unknown = sorted(set(params) - set(_KEYS[rope_type]))
    if unknown:
        config.refuse(
            "rope_parameters", f"its entries {unknown} are not computed here.", params
        )
    scaling = _scaling(config, rope_type, params)
    return {"rope_max_wavelength": float(theta), "rope_scaling": scaling}


def _parameters(config, layer_type, default_theta):
    """The rope dict of `layer_type`, with `rope_theta` and
    `partial_rotary_factor` in it whichever form the config has."""
    new, old = config.get("rope_parameters"), config.get("rope_scaling")
    if new and old:
        config.refuse("rope_scaling", "the config also has `rope_parameters`.")
    params = dict(new or old or {})
    nested = layer_type is not None and layer_type in params
    if nested:
        params = dict(params[layer_type])
    elif layer_type == "sliding_attention" and not new:  # Gemma 3, transformers 4
        params = {"rope_theta": config.get("rope_local_base_freq", 10000.0)}
    params.setdefault("rope_theta", config.get("rope_theta", default_theta))
    top_partial = config.get("partial_rotary_factor")
    if top_partial is not None:
        params.setdefault("partial_rotary_factor", top_partial)
    if params.get("rope_type", params.get("type")) in ("llama3", "yarn", "longrope"):
        # Phi-3 keeps the pretraining length beside the rope dict, and
        # transformers gives it priority over the dict's (not over a dict per
        # layer type); else the position limit stands in.
        original = config.get("original_max_position_embeddings")
        if original is not None and not nested:
            params["original_max_position_embeddings"] = original
        limit = config.get("max_position_embeddings")
        params.setdefault("original_max_position_embeddings", limit)
    else:
        config.get("original_max_position_embeddings")  # used by no other type
    return params


def _scaling(config, rope_type, params):
    if rope_type == "default":
        return None
    if rope_type == "yarn":
        return _yarn(config, params)
    return {"rope_type": rope_type, **params}


def _yarn(config, params):
    """YaRN as transformers' `_compute_yarn_parameters` computes it: the
    factor of cos and sin is the config's `attention_factor`, else
    DeepSeek-V3's ratio `mscale(factor, mscale) / mscale(factor,
    mscale_all_dim)` where both are given, else `0.1 ln(factor) + 1` (ours by
    default, so then left out); `1.0` for a factor of at most 1. (DeepSeek's
    softmax scale, multiplied by `mscale(factor, mscale_all_dim)**2`, is the
    attention's `attention_scale`, not the rope's.)"""
    factor = params.get("factor")
    original = params["original_max_position_embeddings"]
    if factor is None:
        factor = config["max_position_embeddings"] / original
    attention_factor = params.get("attention_factor")
    mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
    if attention_factor is None and mscale and mscale_all:
        attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all)
    elif attention_factor is None:
        attention_factor = yarn_mscale(factor, 1.0)
    scaling = {
        "rope_type": "yarn",
        "factor": float(factor),
        "original_max_position_embeddings": int(original),
        "beta_fast": float(params.get("beta_fast") or 32.0),
        "beta_slow": float(params.get("beta_slow") or 1.0),
        "truncate": bool(params.get("truncate", True)),
    }
    if attention_factor != yarn_mscale(factor):
        scaling["attention_factor"] = float(attention_factor)
    return scaling
