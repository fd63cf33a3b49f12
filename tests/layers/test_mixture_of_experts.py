"""MixtureOfExperts: against a numpy loop over tokens and against
`transformers`' MoE blocks with copied weights; its losses, load, config
and errors; the blocks taking it as their feed-forward (fit, generate,
`decoder_lm`'s spec, `.keras`)."""

import keras
import numpy as np
import pytest

from keras_attn.generation import generate
from keras_attn.layers import MixtureOfExperts, TransformerDecoder, TransformerEncoder
from keras_attn.models import DecoderLMSpec, decoder_lm
from keras_attn.models.decoder_lm import spec_of
from keras_attn.ops import routing
from tests.helpers.backend import require, to_numpy
from tests.helpers.builders import VOCAB, random_floats, random_ids
from tests.helpers.contract import run_layer_contract

WIDTH = 12
MOE = MixtureOfExperts(3, 8, 2)


E, F, K = 5, 7, 2


def silu(x):
    return x / (1 + np.exp(-x))


def sigmoid(x):
    return 1 / (1 + np.exp(-x))


def numpy_moe(layer, x):
    """A loop over tokens and their experts, from the formulas; the routing
    (tested in tests/ops/test_routing.py) is the layer's."""
    v = {w.path.split("/", 1)[1]: to_numpy(w) for w in layer.weights}
    flat = x.reshape(-1, x.shape[-1])
    logits = flat @ v["router/kernel"]
    weights, ids = (to_numpy(a) for a in layer.route(logits))
    out = np.zeros_like(flat)
    for n, token in enumerate(flat):
        for weight, e in zip(weights[n], ids[n], strict=True):
            up = token @ v["intermediate_kernel"][e] + bias(v, "intermediate", e)
            gate = None
            if layer.gated:
                gate = token @ v["gate_kernel"][e] + bias(v, "gate", e)
            hidden = numpy_hidden(layer, gate, up)
            y = hidden @ v["output_kernel"][e] + bias(v, "output", e)
            out[n] += weight * y
    if layer.num_shared_experts:
        gate = flat @ v["shared_gate_dense/kernel"]
        up = flat @ v["shared_intermediate_dense/kernel"]
        out += numpy_hidden(layer, gate, up) @ v["shared_output_dense/kernel"]
    return out.reshape(x.shape)


def bias(v, name, e):
    """Expert `e`'s bias `{name}_bias`, 0 without biases."""
    return v[f"{name}_bias"][e] if f"{name}_bias" in v else 0.0


def numpy_hidden(layer, gate, up):
    if layer.swiglu_limit is not None:
        gate, up = np.minimum(gate, 7.0), np.clip(up, -7.0, 7.0)
        return (up + 1) * gate * sigmoid(1.702 * gate)
    if not layer.gated:
        return np.maximum(up, 0.0)  # relu
    return silu(gate) * up


BIASES = dict(use_bias=True, bias_initializer=keras.initializers.RandomNormal(0, 0.5))
KINDS = {
    "softmax_gated": dict(),
    "plain_relu_biases": dict(gated=False, activation="relu", **BIASES),
    "clamped_swiglu": dict(router="top_k_softmax", swiglu_limit=7.0, **BIASES),
    "sigmoid_groups_shared": dict(
        router="sigmoid",
        num_expert_groups=5,
        top_k_groups=2,
        use_score_correction_bias=True,
        num_shared_experts=2,
        routed_scaling_factor=2.5,
    ),
}


@pytest.mark.parametrize("kind", KINDS)
def test_matches_a_loop_over_tokens(kind):
    keras.utils.set_random_seed(1)
    layer = MixtureOfExperts(E, F, K, kernel_initializer=INIT, **KINDS[kind])
    x = random_floats(2, 3, WIDTH, seed=2, scale=2.0)
    layer.build(x.shape)
    if layer.score_correction_bias is not None:
        layer.score_correction_bias.assign(random_floats(E, seed=3))
    expected = numpy_moe(layer, x)
    np.testing.assert_allclose(to_numpy(layer(x)), expected, atol=1e-5, rtol=1e-5)


INIT = keras.initializers.RandomNormal(0, 0.5)


def test_layer_contract(tmp_path):
    run_layer_contract(
        MixtureOfExperts,
        dict(num_experts=E, intermediate_dim=F, top_k=K, num_shared_experts=1),
        {"inputs": random_floats(2, 3, WIDTH)},
        expected_output_shape=(2, 3, WIDTH),
        tmp_path=tmp_path,
        machinery=False,
    )


