"""Each family's config read into a `DecoderLMSpec`, and its tensors linked
to our variables: every number from `config.json`, none guessed."""

from keras_attn.models.activations import gelu_approximate
from keras_attn.models.decoder_lm import DecoderLMSpec
from keras_attn.models.hugging_face._links import (
    BIAS,
    LINEAR,
    OUTPUT_LINEAR,
    PLUS_ONE,
    SAME,
    Layout,
    link,
)
from keras_attn.models.hugging_face._rope import rope_options

# transformers' activation names (`ACT2FN`) and ours.
ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "relu": "relu",
    "gelu": "gelu",
    "gelu_new": gelu_approximate,
    "gelu_pytorch_tanh": gelu_approximate,
}
SLIDING, FULL = "sliding_attention", "full_attention"


def activation_name(activation, tanh_gelu="gelu_pytorch_tanh"):
    """transformers' name of our activation (its function's name, as
    `TransformerDecoder` keeps it); `tanh_gelu`: the family's spelling of
    the tanh approximation (GPT-2: "gelu_new")."""
    if activation == "gelu_approximate":
        return tanh_gelu
    names = [n for n, ours in ACTIVATIONS.items() if ours == activation]
    return names[0] if names else activation


# --- LLaMA and its descendants ------------------------------------------------


def _llama_like(config, dtype, **features):
    """LLaMA, Mistral, Qwen2/3, Phi-3, SmolLM3: pre-norm RMS blocks with a
    gated feed-forward and rotary positions; `features` say what differs."""
    count, fused = config["num_hidden_layers"], features.get("fused", False)
    window = features.get("window", lambda c: c.get("sliding_window"))(config)
    types = _layer_types(config, count, features["windows"], window)
    no_rope = _no_rope_layers(config, count) if features.get("no_rope") else ()
    blocks = tuple(
        _llama_block(config, features, types[i] == SLIDING and window, i not in no_rope)
        for i in range(count)
    )
    if "adapt" in features:  # the sparse families' attention and experts
        blocks = tuple(features["adapt"](i, block) for i, block in enumerate(blocks))
    spec = DecoderLMSpec(
        vocabulary_size=config["vocab_size"],
        hidden_dim=config["hidden_size"],
        blocks=blocks,
        layer_norm_epsilon=float(config["rms_norm_eps"]),
        tie_weights=bool(config.get("tie_word_embeddings", features["tied"])),
        dropout=float(config.get("embd_pdrop", 0.0)) if fused else 0.0,  # Phi-3
        dtype=dtype,
    )
    return spec, _llama_links(spec, "model.", fused, features.get("sublayer_links"))


