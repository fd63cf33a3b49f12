"""Hugging Face checkpoint folders loaded: for each family, a tiny seeded
transformers model written by `save_pretrained` gives the same logits and the
same greedy tokens (left-padded batches too) as transformers' own; config
entries and tensors we cannot honour raise before anything is loaded."""

import os

import keras
import numpy as np
import pytest

import keras_attn
from keras_attn.models import from_hugging_face
from tests.helpers.backend import to_numpy
from tests.helpers.hugging_face import (
    LLAMA,
    VOCABULARY,
    assert_same_greedy,
    assert_same_logits,
    reference_model,
    tiny_causal_lm,
    transformers_logits,
    write_folders,
)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

NEW_TOKENS = 20
# The helpers' tiny Llama with a third layer and ids in the vocabulary.
LLAMA_LIKE = dict(
    LLAMA, num_hidden_layers=3, pad_token_id=0, bos_token_id=1, eos_token_id=2
)
GEMMA = dict(LLAMA_LIKE, head_dim=8, hidden_size=16)
LLAMA_3_1 = dict(  # bands of 4 and 16 positions: every channel in some band
    rope_type="llama3",
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=16,
)
# family: (transformers config class, its arguments)
FAMILIES = {
    "gpt2": (
        "GPT2Config",
        dict(vocab_size=VOCABULARY, n_embd=16, n_layer=2, n_head=2, n_positions=48),
    ),
    "llama2": ("LlamaConfig", dict(LLAMA_LIKE, rms_norm_eps=1e-5)),
    "llama3.1": (
        "LlamaConfig",
        dict(
            LLAMA_LIKE,
            rope_parameters=dict(rope_theta=500000.0, **LLAMA_3_1),
            rms_norm_eps=0.3,
        ),
    ),
    "llama3.2": (
        "LlamaConfig",
        dict(LLAMA_LIKE, tie_word_embeddings=True, attention_bias=True, mlp_bias=True),
    ),
    "mistral": ("MistralConfig", dict(LLAMA_LIKE, sliding_window=5, head_dim=8)),
    "qwen2": ("Qwen2Config", dict(LLAMA_LIKE, rms_norm_eps=0.1)),
    "qwen3": (
        "Qwen3Config",
        dict(
            LLAMA_LIKE,
            head_dim=8,
            layer_types=["full_attention", "sliding_attention", "full_attention"],
            use_sliding_window=True,
            sliding_window=4,
            rope_parameters=dict(rope_theta=1e4, rope_type="linear", factor=2.0),
        ),
    ),
    "phi3": ("Phi3Config", dict(LLAMA_LIKE, sliding_window=6)),
    "smollm3": (
        "SmolLM3Config",
        dict(
            LLAMA_LIKE, no_rope_layers=[1, 0, 1], rope_parameters=dict(rope_theta=2e6)
        ),
    ),
    "gemma": ("GemmaConfig", dict(GEMMA, rms_norm_eps=0.1)),
    "gemma2": (
        "Gemma2Config",
        dict(
            GEMMA,
            sliding_window=4,
            attn_logit_softcapping=3.0,
            final_logit_softcapping=5.0,
            query_pre_attn_scalar=12,
        ),
    ),
    "gemma3": (
        "Gemma3TextConfig",
        dict(
            GEMMA,
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            query_pre_attn_scalar=12,
            rope_parameters={
                "sliding_attention": dict(rope_type="default", rope_theta=100.0),
                "full_attention": dict(rope_type="linear", factor=4.0, rope_theta=1e4),
            },
        ),
    ),
}


def transformers_model(family, dtype="float32"):
    cls, kwargs = FAMILIES[family]
    return tiny_causal_lm(cls, dtype, **kwargs)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """family: (folder, transformers model in float32), written once."""
    return write_folders(tmp_path_factory, FAMILIES, transformers_model)


TOKENS = np.random.default_rng(2).integers(1, VOCABULARY, (2, 13)).astype("int32")


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_and_greedy_tokens_equal_transformers(family, folders):
    folder, reference = folders[family]
    model = from_hugging_face(folder)
    assert_same_logits(to_numpy(model(TOKENS)), transformers_logits(reference, TOKENS))
    assert_same_greedy(model, reference, NEW_TOKENS)