def test_training_adds_losses_and_records_the_load():
    layer = MixtureOfExperts(E, F, K, load_balancing_loss=0.5, router_z_loss=0.25)
    x = random_floats(2, 4, WIDTH, seed=4)
    layer(x)
    assert not layer.losses
    np.testing.assert_array_equal(to_numpy(layer.expert_load), np.zeros(E))
    layer(x, training=True)
    logits = layer.router(x.reshape(-1, WIDTH))
    expected = [
        0.5 * routing.load_balancing_loss(logits, K),
        0.25 * routing.router_z_loss(logits),
    ]
    np.testing.assert_allclose(
        [float(to_numpy(loss)) for loss in layer.losses],
        [float(to_numpy(loss)) for loss in expected],
        rtol=1e-6,
    )
    ids = to_numpy(layer.route(logits)[1]).ravel()
    load = to_numpy(layer.expert_load)
    np.testing.assert_array_equal(load, np.bincount(ids, minlength=E))


def test_config_round_trip_and_weight_names():
    layer = MixtureOfExperts(E, F, K, **KINDS["sigmoid_groups_shared"])
    config = layer.get_config()
    assert MixtureOfExperts.from_config(config).get_config() == config
    layer.build((None, None, WIDTH))
    names = {w.path.split("/", 1)[1] for w in layer.weights}
    assert names == {
        "intermediate_kernel",
        "gate_kernel",
        "output_kernel",
        "score_correction_bias",
        "expert_load",
        "router/kernel",
        "shared_gate_dense/kernel",
        "shared_intermediate_dense/kernel",
        "shared_output_dense/kernel",
    }
    assert layer.shared_intermediate_dense.units == 2 * F
    assert not layer.score_correction_bias.trainable


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(top_k=6), "top_k=6, num_experts=5"),
        (dict(router="noisy"), "router"),
        (dict(swiglu_limit=0.0), "swiglu_limit"),
        (dict(swiglu_limit=7.0, gated=False), "needs gated"),
        (dict(use_score_correction_bias=True), "use_score_correction_bias"),
        (dict(router="sigmoid", num_expert_groups=2, top_k_groups=1), "divide"),
        (dict(router="sigmoid", num_expert_groups=5, top_k_groups=6), "at most"),
        (dict(router="sigmoid", num_expert_groups=5, top_k_groups=1), "kept groups"),
        (dict(router="sigmoid", num_expert_groups=5), "go together"),
        (dict(load_balancing_loss=-1.0), "load_balancing_loss"),
    ],
)
def test_refuses_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MixtureOfExperts(
            **{"num_experts": E, "intermediate_dim": F, "top_k": K, **kwargs}
        )


def test_refuses_another_width_after_build():
    layer = MixtureOfExperts(E, F, K)
    layer(random_floats(1, 2, WIDTH))
    with pytest.raises(ValueError, match="width"):
        layer(random_floats(1, 2, WIDTH + 1))


def test_lora_and_quantize_are_refused_and_model_quantize_leaves_experts_float():
    layer = MixtureOfExperts(E, F, K)
    inputs = keras.Input((3, WIDTH))
    model = keras.Model(inputs, layer(inputs))
    with pytest.raises(ValueError, match="enable_lora"):
        layer.enable_lora(2)
    with pytest.raises(NotImplementedError, match="quantize"):
        layer.quantize("int8")
    model.quantize("int8")  # Keras quantizes leaf layers: the router only
    assert layer.router.quantization_mode == "int8"
    assert keras.backend.standardize_dtype(layer.output_kernel.dtype) == "float32"


# --- Against transformers' MoE blocks, weights copied. ---


def torch_of(array):
    import torch

    return torch.nn.Parameter(torch.tensor(np.ascontiguousarray(array)))


def copy_fused_experts(layer, experts):
    """Mixtral, Qwen3-MoE, DeepSeek-V3: `gate_up_proj` `(E, 2F, D)`, gate
    first; `down_proj` `(E, D, F)`."""
    gate, up = to_numpy(layer.gate_kernel), to_numpy(layer.intermediate_kernel)
    fused = np.concatenate([gate, up], axis=-1).transpose(0, 2, 1)
    experts.gate_up_proj = torch_of(fused)
    experts.down_proj = torch_of(to_numpy(layer.output_kernel).transpose(0, 2, 1))


