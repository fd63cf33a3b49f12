"""`from_hugging_face` on unusual config.json entries: an unknown family, an
entry nobody computes, each maths option we cannot compute and a dtype that
is not a float policy raise a clear error, by name, before any weight is
read; the layouts transformers also reads (transformers 4's `rope_scaling`,
scaled rotary positions, windows placed by a family's rule or list, Gemma 3
before `layer_types`, Gemma's legacy `hidden_act`, absent entries as its
class defaults) load to transformers' logits.

Each tiny folder is written once per module and copied per test."""

import os
import re

import keras
import numpy as np
import pytest

from keras_attn.models import from_hugging_face
from tests.helpers.backend import to_numpy
from tests.helpers.hugging_face import (
    DELETE,
    GEMMA,
    LLAMA,
    TINY,
    assert_same_logits,
    edit_config,
    model_logits,
    our_logits,
    their_logits,
    write_tiny,
)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_numpy = pytest.importorskip("safetensors.numpy")

LINEAR_ROPE = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
SLIDING, FULL = "sliding_attention", "full_attention"
IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)  # within the vocabulary
# The tiny folders of this module alone: (config class, arguments).
LAYOUTS = {
    **TINY,
    "gemma": ("GemmaConfig", GEMMA),
    "gemma3": (
        "Gemma3TextConfig",
        dict(GEMMA, num_hidden_layers=3, sliding_window=4, query_pre_attn_scalar=12),
    ),
    "qwen2": (  # transformers writes layer_types [full, sliding, sliding]
        "Qwen2Config",
        dict(
            LLAMA,
            num_hidden_layers=3,
            use_sliding_window=True,
            sliding_window=3,
            max_window_layers=1,
        ),
    ),
    "smollm3": (  # transformers writes layer_types [full, sliding] * 2
        "SmolLM3Config",
        dict(
            LLAMA,
            num_hidden_layers=4,
            no_rope_layers=[1, 0, 1, 0],
            use_sliding_window=True,
            sliding_window=3,
            **IDS,
        ),
    ),
}
FAMILIES_WE_LOAD = (
    "gemma", "gemma2", "gemma3_text", "gpt2", "llama",
    "mistral", "phi3", "qwen2", "qwen3", "smollm3",
)  # fmt: skip


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """name: (folder, transformers model), each written once."""
    return {
        name: write_tiny(tmp_path_factory, name, *layout)
        for name, layout in LAYOUTS.items()
    }


# --- Families and entries refused -----------------------------------------------


@pytest.mark.parametrize("model_type", ["bert", None])
def test_an_unknown_model_type_lists_ours(model_type, copy, no_weight_reads):
    folder = edit_config(copy("llama"), model_type=model_type)
    with pytest.raises(ValueError, match=f"Received: model_type={model_type!r}") as e:
        from_hugging_face(folder)
    for family in FAMILIES_WE_LOAD:
        assert repr(family) in str(e.value)


def test_a_config_entry_nobody_reads(copy, no_weight_reads):
    folder = edit_config(copy("llama"), new_option=3)
    with pytest.raises(ValueError, match=r"entries \['new_option'\] \(values \[3\]"):
        from_hugging_face(folder)