@pytest.mark.parametrize("family", FAMILIES)
def test_bfloat16_checkpoints_give_the_same_logits_and_tokens(family, tmp_path):
    """bfloat16 files (ml-dtypes' arrays), computed in float32 on both sides."""
    transformers_model(family, "bfloat16").save_pretrained(tmp_path)
    reference = reference_model(tmp_path, dtype=torch.float32)
    model = from_hugging_face(tmp_path, dtype="float32")
    expected = transformers_logits(reference, TOKENS)
    assert_same_logits(to_numpy(model(TOKENS)), expected)
    assert_same_greedy(model, reference, NEW_TOKENS)


# The family `to_hugging_face` writes for each folder loaded: its own, but
# Phi-3's as Mistral (the same maths, unfused) unless asked for.
WRITTEN_AS = {
    **{family: family for family in FAMILIES},
    **dict.fromkeys(("llama2", "llama3.1", "llama3.2"), "llama"),
    "gemma3": "gemma3_text",
    "phi3": "mistral",
}


@pytest.mark.parametrize("family", FAMILIES)
def test_to_hugging_face_round_trips_through_transformers(family, folders, tmp_path):
    """transformers loads what we write to its own logits; Phi-3's fused
    layout is written as Mistral's (the same maths) unless asked for."""
    folder, reference = folders[family]
    model = from_hugging_face(folder)
    limit = None if family == "gpt2" else LLAMA_LIKE["max_position_embeddings"]
    written = keras_attn.models.to_hugging_face(
        model, tmp_path / "hf", max_position_embeddings=limit
    )
    assert written == WRITTEN_AS[family]
    theirs = reference_model(tmp_path / "hf")
    assert_same_logits(
        transformers_logits(theirs, TOKENS), transformers_logits(reference, TOKENS)
    )
    assert theirs.config.max_position_embeddings == (limit or 48)


def test_phi3_written_fused_when_asked(folders, tmp_path):
    folder, reference = folders["phi3"]
    model = from_hugging_face(folder)
    written = keras_attn.models.to_hugging_face(
        model, tmp_path, "phi3", max_position_embeddings=64
    )
    assert written == "phi3"
    theirs = reference_model(tmp_path)
    assert_same_logits(
        transformers_logits(theirs, TOKENS), transformers_logits(reference, TOKENS)
    )


def test_a_fine_tuned_model_goes_back_with_lora_merged(folders, tmp_path):
    """LoRA's product is in the kernels written; a `.keras` file of the
    loaded model reloads to the same logits."""
    model = from_hugging_face(folders["qwen2"][0])
    model.get_layer("transformer_layer_1").enable_lora(2)
    for weight in model.weights:
        if "lora_kernel_b" in weight.path:  # Keras starts B at zero
            weight.assign(np.full(weight.shape, 0.05, weight.dtype))
    ours = to_numpy(model(TOKENS))
    keras_attn.models.to_hugging_face(
        model, tmp_path / "hf", dtype="float32", max_position_embeddings=64
    )
    theirs = reference_model(tmp_path / "hf")
    assert_same_logits(transformers_logits(theirs, TOKENS), ours)
    model.save(tmp_path / "model.keras")
    reloaded = keras.models.load_model(tmp_path / "model.keras")
    np.testing.assert_array_equal(to_numpy(reloaded(TOKENS)), ours)


@pytest.mark.parametrize(
    "change, named",
    [
        (dict(attention_sinks=2, sliding_window=3), "attention_sinks"),
        (dict(use_gate=True), "use_gate"),
    ],
)
def test_a_model_no_config_describes_is_refused_before_writing(change, named, tmp_path):
    block = dict(
        intermediate_dim=24,
        num_heads=2,
        normalize_first=True,
        normalization="rms_norm",
        gated_feedforward=True,
        use_bias=False,
        activation="silu",
        rope_max_wavelength=1e4,
    )
    spec = keras_attn.models.DecoderLMSpec(
        vocabulary_size=VOCABULARY, hidden_dim=8, blocks=({**block, **change},)
    )
    model = keras_attn.models.decoder_lm(spec)
    with pytest.raises(ValueError, match=f"llama: .*{named}"):
        keras_attn.models.to_hugging_face(model, tmp_path / "out")
    assert not os.path.exists(tmp_path / "out")
    with pytest.raises(ValueError, match="model_type"):
        keras_attn.models.to_hugging_face(model, tmp_path, model_type="bert")