def hugging_face_pair(config_class, module_class, layer, **config):
    """A transformers module of `config`, and `layer` built for it."""
    require("torch")
    hf_config = config_class(hidden_size=WIDTH, **config)
    module = module_class(hf_config).eval()
    keras.utils.set_random_seed(5)
    layer.build((None, None, WIDTH))
    return module


def assert_same_output(layer, module):
    import torch

    x = random_floats(2, 5, WIDTH, seed=6)
    with torch.no_grad():
        expected = module(torch.tensor(x))
    expected = expected[0] if isinstance(expected, tuple) else expected
    actual = to_numpy(layer(x))
    np.testing.assert_allclose(actual, expected.numpy(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_matches_mixtral_and_qwen3_moe(family):
    if family == "mixtral":
        from transformers import MixtralConfig as Config
        from transformers.models.mixtral.modeling_mixtral import (
            MixtralSparseMoeBlock as Block,
        )

        config, normalize = dict(num_local_experts=E), True
    else:
        from transformers import Qwen3MoeConfig as Config
        from transformers.models.qwen3_moe.modeling_qwen3_moe import (
            Qwen3MoeSparseMoeBlock as Block,
        )

        config, normalize = dict(num_experts=E, norm_topk_prob=False), False
    layer = MixtureOfExperts(
        E, F, K, normalize_top_k=normalize, kernel_initializer=INIT
    )
    config.update(num_experts_per_tok=K, intermediate_size=F, moe_intermediate_size=F)
    module = hugging_face_pair(Config, Block, layer, **config)
    module.gate.weight = torch_of(to_numpy(layer.router.kernel).T)
    copy_fused_experts(layer, module.experts)
    assert_same_output(layer, module)


def test_matches_gpt_oss():
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    layer = MixtureOfExperts(E, F, K, router="top_k_softmax", swiglu_limit=1.5,
                             use_router_bias=True, kernel_initializer=INIT,
                             **BIASES)  # fmt: skip
    module = hugging_face_pair(
        GptOssConfig, GptOssMLP, layer, num_local_experts=E,
        num_experts_per_tok=K, intermediate_size=F, swiglu_limit=1.5,
    )  # fmt: skip
    module.router.weight = torch_of(to_numpy(layer.router.kernel).T)
    module.router.bias = torch_of(to_numpy(layer.router.bias))
    fused = np.zeros((E, WIDTH, 2 * F), "float32")  # gate and up interleaved
    fused[..., ::2] = to_numpy(layer.gate_kernel)
    fused[..., 1::2] = to_numpy(layer.intermediate_kernel)
    fused_bias = np.zeros((E, 2 * F), "float32")
    fused_bias[:, ::2] = to_numpy(layer.gate_bias)
    fused_bias[:, 1::2] = to_numpy(layer.intermediate_bias)
    module.experts.gate_up_proj = torch_of(fused)
    module.experts.gate_up_proj_bias = torch_of(fused_bias)
    module.experts.down_proj = torch_of(to_numpy(layer.output_kernel))
    module.experts.down_proj_bias = torch_of(to_numpy(layer.output_bias))
    # transformers <= 5.17 fixed the clamp at 7.0 whatever the config said.
    module.experts.limit = 1.5
    assert_same_output(layer, module)


def test_matches_deepseek_v3():
    import torch
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    experts = 6
    layer = MixtureOfExperts(
        experts, F, 3, router="sigmoid", num_expert_groups=3, top_k_groups=2,
        use_score_correction_bias=True, num_shared_experts=2,
        routed_scaling_factor=2.5, kernel_initializer=INIT,
    )  # fmt: skip
    module = hugging_face_pair(
        DeepseekV3Config, DeepseekV3MoE, layer, n_routed_experts=experts,
        num_experts_per_tok=3, n_group=3, topk_group=2, moe_intermediate_size=F,
        n_shared_experts=2, routed_scaling_factor=2.5, norm_topk_prob=True,
    )  # fmt: skip
    bias = random_floats(experts, seed=7, scale=0.3)
    layer.score_correction_bias.assign(bias)
    module.gate.weight = torch_of(to_numpy(layer.router.kernel).T)
    module.gate.e_score_correction_bias = torch.tensor(bias)
    copy_fused_experts(layer, module.experts)
    shared = module.shared_experts
    for name, dense in [("gate_proj", layer.shared_gate_dense),
                        ("up_proj", layer.shared_intermediate_dense),
                        ("down_proj", layer.shared_output_dense)]:  # fmt: skip
        getattr(shared, name).weight = torch_of(to_numpy(dense.kernel).T)
    assert_same_output(layer, module)


# --- The blocks with a MixtureOfExperts feed-forward. ---


def moe_decoder_lm(load_balancing_loss=0.01, router_z_loss=0.001):
    keras.utils.set_random_seed(0)
    moe = MixtureOfExperts(
        5,
        7,
        2,
        load_balancing_loss=load_balancing_loss,
        router_z_loss=router_z_loss,
    )
    block = dict(
        intermediate_dim=None,
        num_heads=2,
        normalize_first=True,
        normalization="rms_norm",
        use_bias=False,
        rope_max_wavelength=10000.0,
        feedforward=keras.saving.serialize_keras_object(moe),
    )
    spec = DecoderLMSpec(vocabulary_size=VOCAB, hidden_dim=WIDTH,
                         blocks=(block, block))  # fmt: skip
    return decoder_lm(spec)


@pytest.fixture(scope="module")
def lm():
    return moe_decoder_lm()


def test_each_block_owns_its_feedforward(lm):
    first, second = (b for b in lm.layers if "transformer_layer" in b.name)
    assert first.feedforward is not second.feedforward
    assert first.feedforward.name == "feedforward"
    assert first.feedforward_intermediate_dense is None
    paths = [w.path for w in first.weights]
    assert not any("feedforward_" in p and "dense" in p for p in paths)
    assert "transformer_layer_0/feedforward/gate_kernel" in paths


def test_generate_greedy_equals_the_full_forward(lm):
    prompts = np.array([[3, 4, 5, 6], [7, 8, 9, 10]])
    tokens = to_numpy(generate(lm, prompts, max_length=9))
    logits = to_numpy(lm(tokens))
    for row, row_logits in zip(tokens, logits, strict=True):
        for position in range(4, len(row)):
            chosen = row_logits[position - 1, row[position]]
            assert chosen >= row_logits[position - 1].max() - 1e-4, position


def test_spec_and_keras_round_trips(lm, tmp_path):
    tokens = np.array([[1, 2, 3, 4, 5]])
    expected = to_numpy(lm(tokens))
    again = decoder_lm(spec_of(lm))
    assert spec_of(again) == spec_of(lm)
    again.set_weights(lm.get_weights())
    np.testing.assert_allclose(to_numpy(again(tokens)), expected, atol=1e-6)
    path = str(tmp_path / "moe.keras")
    lm.save(path)
    loaded = keras.saving.load_model(path)
    np.testing.assert_allclose(to_numpy(loaded(tokens)), expected, atol=1e-6)


def test_fit_lowers_the_loss_and_records_the_load():
    model = moe_decoder_lm()
    model.compile(
        keras.optimizers.Adam(0.01),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    tokens = random_ids(12, 6, seed=4)
    history = model.fit(tokens, tokens, epochs=4, batch_size=4, verbose=0)
    losses = history.history["loss"]
    assert losses[-1] < losses[0]
    load = to_numpy(model.get_layer("transformer_layer_0").feedforward.expert_load)
    np.testing.assert_allclose(load.sum(), 4 * 6 * 2)  # the last batch's
    model(tokens, training=True)
    assert len(model.losses) == 4  # two losses in each of two blocks


def test_aux_losses_reach_the_training_loss():
    """The same weights with and without the losses: `train_on_batch`'s
    loss (before its update) differs by the blocks' added losses."""
    tokens = random_ids(4, 6, seed=5)
    with_losses = moe_decoder_lm(1.0, 1.0)
    with_losses(tokens, training=True)
    added = sum(float(to_numpy(loss)) for loss in with_losses.losses)
    results = []
    for model in (moe_decoder_lm(0.0, 0.0), with_losses):
        model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(True))
        results.append(model.train_on_batch(tokens, tokens))
    np.testing.assert_allclose(results[1] - results[0], added, rtol=1e-4)


def test_encoder_and_decoder_config_round_trip():
    x = random_floats(2, 5, WIDTH, seed=6)
    moe = MixtureOfExperts(3, 8, 2, router="top_k_softmax", use_bias=True)
    for cls in (TransformerEncoder, TransformerDecoder):
        block = cls(None, 2, feedforward=moe)
        expected = to_numpy(block(x))
        again = cls(**block.get_config())
        again.build(x.shape)
        again.set_weights(block.get_weights())
        np.testing.assert_allclose(to_numpy(again(x)), expected, atol=1e-6)
        assert block.get_config()["feedforward"]["class_name"] == "MixtureOfExperts"


def test_block_equals_moe_in_its_residual():
    """Pre-norm block: `x + attention` then `h + MoE(norm(h))`."""
    x = keras.ops.convert_to_tensor(random_floats(2, 5, WIDTH, seed=7))
    block = TransformerEncoder(
        None, 2, normalize_first=True, feedforward=MixtureOfExperts(3, 8, 2)
    )
    out = to_numpy(block(x))
    h, _, _ = block._attention_residual(
        x, block.self_attention, (block.self_attention_layer_norm, None), False, False
    )
    expected = h + block.feedforward(block.feedforward_layer_norm(h))
    np.testing.assert_allclose(out, to_numpy(expected), atol=1e-6)


def test_block_lora_adapts_the_attention_only():
    x = random_floats(2, 5, WIDTH, seed=8)
    block = TransformerDecoder(None, 2, feedforward=MixtureOfExperts(3, 8, 2))
    block(x)
    block.enable_lora(2)
    names = sorted(w.path for w in block.trainable_weights)
    assert len(names) == 8 and all("self_attention" in n for n in names)
    assert all("lora" in n for n in names)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(intermediate_dim=None), "intermediate_dim"),
        (dict(gated_feedforward=True, feedforward=MOE), "gated_feedforward=True"),
        (dict(use_feedforward_bias=False, feedforward=MOE), "use_feedforward_bias"),
    ],
)
def test_block_refuses(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TransformerDecoder(**{"intermediate_dim": 8, "num_heads": 2, **kwargs})


def test_block_refuses_another_layer():
    with pytest.raises(TypeError, match="feedforward.*Dense"):
        TransformerDecoder(8, 2, feedforward=keras.layers.Dense(4))


def test_block_checks_width_after_build():
    block = TransformerEncoder(None, 2, feedforward=MOE)
    block(random_floats(1, 3, WIDTH))
    with pytest.raises(ValueError, match="width"):
        block(random_floats(1, 3, WIDTH + 2))


def test_padding_is_left_out_of_the_losses_and_the_load():
    """Padding tokens route too, but the losses and `expert_load` are means
    and counts over the real tokens only (transformers' `attention_mask` in
    `load_balancing_loss_func`); a block passes its padding mask."""
    moe = MixtureOfExperts(4, 8, 2, load_balancing_loss=1.0, router_z_loss=1.0)
    x = random_floats(2, 5, WIDTH, seed=11)
    real = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], bool)
    moe(x, training=True, mask=real)
    padded = [float(to_numpy(loss)) for loss in moe.losses]
    padded_load = to_numpy(moe.expert_load)
    moe(x[real][None], training=True)  # the 8 real tokens alone
    np.testing.assert_allclose(
        padded, [float(to_numpy(v)) for v in moe.losses[-2:]], rtol=1e-5
    )
    np.testing.assert_array_equal(padded_load, to_numpy(moe.expert_load))
    assert padded_load.sum() == 8 * 2
    block = TransformerEncoder(None, 2, feedforward=MixtureOfExperts(4, 8, 2))
    block(x, padding_mask=real, training=True)
    assert to_numpy(block.feedforward.expert_load).sum() == 8 * 2


def test_the_sigmoid_router_is_float32_and_refuses_switch_loss():
    """DeepSeek-V3's router and correction bias stay float32 under a
    bfloat16 policy (a bfloat16 logit would change the choice)."""
    moe = MixtureOfExperts(
        4, 8, 2, router="sigmoid", use_score_correction_bias=True, dtype="bfloat16"
    )
    moe.build((1, 3, WIDTH))
    assert moe.router.dtype_policy.name == "float32"
    assert moe.score_correction_bias.dtype == "float32"
    assert moe.intermediate_kernel.dtype == "bfloat16"
    with pytest.raises(ValueError, match="load_balancing_loss=0.5"):
        MixtureOfExperts(4, 8, 2, router="sigmoid", load_balancing_loss=0.5)