def _llama_block(config, features, window, rope):
    heads = config["num_attention_heads"]
    attention_bias = features.get("attention_bias")
    if attention_bias is None:  # families whose transformers model reads it
        attention_bias = bool(config.get("attention_bias", False))
    mlp_bias = features.get("mlp_bias")
    if mlp_bias is None:
        mlp_bias = bool(config.get("mlp_bias", False))
    block = dict(
        intermediate_dim=config["intermediate_size"],
        num_heads=heads,
        num_key_value_heads=config.get("num_key_value_heads", heads),
        key_dim=config.get("head_dim", config["hidden_size"] // heads),
        dropout=_attention_dropout(config, features.get("residual_dropout")),
        activation=_activation(config, "hidden_act"),
        layer_norm_epsilon=float(config["rms_norm_eps"]),
        normalize_first=True,
        normalization="rms_norm",
        gated_feedforward=True,
        use_bias=attention_bias,
        use_output_bias=features.get("output_bias", attention_bias),
        use_feedforward_bias=mlp_bias,
        sliding_window=window or None,
    )
    if features.get("qk_norm"):
        block.update(normalize_qk=True, qk_norm_epsilon=float(config["rms_norm_eps"]))
    if rope:
        block.update(rope_options(config))
    return block


def _llama_links(spec, prefix, fused, sublayer_links=None):
    """`sublayer_links(ours, theirs, block)`: the links of a block's
    attention and feed-forward (None: LLaMA's; the sparse families')."""
    if sublayer_links is None:

        def sublayer_links(ours, theirs, block):
            return _attention_links(ours, theirs, block, fused) + _feedforward_links(
                ours, theirs, block, fused
            )

    links = [link(f"{prefix}embed_tokens.weight", "token_embedding/embeddings")]
    for i, block in enumerate(spec.blocks):
        ours, theirs = f"transformer_layer_{i}/", f"{prefix}layers.{i}."
        links += sublayer_links(ours, theirs, block) + _norm_links(ours, theirs)
    links.append(link(f"{prefix}norm.weight", "final_norm/scale"))
    return links + _head_links(spec)


def _norm_links(ours, theirs):
    norms = {
        "input_layernorm": "self_attention_layer_norm",
        "post_attention_layernorm": "feedforward_layer_norm",
    }
    return [link(f"{theirs}{t}.weight", f"{ours}{o}/scale") for t, o in norms.items()]


def _head_links(spec):
    """A head of its own (Keras' `reverse_embeddings`), or none when tied."""
    if spec.tie_weights:
        return []
    return [link("lm_head.weight", "token_embedding/reverse_embeddings", LINEAR)]


def _attention_links(ours, theirs, block, fused, norm=SAME):
    ours, theirs = f"{ours}self_attention/", f"{theirs}self_attn."
    heads = {"q": f"{ours}query/", "k": f"{ours}key/", "v": f"{ours}value/"}
    if fused:  # Phi-3: one (q | k | v) matrix
        kernels = [path + "kernel" for path in heads.values()]
        links = [link(f"{theirs}qkv_proj.weight", kernels, LINEAR)]
    else:
        links = [
            link(f"{theirs}{p}_proj.weight", path + "kernel", LINEAR)
            for p, path in heads.items()
        ]
    if block["use_bias"]:
        links += [
            link(f"{theirs}{p}_proj.bias", path + "bias", BIAS)
            for p, path in heads.items()
        ]
    output = f"{ours}attention_output/kernel"
    links.append(link(f"{theirs}o_proj.weight", output, OUTPUT_LINEAR))
    if block["use_output_bias"]:
        links.append(link(f"{theirs}o_proj.bias", f"{ours}attention_output/bias"))
    if block.get("use_sink_logits"):  # gpt-oss
        links.append(link(f"{theirs}sinks", f"{ours}sink_logits"))
    if block.get("normalize_qk"):
        links += [
            link(f"{theirs}q_norm.weight", f"{ours}query_norm/scale", norm),
            link(f"{theirs}k_norm.weight", f"{ours}key_norm/scale", norm),
        ]
    return links


def _feedforward_links(ours, theirs, block, fused):
    dense = {
        name: f"{ours}feedforward_{part}_dense/"
        for name, part in (("gate", "gate"), ("up", "intermediate"), ("down", "output"))
    }
    theirs = f"{theirs}mlp."
    if fused:  # Phi-3: one (gate | up) matrix
        kernels = [dense["gate"] + "kernel", dense["up"] + "kernel"]
        links = [link(f"{theirs}gate_up_proj.weight", kernels, LINEAR)]
    else:
        links = [
            link(f"{theirs}{n}_proj.weight", dense[n] + "kernel", LINEAR)
            for n in ("gate", "up")
        ]
    links.append(link(f"{theirs}down_proj.weight", dense["down"] + "kernel", LINEAR))
    if block["use_feedforward_bias"]:
        links += [
            link(f"{theirs}{n}_proj.bias", path + "bias") for n, path in dense.items()
        ]
    return links


def _layer_types(config, count, windows, window):
    """Each layer's `"full_attention"` or `"sliding_attention"`, as the
    family's transformers model reads it: `windows` is `"all"` (one window
    everywhere, Mistral/Phi-3), `"none"` (the family reads no window,
    whatever the config lists), or transformers' rule (a function of the
    layer index) for configs written before `layer_types`, whose list wins
    where there is one. `window`: the window the sliding layers get."""
    types = config.get("layer_types")
    if windows in ("all", "none"):
        return [SLIDING if window and windows == "all" else FULL] * count
    if types is None:
        types = [windows(config, i) for i in range(count)]
    if len(types) != count or set(types) - {SLIDING, FULL}:
        config.refuse("layer_types", f"expected {count} of {FULL!r}/{SLIDING!r}.")
    if SLIDING in types and not window:
        config.refuse("layer_types", "sliding layers need a `sliding_window`.")
    return list(types)


def _qwen_window(config):
    """Qwen2/3's window: `sliding_window` with `use_sliding_window` alone
    (transformers sets it to None otherwise)."""
    config.get("max_window_layers")  # shaped `layer_types`; the list is read
    window = config.get("sliding_window")
    return window if config.get("use_sliding_window", False) else None


def _qwen_windows(config, i):
    """Qwen2/3 before `layer_types`: windows from `max_window_layers` on."""
    if _qwen_window(config) and i >= config["max_window_layers"]:
        return SLIDING
    return FULL


def _smollm3_windows(config, i):
    """SmolLM3 before `layer_types`: windows on its layers without rotary
    positions, with `use_sliding_window`."""
    count = config["num_hidden_layers"]
    without_rope = i in _no_rope_layers(config, count)
    flag = config.get("use_sliding_window", False)
    return SLIDING if flag and config.get("sliding_window") and without_rope else FULL


def _no_rope_layers(config, count):
    """SmolLM3's layers without rotary positions (0 in `no_rope_layers`)."""
    interval = config.get("no_rope_layer_interval", 4)
    flags = config.get("no_rope_layers")
    if flags is None:
        flags = [int((i + 1) % interval != 0) for i in range(count)]
    return {i for i, use in enumerate(flags) if not use}


def _attention_dropout(config, residual_key=None):
    """Our blocks drop attention weights and residual branches at one rate:
    the config's must agree (they act in training only)."""
    rate = float(config.get("attention_dropout", 0.0))
    if residual_key is not None and float(config.get(residual_key, 0.0)) != rate:
        config.refuse(
            residual_key,
            "keras_attn's blocks drop attention weights and residual branches "
            f"at one rate; attention_dropout is {rate}.",
        )
    return rate


def _activation(config, key, legacy_gelu=False):
    """The function `config[key]` names; Gemma 1's `legacy_gelu`: "gelu"
    names the tanh approximation there (transformers replaces it)."""
    name = config.get(key)
    if legacy_gelu and name == "gelu":
        return gelu_approximate
    if name not in ACTIVATIONS:
        config.refuse(key, f"the activations loaded are {sorted(ACTIVATIONS)}.")
    return ACTIVATIONS[name]


def _llama(config, dtype):
    return _llama_like(config, dtype, tied=False, windows="none")


def _fixed_biases(config, **biases):
    """The biases of a family whose transformers model has them fixed: its
    config's `attention_bias`/`mlp_bias`, if any, change nothing there."""
    config.get("attention_bias")
    config.get("mlp_bias")
    return {"attention_bias": False, "mlp_bias": False, **biases}


def _mistral(config, dtype):
    return _llama_like(
        config, dtype, tied=False, windows="all", **_fixed_biases(config)
    )


def _qwen2(config, dtype):
    biases = _fixed_biases(config, attention_bias=True, output_bias=False)
    return _llama_like(
        config, dtype, tied=False, windows=_qwen_windows, window=_qwen_window, **biases
    )


def _qwen3(config, dtype):
    return _llama_like(
        config, dtype, tied=False, qk_norm=True, mlp_bias=False,
        windows=_qwen_windows, window=_qwen_window,
    )  # fmt: skip


def _phi3(config, dtype):
    return _llama_like(
        config, dtype, tied=False, windows="all", fused=True,
        residual_dropout="resid_pdrop", **_fixed_biases(config),
    )  # fmt: skip


def _smollm3(config, dtype):
    """SmolLM3: windows where `layer_types` says (transformers' masks follow
    the list, with or without `use_sliding_window`), layers without rope."""
    config.get("use_sliding_window")  # shaped `layer_types`; the list is read
    return _llama_like(config, dtype, tied=True, no_rope=True, windows=_smollm3_windows)


# --- Gemma ----------------------------------------------------------------------


def _gemma_like(config, dtype, version):
    """Gemma 1, 2 and 3: GeGLU, RMS norms scaling by `1 + w` (ours hold
    `1 + w`, in float32), embeddings scaled by `sqrt(hidden_size)`; 2 and 3
    add post-sublayer norms and windows, 2 soft-caps, 3 QK-norm and a rotary
    base per layer type."""
    count = config["num_hidden_layers"]
    # transformers 5 writes `_sliding_window_pattern` beside `layer_types`
    # but reads `sliding_window_pattern` alone (default 6).
    config.get("_sliding_window_pattern")
    pattern = config.get("sliding_window_pattern") or 6
    rule = {
        1: "none",
        2: lambda c, i: SLIDING if i % 2 == 0 else FULL,
        3: lambda c, i: SLIDING if (i + 1) % pattern else FULL,
    }[version]
    window = config.get("sliding_window") if version > 1 else None
    types = _layer_types(config, count, rule, window)
    blocks = tuple(_gemma_block(config, version, t, window) for t in types)
    spec = DecoderLMSpec(
        vocabulary_size=config["vocab_size"],
        hidden_dim=config["hidden_size"],
        blocks=blocks,
        layer_norm_epsilon=float(config["rms_norm_eps"]),
        tie_weights=bool(config.get("tie_word_embeddings", True)),
        embedding_scale=float(config["hidden_size"] ** 0.5),
        final_logit_soft_cap=_cap(config, "final_logit_softcapping"),
        dtype=dtype,
    )
    return spec, _gemma_links(spec, version)


def _gemma_block(config, version, layer_type, window):
    heads = config["num_attention_heads"]
    bias = bool(config.get("attention_bias", False))
    if config.get("use_bidirectional_attention"):
        config.refuse("use_bidirectional_attention", "a causal LM attends causally.")
    block = dict(
        intermediate_dim=config["intermediate_size"],
        num_heads=heads,
        num_key_value_heads=config.get("num_key_value_heads", heads),
        key_dim=config["head_dim"],
        dropout=_attention_dropout(config),
        activation=_gemma_activation(config, version),
        layer_norm_epsilon=float(config["rms_norm_eps"]),
        normalize_first=True,
        normalization="rms_norm",
        gated_feedforward=True,
        use_bias=bias, use_output_bias=bias, use_feedforward_bias=False,
        normalize_sublayer_outputs=version > 1,
        sliding_window=window if layer_type == SLIDING else None,
        **rope_options(config, layer_type if version == 3 else None),
    )  # fmt: skip
    if version > 1:
        block.update(
            attention_scale=float(config["query_pre_attn_scalar"]) ** -0.5,
            logit_soft_cap=_cap(config, "attn_logit_softcapping"),
        )
    if version == 3:
        block.update(normalize_qk=True, qk_norm_epsilon=float(config["rms_norm_eps"]))
    return block


def _gemma_activation(config, version):
    """transformers' Gemma reads `hidden_act` ("gelu" there meant the tanh
    approximation), Gemma 2 and 3 `hidden_activation`; the other entry, if
    a config has it too, must name the same function."""
    key, other = ("hidden_act", "hidden_activation")[:: 1 if version == 1 else -1]
    activation = _activation(config, key, legacy_gelu=version == 1)
    if config.get(other) is not None:
        if _activation(config, other, legacy_gelu=version == 1) is not activation:
            config.refuse(other, f"the {config.family} model reads `{key}` alone.")
    return activation


def _cap(config, key):
    value = config.get(key)
    return None if value is None else float(value)


def _gemma_links(spec, version):
    links = [link("model.embed_tokens.weight", "token_embedding/embeddings")]
    for i, block in enumerate(spec.blocks):
        ours, theirs = f"transformer_layer_{i}/", f"model.layers.{i}."
        links += _attention_links(ours, theirs, block, False, PLUS_ONE)
        links += _feedforward_links(ours, theirs, block, False)
        norms = {"input_layernorm": "self_attention_layer_norm"}
        if version == 1:
            norms["post_attention_layernorm"] = "feedforward_layer_norm"
        else:
            norms.update(
                post_attention_layernorm="self_attention_output_norm",
                pre_feedforward_layernorm="feedforward_layer_norm",
                post_feedforward_layernorm="feedforward_output_norm",
            )
        links += [
            link(f"{theirs}{t}.weight", f"{ours}{o}/scale", PLUS_ONE)
            for t, o in norms.items()
        ]
    links.append(link("model.norm.weight", "final_norm/scale", PLUS_ONE))
    return links + _head_links(spec)


# --- GPT-2 ------------------------------------------------------------------------


def _gpt2(config, dtype):
    """GPT-2: post-2019 pre-norm blocks with biases, tanh-GELU, learned
    positions, the token table as head."""
    for key, expected in (
        ("scale_attn_weights", True),
        ("scale_attn_by_inverse_layer_idx", False),
        ("add_cross_attention", False),
    ):
        config.require(key, expected, f"keras_attn's GPT-2 has {key}={expected}.")
    config.get("reorder_and_upcast_attn")  # softmax is in float32 here anyway
    width, rate = config["n_embd"], float(config.get("attn_pdrop", 0.0))
    config.require("resid_pdrop", rate, f"our blocks drop at one rate ({rate}).")
    block = dict(
        intermediate_dim=config.get("n_inner") or 4 * width,
        num_heads=config["n_head"],
        dropout=rate,
        activation=_activation(config, "activation_function"),
        layer_norm_epsilon=float(config["layer_norm_epsilon"]),
        normalize_first=True,
    )
    spec = DecoderLMSpec(
        vocabulary_size=config["vocab_size"],
        hidden_dim=width,
        blocks=(block,) * config["n_layer"],
        normalization="layer_norm",
        layer_norm_epsilon=float(config["layer_norm_epsilon"]),
        use_bias=True,
        tie_weights=bool(config.get("tie_word_embeddings", True)),
        positions=config["n_positions"],
        dropout=float(config.get("embd_pdrop", 0.0)),
        dtype=dtype,
    )
    if not spec.tie_weights:
        config.refuse("tie_word_embeddings", "GPT-2's head is its token table.")
    return spec, _gpt2_links(spec)


CONV = Layout("flat", 1)  # GPT-2's Conv1D: (in, out)
CONV_OUTPUT = Layout("flat", 2)


def _gpt2_links(spec):
    links = [
        link("transformer.wte.weight", "token_embedding/embeddings"),
        link("transformer.wpe.weight", "position_embedding/embeddings"),
        link("transformer.ln_f.weight", "final_norm/gamma"),
        link("transformer.ln_f.bias", "final_norm/beta"),
    ]
    for i in range(len(spec.blocks)):
        ours, theirs = f"transformer_layer_{i}/", f"transformer.h.{i}."
        attention, output = f"{ours}self_attention/", f"{theirs}attn.c_proj."
        qkv = [f"{attention}{p}/" for p in ("query", "key", "value")]
        links += [
            link(f"{theirs}attn.c_attn.weight", [p + "kernel" for p in qkv], CONV, 1),
            link(f"{theirs}attn.c_attn.bias", [p + "bias" for p in qkv], BIAS),
            link(output + "weight", attention + "attention_output/kernel", CONV_OUTPUT),
            link(output + "bias", attention + "attention_output/bias"),
        ]
        for n, dense in (("c_fc", "intermediate"), ("c_proj", "output")):
            links += [
                link(f"{theirs}mlp.{n}.{w}", f"{ours}feedforward_{dense}_dense/{k}")
                for w, k in (("weight", "kernel"), ("bias", "bias"))
            ]
        for n, norm in (("ln_1", "self_attention"), ("ln_2", "feedforward")):
            links += [
                link(f"{theirs}{n}.weight", f"{ours}{norm}_layer_norm/gamma"),
                link(f"{theirs}{n}.bias", f"{ours}{norm}_layer_norm/beta"),
            ]
    return links


DENSE_FAMILIES = {
    "gpt2": _gpt2,
    "llama": _llama,
    "mistral": _mistral,
    "qwen2": _qwen2,
    "qwen3": _qwen3,
    "phi3": _phi3,
    "smollm3": _smollm3,
    "gemma": lambda config, dtype: _gemma_like(config, dtype, 1),
    "gemma2": lambda config, dtype: _gemma_like(config, dtype, 2),
    "gemma3_text": lambda config, dtype: _gemma_like(config, dtype, 3),
}
