"""keras-hub's language models converted: the same logits, the same greedy
tokens as a greedy loop over keras-hub's own logits, and a `.keras` reload
with the same logits; options we cannot compute exactly raise."""

import os
import re

import keras
import numpy as np
import pytest

import keras_attn
from keras_attn.generation.prompts import check_positions
from keras_attn.models import from_keras_hub
from tests.helpers.backend import to_numpy
from tests.helpers.keras_hub import hub_greedy, hub_logits, seeded_backbone

keras_hub = pytest.importorskip("keras_hub")

VOCABULARY = 61
SMALL = dict(vocabulary_size=VOCABULARY, num_layers=2, hidden_dim=16)
LLAMA_LIKE = dict(
    **SMALL, num_query_heads=4, num_key_value_heads=2, intermediate_dim=24
)
GEMMA = dict(**SMALL, num_query_heads=4, num_key_value_heads=2, head_dim=8)
GEMMA_2 = dict(
    **GEMMA,
    intermediate_dim=48,
    use_post_attention_norm=True,
    use_post_ffw_norm=True,
    attention_logit_soft_cap=3.0,
    final_logit_soft_cap=5.0,
    use_sliding_window_attention=True,
    sliding_window_size=3,
)
LLAMA_3_1 = dict(  # bands of 4 and 16 positions: every head dim in some band
    rope_frequency_adjustment_factor=8.0,
    rope_low_freq_factor=1.0,
    rope_high_freq_factor=4.0,
    rope_pretraining_sequence_length=16,
)
# family: (keras-hub backbone class, its arguments)
FAMILIES = {
    "gpt2": (
        "GPT2Backbone",
        dict(**SMALL, num_heads=2, intermediate_dim=32, max_sequence_length=24),
    ),
    "llama3.1": (
        "Llama3Backbone",
        dict(**LLAMA_LIKE, **LLAMA_3_1, tie_word_embeddings=True),
    ),
    "mistral": (
        "MistralBackbone",
        dict(**LLAMA_LIKE, sliding_window=3, head_dim=8, rope_scaling_factor=2.0),
    ),
    # keras-hub's Gemma blocks keep their norms' epsilon (1e-6): the config's
    # reaches the final norm only.
    "gemma": (
        "GemmaBackbone",
        dict(**GEMMA, intermediate_dim=48, layer_norm_epsilon=0.3),
    ),
    "gemma2": ("GemmaBackbone", GEMMA_2),
    # keras-hub's Qwen3 QK-norms keep their epsilon (1e-5).
    "qwen3": (
        "Qwen3Backbone",
        dict(
            **LLAMA_LIKE, head_dim=8, tie_word_embeddings=False, layer_norm_epsilon=0.3
        ),
    ),
}
PROMPT, NEW_TOKENS = 5, 6


def hub_backbone(family, **overrides):
    """A small keras-hub backbone of `family` with random weights large
    enough that every option changes the logits."""
    cls, kwargs = FAMILIES[family]
    return seeded_backbone(getattr(keras_hub.models, cls), {**kwargs, **overrides})


def assert_same_logits(actual, expected):
    """1e-4 of the logits' scale (float32)."""
    scale = np.abs(expected).max()
    np.testing.assert_allclose(actual, expected, rtol=1e-4, atol=1e-4 * scale)


@pytest.mark.parametrize("family", FAMILIES)
def test_converted_logits_tokens_and_reload_equal_keras_hub(family, tmp_path):
    backbone = hub_backbone(family)
    token_ids = np.random.default_rng(2).integers(1, VOCABULARY, (2, 11))
    token_ids = token_ids.astype("int32")
    model = from_keras_hub(backbone)
    expected = hub_logits(backbone, token_ids)
    assert_same_logits(to_numpy(model(token_ids)), expected)

    prompt = token_ids[:, :PROMPT]
    tokens = keras_attn.generation.generate(model, prompt, max_new_tokens=NEW_TOKENS)
    np.testing.assert_array_equal(tokens, hub_greedy(backbone, prompt, NEW_TOKENS))

    path = os.path.join(tmp_path, f"{family}.keras")
    model.save(path)
    reloaded = keras.models.load_model(path)
    np.testing.assert_array_equal(
        to_numpy(reloaded(token_ids)), to_numpy(model(token_ids))
    )


def test_left_padded_prompts_decode_as_each_row_alone():
    """Learned positions start at each row's first real token."""
    backbone = hub_backbone("gpt2")
    model = from_keras_hub(backbone)
    prompts = [[5, 6, 7, 8, 9], [11, 12]]
    tokens = keras_attn.generation.generate(model, prompts, max_new_tokens=3)
    for row, prompt in zip(tokens, prompts, strict=True):
        alone = hub_greedy(backbone, np.array([prompt], "int32"), 3)[0]
        np.testing.assert_array_equal(row[: len(alone)], alone)