# (folder, config changes, the error's words)
REFUSED = {
    "dynamic rope": (
        "llama",
        dict(rope_parameters={**LINEAR_ROPE, "rope_type": "dynamic"}),
        r"rope_parameters=\{'rope_type': 'dynamic'.*dynamic NTK",
    ),
    "longrope": (
        "llama",
        dict(
            rope_parameters=dict(
                rope_type="longrope",
                rope_theta=1e4,
                short_factor=[1.0] * 3,
                long_factor=[2.0] * 3,
                original_max_position_embeddings=16,
            )
        ),
        r"rope_type': 'longrope'.*no per-channel factors",
    ),
    "an unknown rope type": (
        "llama",
        dict(rope_parameters={**LINEAR_ROPE, "rope_type": "su"}),
        "rope_type 'su' is not one of",
    ),
    "partial rotary factor in rope_parameters": (
        "llama",
        dict(rope_parameters={**LINEAR_ROPE, "partial_rotary_factor": 0.5}),
        "partial_rotary_factor=0.5: keras_attn rotates every channel",
    ),
    "partial rotary factor at the top": (
        "llama",
        dict(partial_rotary_factor=0.5),
        "partial_rotary_factor=0.5: keras_attn rotates every channel",
    ),
    "an unknown rope key": (
        "llama",
        dict(rope_parameters={**LINEAR_ROPE, "low_freq_factor": 1.0}),
        r"its entries \['low_freq_factor'\] are not computed here",
    ),
    "rope_parameters and rope_scaling": (
        "llama",
        dict(rope_scaling={"type": "linear", "factor": 2.0}),
        "rope_scaling=.*the config also has `rope_parameters`",
    ),
    "an unknown hidden_act": (
        "llama",
        dict(hidden_act="mish"),
        r"hidden_act='mish': the activations loaded are \[",
    ),
    "an unknown GPT-2 activation": (
        "gpt2",
        dict(activation_function="quick_gelu"),
        "activation_function='quick_gelu'",
    ),
    "GPT-2 scaled by the inverse layer index": (
        "gpt2",
        dict(scale_attn_by_inverse_layer_idx=True),
        "scale_attn_by_inverse_layer_idx=True: keras_attn's GPT-2 has "
        "scale_attn_by_inverse_layer_idx=False",
    ),
    "GPT-2 unscaled attention": (
        "gpt2",
        dict(scale_attn_weights=False),
        "scale_attn_weights=False",
    ),
    "GPT-2 with cross-attention": (
        "gpt2",
        dict(add_cross_attention=True),
        "add_cross_attention=True",
    ),
    "GPT-2 with its own head": (
        "gpt2",
        dict(tie_word_embeddings=False),
        "tie_word_embeddings=False: GPT-2's head is its token table",
    ),
    "GPT-2 dropping residuals at another rate": (
        "gpt2",
        dict(resid_pdrop=0.3),
        r"resid_pdrop=0.3: our blocks drop at one rate \(0.1\)",
    ),
    "Gemma attending both ways": (
        "gemma2",
        dict(use_bidirectional_attention=True),
        "use_bidirectional_attention=True: a causal LM attends causally",
    ),
    "Gemma 2 with a hidden_act it does not read": (
        "gemma2",
        dict(hidden_act="silu"),
        "hidden_act='silu': the gemma2 model reads `hidden_activation` alone",
    ),
    "layer types of the wrong count": (
        "gemma2",
        dict(layer_types=["full_attention"]),
        "layer_types=.*expected 2 of 'full_attention'/'sliding_attention'",
    ),
    "sliding layers without a window": (
        "gemma2",
        dict(sliding_window=None, layer_types=["sliding_attention"] * 2),
        "sliding layers need a `sliding_window`",
    ),
    # transformers sets Qwen2's window to None without the flag, then fails
    # on the sliding layers listed.
    "Qwen2's sliding layers without use_sliding_window": (
        "qwen2",
        dict(use_sliding_window=False),
        r"layer_types=\['full_attention', 'sliding_attention', 'sliding_attention'"
        r"\]: sliding layers need a `sliding_window`",
    ),
    "Gemma's legacy gelu beside another hidden_activation": (
        "gemma",
        dict(hidden_act="gelu", hidden_activation="relu"),
        "hidden_activation='relu': the gemma model reads `hidden_act` alone",
    ),
}


@pytest.mark.parametrize("case", REFUSED)
def test_a_config_entry_we_cannot_compute_is_refused(case, copy, no_weight_reads):
    name, changes, match = REFUSED[case]
    folder = edit_config(copy(name), **changes)
    with pytest.raises(ValueError, match=f"cannot load .*{match}"):
        from_hugging_face(folder)


# --- Layouts honoured ----------------------------------------------------------


def test_transformers_4_rope_scaling_is_honoured(copy, saved):
    """`rope_theta` + `rope_scaling={"type": ...}` computes what transformers
    5's `rope_parameters` computes, and the scaling does change the logits."""
    old = edit_config(
        copy("llama", "old"),
        rope_parameters=DELETE,
        rope_theta=10000.0,
        rope_scaling={"type": "linear", "factor": 2.0},
    )
    new = edit_config(copy("llama", "new"), rope_parameters=LINEAR_ROPE)
    logits = our_logits(old)
    np.testing.assert_array_equal(logits, our_logits(new))
    assert_same_logits(logits, their_logits(old))
    unscaled = our_logits(saved["llama"][0])
    assert np.abs(logits - unscaled).max() > 1e-2 * np.abs(unscaled).max()


