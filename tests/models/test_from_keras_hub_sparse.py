"""keras-hub's mixture-of-experts language models converted (Mixtral,
Qwen3-MoE, gpt-oss): the same logits, the same greedy tokens as a greedy
loop over keras-hub's own logits, a `.keras` reload with the same logits;
the entries keras_attn cannot compute raise."""

import os

import keras
import numpy as np
import pytest

import keras_attn
from keras_attn.models import from_keras_hub
from tests.helpers.backend import to_numpy
from tests.helpers.hugging_face import assert_same_logits
from tests.helpers.keras_hub import hub_greedy, hub_logits, seeded_backbone

keras_hub = pytest.importorskip("keras_hub")

VOCABULARY = 61
SMALL = dict(
    vocabulary_size=VOCABULARY,
    hidden_dim=16,
    num_query_heads=4,
    num_key_value_heads=2,
    num_experts=5,
)
QWEN3_MOE = dict(
    **SMALL, head_dim=8, intermediate_dim=24, moe_intermediate_dim=6, top_k=3
)
# family: (keras-hub backbone class, its arguments). Windows shorter than the
# 11 tokens, rotary scaling, distinct widths (experts 6, heads 4 or 8 wide).
FAMILIES = {
    "mixtral": (
        "MixtralBackbone",
        dict(
            **SMALL,
            num_layers=2,
            intermediate_dim=6,
            top_k=2,
            sliding_window=4,
            rope_scaling_factor=2.0,
        ),
    ),
    # Blocks dense, sparse, sparse; then dense (not a multiple of the step),
    # sparse, the top 3 of 5 renormalized.
    "qwen3_moe": (
        "Qwen3MoeBackbone",
        dict(**QWEN3_MOE, num_layers=3, mlp_only_layers=[0], layer_norm_epsilon=0.3),
    ),
    "qwen3_moe_step2": (
        "Qwen3MoeBackbone",
        dict(
            **QWEN3_MOE,
            num_layers=2,
            decoder_sparse_step=2,
            norm_top_k_prob=True,
            tie_word_embeddings=True,
        ),
    ),
    # YaRN of factor 4: some of the 6-wide heads' channel pairs interpolate.
    "gpt_oss": (
        "GptOssBackbone",
        dict(
            **SMALL,
            num_layers=2,
            head_dim=6,
            intermediate_dim=6,
            top_k=2,
            sliding_window=3,
            rope_scaling_factor=4.0,
        ),
    ),
}
CAUSAL_LMS = {
    "mixtral": "MixtralCausalLM",
    "qwen3_moe": "Qwen3MoeCausalLM",
    "gpt_oss": "GptOssCausalLM",
}
TOKENS = np.random.default_rng(2).integers(1, VOCABULARY, (2, 11)).astype("int32")
PROMPT, NEW_TOKENS = 5, 8


# gpt-oss's experts' gate and up, 30 times larger: many beyond its clamp at 7.
SCALED = {"gpt_oss": ("gate_up_proj", 30.0)}


def hub_backbone(family, **overrides):
    cls, kwargs = FAMILIES[family]
    backbone = seeded_backbone(getattr(keras_hub.models, cls), {**kwargs, **overrides})
    suffix, factor = SCALED.get(family, (None, 1.0))
    for weight in backbone.weights:
        if suffix and weight.path.endswith(suffix):
            weight.assign(weight * factor)
    return backbone


@pytest.fixture(scope="module")
def converted():
    """`converted(family)`: keras-hub's backbone and our model, built once."""
    built = {}

    def get(family):
        if family not in built:
            backbone = hub_backbone(family)
            built[family] = backbone, from_keras_hub(backbone)
        return built[family]

    return get


@pytest.mark.parametrize("family", FAMILIES)
def test_converted_logits_equal_keras_hub(family, converted):
    backbone, model = converted(family)
    assert_same_logits(to_numpy(model(TOKENS)), hub_logits(backbone, TOKENS))


# Decoding and saving once per family (not again for Qwen3-MoE's variant).
@pytest.mark.parametrize("family", CAUSAL_LMS)
def test_greedy_tokens_and_reload_equal_keras_hub(family, converted, tmp_path):
    backbone, model = converted(family)
    prompt = TOKENS[:, :PROMPT]
    tokens = keras_attn.generation.generate(model, prompt, max_new_tokens=NEW_TOKENS)
    np.testing.assert_array_equal(tokens, hub_greedy(backbone, prompt, NEW_TOKENS))

    path = os.path.join(tmp_path, f"{family}.keras")
    model.save(path)
    reloaded = keras.models.load_model(path)
    np.testing.assert_array_equal(to_numpy(reloaded(TOKENS)), to_numpy(model(TOKENS)))


@pytest.mark.parametrize("family", CAUSAL_LMS)
def test_a_causal_lm_converts_as_its_backbone(family, converted):
    backbone, model = converted(family)
    causal_lm = getattr(keras_hub.models, CAUSAL_LMS[family])(
        backbone=backbone, preprocessor=None
    )
    expected = to_numpy(
        causal_lm({"token_ids": TOKENS, "padding_mask": np.ones_like(TOKENS)})
    )
    assert_same_logits(to_numpy(from_keras_hub(causal_lm)(TOKENS)), expected)


def _sparse_blocks(model):
    paths = {w.path for w in model.weights}
    return [
        f"transformer_layer_{i}/feedforward/router/kernel" in paths
        for i in range(sum(p.endswith("self_attention/query/kernel") for p in paths))
    ]


@pytest.mark.parametrize(
    "family, sparse",
    [("qwen3_moe", [False, True, True]), ("qwen3_moe_step2", [False, True])],
)
def test_qwen3_moe_blocks_are_sparse_where_keras_hub_puts_experts(
    family, sparse, converted
):
    assert _sparse_blocks(converted(family)[1]) == sparse


def test_gpt_oss_windows_are_on_odd_blocks_one_key_wider():
    """keras-hub's gpt-oss window of 3 lets a query see itself and 3 keys
    before it (Hugging Face's, the even blocks, 2 before it)."""
    model = from_keras_hub(hub_backbone("gpt_oss", num_layers=3))
    windows = [
        layer.sliding_window
        for layer in model.layers
        if isinstance(layer, keras_attn.TransformerDecoder)
    ]
    assert windows == [None, 4, None]


@pytest.mark.parametrize(
    "family, overrides, named",
    [
        ("mixtral", dict(router_jitter_noise=0.1), "router_jitter_noise=0.1"),
        ("gpt_oss", dict(head_dim=5), "head_dim=5"),
    ],
)
def test_an_entry_our_layers_lack_raises_naming_it(family, overrides, named):
    cls, kwargs = FAMILIES[family]
    backbone = getattr(keras_hub.models, cls)(**{**kwargs, **overrides})
    with pytest.raises(ValueError, match=named):
        from_keras_hub(backbone)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_training_adds_keras_hub_load_balancing_losses(family, converted):
    """keras-hub's router auxiliary loss (a mean over the k slots) is ours
    with the coefficient divided by k (a sum over them), one per sparse
    block."""
    backbone, model = converted(family)
    backbone({"token_ids": TOKENS, "padding_mask": np.ones_like(TOKENS)}, training=True)
    expected = sorted(float(to_numpy(loss)) for loss in backbone.losses)
    model(TOKENS, training=True)
    actual = sorted(float(to_numpy(loss)) for loss in model.losses)
    assert len(expected) == sum(_sparse_blocks(model))
    np.testing.assert_allclose(actual, expected, rtol=1e-5)