def test_qwen3_converts_without_a_sliding_window():
    """keras-hub 0.32 applies Qwen3's window only on TensorFlow; the
    converted model, as keras-hub on JAX and PyTorch, has none."""
    backbone = hub_backbone("qwen3", sliding_window_size=3)
    token_ids = np.arange(1, 9, dtype="int32")[None]
    if keras.config.backend() == "tensorflow":
        with pytest.warns(UserWarning, match="sliding_window_size=3"):
            model = from_keras_hub(backbone)
    else:
        model = from_keras_hub(backbone)
        assert_same_logits(to_numpy(model(token_ids)), hub_logits(backbone, token_ids))
    assert all(
        layer.sliding_window is None
        for layer in model.layers
        if isinstance(layer, keras_attn.TransformerDecoder)
    )


def test_a_causal_lm_converts_as_its_backbone():
    backbone = hub_backbone("mistral")
    causal_lm = keras_hub.models.MistralCausalLM(backbone=backbone, preprocessor=None)
    token_ids = np.arange(1, 8, dtype="int32")[None]
    expected = to_numpy(
        causal_lm({"token_ids": token_ids, "padding_mask": np.ones_like(token_ids)})
    )
    assert_same_logits(to_numpy(from_keras_hub(causal_lm)(token_ids)), expected)


@pytest.mark.parametrize(
    "family, overrides, named",
    [
        ("gemma2", dict(use_post_ffw_norm=False), "use_post_ffw_norm=False"),
        ("gemma", dict(dtype="bfloat16"), "dtype='bfloat16'"),
    ],
)
def test_an_option_our_blocks_lack_raises_naming_it(family, overrides, named):
    cls, kwargs = FAMILIES[family]
    backbone = getattr(keras_hub.models, cls)(**{**kwargs, **overrides})
    with pytest.raises(ValueError, match=named):
        from_keras_hub(backbone)


@pytest.mark.parametrize(
    "family, overrides",
    [
        # keras-hub 0.32's `GemmaDecoderBlock` always normalizes by head_dim.
        ("gemma2", dict(query_head_dim_normalize=False)),
        # keras-hub 0.32's `LlamaRotaryEmbedding` never divides by it.
        ("llama3.1", dict(rope_position_scaling_factor=2.0)),
    ],
)
def test_an_option_keras_hub_ignores_warns_and_is_ignored(family, overrides):
    backbone = hub_backbone(family, **overrides)
    token_ids = np.arange(1, 9, dtype="int32")[None]
    with pytest.warns(UserWarning, match=f"{next(iter(overrides))}.*does not apply"):
        model = from_keras_hub(backbone)
    assert_same_logits(to_numpy(model(token_ids)), hub_logits(backbone, token_ids))


def test_an_unknown_config_entry_raises_naming_it(monkeypatch):
    backbone = hub_backbone("qwen3")
    config = {**backbone.get_config(), "new_option": 3}
    monkeypatch.setattr(backbone, "get_config", lambda: config)
    with pytest.raises(ValueError, match=r"\['new_option'\]"):
        from_keras_hub(backbone)


def test_another_kind_of_model_raises_naming_it():
    bert = keras_hub.models.BertBackbone(
        vocabulary_size=10, num_layers=1, num_heads=2, hidden_dim=4,
        intermediate_dim=8, max_sequence_length=8,
    )  # fmt: skip
    with pytest.raises(ValueError, match="BertBackbone"):
        from_keras_hub(bert)
    with pytest.raises(ValueError, match="Dense"):
        from_keras_hub(keras.layers.Dense(3))


def test_a_quantized_model_raises():
    backbone = hub_backbone("mistral")
    backbone.get_layer("token_embedding").quantize("int8")
    with pytest.raises(ValueError, match="quantized"):
        from_keras_hub(backbone)


def test_generate_refuses_sequences_past_the_position_table():
    model = from_keras_hub(hub_backbone("gpt2"))  # 24 positions
    with pytest.raises(ValueError, match="25 tokens.*holds 24 positions"):
        keras_attn.generation.generate(
            model, np.ones((1, 20), "int32"), max_new_tokens=5
        )
    # A left-padded row's positions start at its first real token.
    pads = np.array([0, 3])
    check_positions(27, pads[1:], 24)
    with pytest.raises(ValueError, match="27 tokens"):
        check_positions(27, pads, 24)


@pytest.mark.parametrize("family", ["gpt2", "gemma2", "qwen3"])
def test_layout_maps_place_every_block_weight(family):
    """`keras_attn.distribution`'s rules reach each converted block's weights
    (one rule each, of the weight's rank); the rest is replicated."""
    model = from_keras_hub(hub_backbone(family))
    devices = [f"cpu:{i}" for i in range(2)]
    mesh = keras.distribution.DeviceMesh((1, 2), ["batch", "model"], devices=devices)
    layout_map = keras_attn.distribution.get_layout_map(mesh)
    for weight in model.weights:
        matches = [key for key in layout_map if re.fullmatch(key, weight.path)]
        expected = 1 if weight.path.startswith("transformer_layer_") else (0, 1)
        assert len(matches) in np.atleast_1d(expected), (weight.path, matches)
        if matches:
            assert len(layout_map[weight.path].axes) == len(weight.shape)
