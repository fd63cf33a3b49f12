"""The sparse families' checkpoint folders (Mixtral, Qwen3-MoE, gpt-oss,
DeepSeek-V3): a tiny seeded transformers model written by `save_pretrained`
loads to the same logits and greedy tokens as transformers' own; config
entries we cannot honour raise before anything is read."""

import numpy as np
import pytest

import keras_attn
from keras_attn.models import from_hugging_face
from tests.helpers.backend import to_numpy
from tests.helpers.hugging_face import (
    VOCABULARY,
    assert_same_greedy,
    assert_same_logits,
    edit_config,
    edit_tensors,
    tiny_causal_lm,
    transformers_logits,
    write_folders,
)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

NEW_TOKENS = 12
SMALL = dict(
    vocab_size=VOCABULARY,
    hidden_size=16,
    num_hidden_layers=3,
    num_attention_heads=4,
    max_position_embeddings=64,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
EXPERTS = dict(num_local_experts=4, num_experts_per_tok=2)
# family: (transformers config class, its arguments)
FAMILIES = {
    "mixtral": (
        "MixtralConfig",
        dict(SMALL, **EXPERTS, intermediate_size=24, num_key_value_heads=2,
             head_dim=4, sliding_window=5),
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(SMALL, **EXPERTS, intermediate_size=24, moe_intermediate_size=8,
             num_key_value_heads=2, head_dim=4, norm_topk_prob=True,
             mlp_only_layers=[0]),
    ),
    "gpt_oss": (
        "GptOssConfig",
        dict(SMALL, **EXPERTS, intermediate_size=8, num_key_value_heads=2,
             head_dim=4, sliding_window=4),
    ),
    "gpt_oss_no_bias": (  # attention_bias read, not assumed
        "GptOssConfig",
        dict(SMALL, **EXPERTS, intermediate_size=8, num_key_value_heads=2,
             head_dim=4, sliding_window=4, attention_bias=False),
    ),
    "deepseek_v3": (
        "DeepseekV3Config",
        dict(SMALL, intermediate_size=24, moe_intermediate_size=8,
             num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
             n_group=2, topk_group=1, n_shared_experts=1, first_k_dense_replace=1,
             kv_lora_rank=8, q_lora_rank=12, qk_nope_head_dim=4,
             qk_rope_head_dim=4, v_head_dim=6),
    ),
    "deepseek_v3_yarn": (  # no query compression, plain rope order, YaRN
        "DeepseekV3Config",
        dict(SMALL, intermediate_size=24, moe_intermediate_size=8,
             num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2,
             n_group=1, topk_group=1, n_shared_experts=2, first_k_dense_replace=0,
             norm_topk_prob=False, kv_lora_rank=8, q_lora_rank=None,
             qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4,
             rope_interleave=False,
             rope_parameters=dict(rope_type="yarn", rope_theta=1e4, factor=4.0,
                                  original_max_position_embeddings=16,
                                  mscale=0.7, mscale_all_dim=0.7)),
    ),
}  # fmt: skip


def transformers_model(family):
    cls, kwargs = FAMILIES[family]
    model = tiny_causal_lm(cls, **kwargs)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():  # buffers too: DeepSeek's choice-only expert bias
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn(buffer.shape, generator=generator) * 0.1)
    return model


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


def test_the_layers_are_the_sparse_ones(folders):
    """Qwen3-MoE's `mlp_only_layers` stay dense; DeepSeek's blocks hold
    latent attention, dense before `first_k_dense_replace`."""
    qwen = from_hugging_face(folders["qwen3_moe"][0])
    kinds = [
        type(qwen.get_layer(f"transformer_layer_{i}").feedforward).__name__
        if getattr(qwen.get_layer(f"transformer_layer_{i}"), "feedforward", None)
        else "dense"
        for i in range(3)
    ]
    assert kinds == ["dense", "MixtureOfExperts", "MixtureOfExperts"]
    deepseek = from_hugging_face(folders["deepseek_v3"][0])
    block = deepseek.get_layer("transformer_layer_0")
    assert type(block.self_attention).__name__ == "MultiHeadLatentAttention"


@pytest.mark.parametrize(
    "family, change, named",
    [
        ("mixtral", dict(output_router_logits=True), "output_router_logits"),
        ("mixtral", dict(router_jitter_noise=0.1), "router_jitter_noise"),
        ("deepseek_v3", dict(num_key_value_heads=2), "num_key_value_heads"),
    ],
)
def test_entries_we_do_not_compute_are_refused(
    family, change, named, folders, tmp_path
):
    import shutil

    folder = shutil.copytree(folders[family][0], tmp_path / "copy")
    edit_config(folder, **change)
    with pytest.raises(ValueError, match=f"{named}="):
        from_hugging_face(folder)


def test_deepseek_multi_token_prediction_layers_are_skipped(folders, tmp_path):
    """transformers' DeepSeek-V3 does not read the layers after its last
    (`num_nextn_predict_layers` of them, multi-token prediction): nor do we."""
    import shutil

    folder, reference = folders["deepseek_v3"]
    folder = shutil.copytree(folder, tmp_path / "copy")
    extra = "model.layers.3.self_attn.kv_a_layernorm.weight"
    edit_tensors(folder, lambda tensors: tensors.update({extra: np.ones(8, "float32")}))
    model = from_hugging_face(folder)
    assert_same_logits(to_numpy(model(TOKENS)), transformers_logits(reference, TOKENS))


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3"])
def test_to_hugging_face_refuses_sparse_blocks_before_writing(
    family, folders, tmp_path
):
    model = from_hugging_face(folders[family][0])
    with pytest.raises(ValueError, match="transformer_layer_.*mixture of experts"):
        keras_attn.models.to_hugging_face(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()