SCALED_ROPE = {
    "yarn": dict(
        rope_parameters=dict(
            rope_type="yarn", rope_theta=1e4, factor=4.0,
            original_max_position_embeddings=8, beta_fast=8.0, beta_slow=1.0,
        ),
    ),
    "yarn with DeepSeek's mscale ratio": dict(
        rope_parameters=dict(
            rope_type="yarn", rope_theta=1e4, factor=4.0,
            original_max_position_embeddings=8, mscale=0.7, mscale_all_dim=1.0,
        ),
    ),
    "yarn with an attention factor of its own, untruncated": dict(
        rope_parameters=dict(
            rope_type="yarn", rope_theta=1e4, factor=4.0, attention_factor=1.5,
            original_max_position_embeddings=8, beta_fast=8.0, truncate=False,
        ),
    ),
    # Phi-3's layout: transformers prefers the length beside the dict.
    "llama3 with the pretraining length at the top": dict(
        original_max_position_embeddings=16,
        rope_parameters=dict(
            rope_type="llama3", rope_theta=1e4, factor=4.0,
            original_max_position_embeddings=8,
            low_freq_factor=1.0, high_freq_factor=4.0,
        ),
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", SCALED_ROPE)
def test_scaled_rope_is_honoured(case, copy):
    folder = edit_config(copy("llama"), **SCALED_ROPE[case])
    assert_same_logits(our_logits(folder), their_logits(folder))


# case: (folder, config changes, each block's window as transformers reads it)
WINDOWS = {
    "SmolLM3, use_sliding_window without layer_types: on its no-rope layers": (
        "smollm3",
        dict(layer_types=DELETE),
        [None, 3, None, 3],
    ),
    "SmolLM3, layer_types without use_sliding_window: its masks follow the list": (
        "smollm3",
        dict(use_sliding_window=False, layer_types=[SLIDING, FULL, FULL, SLIDING]),
        [3, None, None, 3],
    ),
    "Qwen2, use_sliding_window without layer_types: from max_window_layers on": (
        "qwen2",
        dict(layer_types=DELETE),
        [None, 3, 3],
    ),
    # transformers 4: rope_theta, rope_local_base_freq, rope_scaling for the
    # global layers, sliding_window_pattern, no layer_types.
    "Gemma 3 in transformers 4's layout": (
        "gemma3",
        dict(
            rope_parameters=DELETE,
            layer_types=DELETE,
            _sliding_window_pattern=DELETE,
            sliding_window_pattern=2,
            rope_theta=1e4,
            rope_local_base_freq=100.0,
            rope_scaling={"rope_type": "linear", "factor": 4.0},
        ),
        [4, None, 4],
    ),
    # transformers 5 writes `_sliding_window_pattern`; it reads the public one.
    "Gemma 3, both patterns: sliding_window_pattern wins": (
        "gemma3",
        dict(layer_types=DELETE, _sliding_window_pattern=3, sliding_window_pattern=2),
        [4, None, 4],
    ),
    "Gemma 3, _sliding_window_pattern alone: the default 6": (
        "gemma3",
        dict(layer_types=DELETE, _sliding_window_pattern=2),
        [4, 4, 4],
    ),
}


@pytest.mark.parametrize("case", WINDOWS)
def test_windows_where_transformers_puts_them(case, copy):
    """Tokens longer than the window: a window misplaced changes the logits."""
    name, changes, windows = WINDOWS[case]
    folder = edit_config(copy(name), **changes)
    model = from_hugging_face(folder, dtype="float32")
    blocks = [b for b in model.layers if b.name.startswith("transformer_layer_")]
    assert [block.sliding_window for block in blocks] == windows
    assert_same_logits(model_logits(model), their_logits(folder))


def legacy_gelu_is_tanh():
    """Whether this transformers reads Gemma's legacy `hidden_act="gelu"` as
    the tanh approximation, as the official releases mean it (transformers
    #29402); 5.17 computed the exact gelu there."""
    config = transformers.GemmaConfig(hidden_act="gelu")
    return config.hidden_act == "gelu_pytorch_tanh"


def test_gemma_legacy_gelu_beside_hidden_activation(copy):
    """Gemma 1's `hidden_act="gelu"` is transformers' tanh approximation, the
    function `hidden_activation="gelu_pytorch_tanh"` names too."""
    folder = edit_config(
        copy("gemma"), hidden_act="gelu", hidden_activation="gelu_pytorch_tanh"
    )
    model = from_hugging_face(folder, dtype="float32")
    activation = model.get_layer("transformer_layer_0").get_config()["activation"]
    assert "gelu_approximate" in str(activation)
    if not legacy_gelu_is_tanh():  # the same function, named as 5.17 reads it
        folder = edit_config(folder, hidden_act="gelu_pytorch_tanh")
    assert_same_logits(model_logits(model), their_logits(folder))


@pytest.mark.parametrize(
    "entry, caps",
    [(DELETE, (30.0, 50.0)), (None, (None, None))],
    ids=["absent: transformers' class defaults", "null: none"],
)
def test_an_absent_entry_takes_transformers_default(entry, caps, copy):
    """Gemma 2's soft-caps: absent means Gemma2Config's 30 (logits) and 50
    (attention scores), null means no cap."""
    folder = edit_config(
        copy("gemma2"), final_logit_softcapping=entry, attn_logit_softcapping=entry
    )
    model = from_hugging_face(folder, dtype="float32")
    read = (
        model.get_layer("token_embedding").logit_soft_cap,
        model.get_layer("transformer_layer_0").logit_soft_cap,
    )
    assert read == caps
    assert_same_logits(model_logits(model), their_logits(folder))


# --- dtype ---------------------------------------------------------------------


def test_gemma_in_bfloat16_variables_is_refused(saved, no_weight_reads):
    with pytest.raises(ValueError, match="Received: dtype='bfloat16'. Pass dtype="):
        from_hugging_face(saved["gemma2"][0], dtype="bfloat16")


def test_gemma_in_mixed_bfloat16_loads(saved):
    """float32 variables keep `1 + w` whole; the arithmetic is bfloat16."""
    folder = saved["gemma2"][0]
    model = from_hugging_face(folder, dtype="mixed_bfloat16")
    layers = [layer for layer in model.layers if layer.weights]
    assert {layer.dtype_policy.name for layer in layers} == {"mixed_bfloat16"}
    assert {keras.backend.standardize_dtype(v.dtype) for v in model.weights} == {
        "float32"
    }
    w = safetensors_numpy.load_file(os.path.join(folder, "model.safetensors"))
    w = w["model.layers.1.post_feedforward_layernorm.weight"]
    variables = {v.path: v for v in model.weights}
    scale = variables["transformer_layer_1/feedforward_output_norm/scale"]
    np.testing.assert_array_equal(to_numpy(scale), w + np.float32(1.0))


@pytest.mark.parametrize("dtype", ["int32", "int8_from_float32", "float8_e4m3fn", 3])
def test_a_dtype_that_is_not_a_float_policy_is_refused(dtype, saved, no_weight_reads):
    with pytest.raises(
        ValueError,
        match=rf"`dtype` must be None .* Received: dtype={re.escape(repr(dtype))}\.",
    ):
        from_hugging_face(saved["llama"][0], dtype=dtype)


# The YaRN settings of released checkpoints (head width 64 in both):
# gpt-oss's and DeepSeek-V3's (`mscale` equal to `mscale_all_dim`: no factor
# on cos and sin, the attention's scale takes it), and a ratio other than 1.
YARN_RELEASED = {
    "gpt-oss": dict(
        factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
        original_max_position_embeddings=4096, rope_theta=150000.0,
    ),
    "DeepSeek-V3": dict(
        factor=40.0, beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0,
        original_max_position_embeddings=4096, rope_theta=10000.0,
    ),
    "DeepSeek's mscale 0.7": dict(
        factor=40.0, beta_fast=32, beta_slow=1, mscale=0.7, mscale_all_dim=1.0,
        original_max_position_embeddings=4096, rope_theta=10000.0,
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", YARN_RELEASED)
def test_yarn_of_released_checkpoints_rotates_as_transformers(case):
    """Our reading of each YaRN config rotates as transformers'
    `ROPE_INIT_FUNCTIONS["yarn"]` (its inverse frequencies and its factor of
    cos and sin, applied as its rotary layers apply them, in float32)."""
    from keras_attn.models.hugging_face._config import HFConfig
    from keras_attn.models.hugging_face._rope import rope_options
    from keras_attn.ops import rotary_embedding

    rope = dict(rope_type="yarn", **YARN_RELEASED[case])
    sizes = dict(hidden_size=128, num_attention_heads=2, head_dim=64)
    config = transformers.LlamaConfig(
        **sizes, max_position_embeddings=131072, rope_parameters=dict(rope)
    )
    init = transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS["yarn"]
    inverse_frequency, factor = init(config, "cpu")
    positions = torch.tensor([0.0, 1.0, 5.0, 63.0, 200.0, 1000.0])
    angles = positions[:, None] * inverse_frequency[None, :]  # (T, D/2)
    angles = torch.cat([angles, angles], dim=-1)[None, :, None, :]
    x = np.random.default_rng(0).uniform(-1, 1, (1, 6, 3, 64)).astype("float32")
    x_t = torch.from_numpy(x)
    rotated = torch.cat([-x_t[..., 32:], x_t[..., :32]], dim=-1)
    theirs = x_t * angles.cos() * factor + rotated * angles.sin() * factor

    ours = rope_options(
        HFConfig(dict(model_type="llama", **sizes, rope_parameters=rope))
    )
    y = rotary_embedding(
        x, positions.numpy(), ours["rope_max_wavelength"], scaling=ours["rope_scaling"]
    )
    np.testing.assert_allclose(to_numpy(y), theirs.numpy(), atol=2e-5)
    ratio = (0.07 * np.log(40) + 1) / (0.1 * np.log(40) + 1)  # mscale 0.7
    expected = {"gpt-oss": 0.1 * np.log(32) + 1, "DeepSeek-V3": 1.0}
    assert factor == pytest.approx(expected.get(case, ratio))
