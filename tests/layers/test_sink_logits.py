"""gpt-oss's learned sink logits (`use_sink_logits`, `sink_logits=`): the
explicit and the chunked path against the formula, the chunked path's own
gradient (the sinks' too) against autodiff of the materialized one, the
layer and a decoder's cached generation against the full pass, saving, the
refusals, and transformers' `GptOssAttention` with copied weights."""

import keras
import numpy as np
import pytest

import keras_attn
from keras_attn import ops as attn_ops
from keras_attn.generation import generate
from keras_attn.models import DecoderLMSpec, decoder_lm
from keras_attn.ops.plan import plan_attention
from tests.helpers.backend import (
    BACKEND,
    compiled_value_and_gradients,
    to_numpy,
    value_and_gradients,
)
from tests.helpers.builders import random_floats
from tests.helpers.contract import run_layer_contract, save_and_load
from tests.helpers.references import attention_reference, dot_product_reference

HEADS, KV_HEADS = 6, 3
# Large sinks on some heads, so that they take most of a row's weight there.
SINKS = np.array([0.0, 2.5, -1.0, 4.0, 1.0, -3.0], "float32")


def inputs(length=11, keys=11, seed=1):
    q = random_floats(2, length, HEADS, 8, seed=seed, scale=2.0)
    k = random_floats(2, keys, KV_HEADS, 8, seed=seed + 1)
    v = random_floats(2, keys, KV_HEADS, 5, seed=seed + 2)
    return q, k, v


def window_mask(length, window):
    """Causal sliding window, and a row (the first of batch row 1) that sees
    nothing: its output and weights are zeros, with the sink or without."""
    i, j = np.arange(length)[:, None], np.arange(length)[None, :]
    mask = np.broadcast_to((j <= i) & (i - j < window), (2, 1, length, length)).copy()
    mask[1, :, 0] = False
    return mask


def test_the_materialized_path_gives_the_formula():
    """Grouped heads, values of another width, a causal window and an empty
    row; the returned weights are those of the real keys (rows sum to less
    than 1: the sink's share is dropped)."""
    q, k, v = inputs()
    mask = window_mask(11, 4)
    out, weights = attn_ops.dot_product_attention(
        q, k, v, mask=mask, sink_logits=SINKS, return_scores=True
    )
    expected, expected_weights = dot_product_reference(
        q, k, v, mask=mask, sink_logits=SINKS
    )
    np.testing.assert_allclose(to_numpy(out), expected, atol=1e-5)
    np.testing.assert_allclose(to_numpy(weights), expected_weights, atol=1e-6)
    sums = to_numpy(weights).sum(-1)
    assert (sums < 1).all() and sums[1, :, 0].max() == 0.0
    assert sums[:, 3].mean() < 0.5  # the sink of logit 4 takes most weight
    plain, _ = dot_product_reference(q, k, v, mask=mask)
    assert np.abs(expected - plain).max() > 0.1  # the sinks change the output


def test_the_chunked_path_gives_the_formula(small_chunks):
    q, k, v = inputs()
    mask = window_mask(11, 4)
    out = attn_ops.dot_product_attention(q, k, v, mask=mask, sink_logits=SINKS)
    assert small_chunks.calls, "the chunked path did not run"
    expected, _ = dot_product_reference(q, k, v, mask=mask, sink_logits=SINKS)
    np.testing.assert_allclose(to_numpy(out), expected, atol=1e-5)


def test_chunked_gradients_equal_the_materialized_path(small_chunks):
    """The chunked path's gradient (our own on JAX and TensorFlow, each
    chunk rematerialized on PyTorch), the sinks' included, compiled as a
    train step: causal, grouped heads, a mask with empty rows, a padded last
    chunk (11 rows in chunks of 4), more keys than queries."""
    q, k, v = inputs(keys=13)
    mask = np.random.default_rng(5).random((2, 1, 11, 13)) > 0.3
    mask[:, :, ::4] = False  # rows with no key: zeros, and no gradient

    def attend(q, k, v, sinks):
        return attn_ops.dot_product_attention(
            q, k, v, mask=mask, is_causal=True, sink_logits=sinks
        )

    chunked = compiled_value_and_gradients(attend, q, k, v, SINKS)
    assert small_chunks.calls, "the chunked path did not run"
    small_chunks()
    reference = (
        compiled_value_and_gradients if BACKEND == "jax" else value_and_gradients
    )
    materialized = reference(attend, q, k, v, SINKS)
    for ours, theirs in zip(
        keras.tree.flatten(chunked), keras.tree.flatten(materialized), strict=True
    ):
        np.testing.assert_allclose(ours, theirs, atol=1e-5, rtol=1e-5)
    assert np.abs(chunked[1][-1]).min() > 1e-3  # each sink has a gradient


def test_the_sink_gradient_is_the_formulas():
    """d/ds_h of sum(O * c) = -sum_{b,i} P_sink(b,h,i) rowsum(c * O)_(b,h,i),
    from numpy, against the backend's autodiff of the explicit path."""
    q, k, v = inputs()
    cotangent = random_floats(2, 11, HEADS, 5, seed=99)

    def attend(q, k, v, sinks):
        return attn_ops.dot_product_attention(
            q, k, v, is_causal=True, sink_logits=sinks
        )

    _, grads = value_and_gradients(attend, q, k, v, SINKS, cotangent=cotangent)
    causal = np.tril(np.ones((11, 11), bool))
    out, weights = dot_product_reference(q, k, v, mask=causal, sink_logits=SINKS)
    sink_weight = 1.0 - weights.sum(-1)  # (B, H, T)
    delta = np.einsum("bthd,bthd->bht", cotangent, out)
    np.testing.assert_allclose(
        grads[-1], -(sink_weight * delta).sum((0, 2)), atol=1e-5, rtol=1e-5
    )


def test_the_plan_rules_out_fused_kernels_and_flash_attention_refuses():
    shape = (2, 11, HEADS, 8)
    plan = plan_attention(shape, shape, shape, "float32", sink_logits=True)
    assert plan.kernel == "materialized" and "sink logits" in plan.not_fused
    q, k, v = inputs()
    with pytest.raises(ValueError, match="cannot compute attention with sink logits"):
        attn_ops.dot_product_attention(q, k, k, sink_logits=SINKS, flash_attention=True)
    with pytest.raises(ValueError, match=r"sink_logits.shape=\(3,\)"):
        attn_ops.dot_product_attention(q, k, v, sink_logits=SINKS[:3])
    with pytest.raises(TypeError, match="sink_logits"):
        attn_ops.dot_product_attention(q, k, v, sink_logits=np.zeros(HEADS, "int32"))


# --- The layers ----------------------------------------------------------------


def test_the_layer_against_its_own_weights_and_the_contract(tmp_path):
    """`sink_logits` `(num_heads,)`, zeros when built, float32 under mixed
    precision; with random sinks the layer (causal, a sliding window, grouped
    heads) gives the formula from its own weights; the layer contract
    (saving, compiled predict, int8, LoRA, policy maps)."""
    arguments = dict(
        num_heads=HEADS, num_key_value_heads=KV_HEADS, key_dim=4,
        sliding_window=3, use_sink_logits=True,
    )  # fmt: skip
    layer = keras_attn.MultiHeadAttention(**arguments, name="attention")
    x = random_floats(2, 7, 10, seed=3)
    layer.build(x.shape)
    assert layer.sink_logits.path == "attention/sink_logits"
    np.testing.assert_array_equal(to_numpy(layer.sink_logits), np.zeros(HEADS))
    layer.sink_logits.assign(SINKS)
    out = layer(x, use_causal_mask=True)
    i, j = np.arange(7)[:, None], np.arange(7)[None, :]
    mask = (j <= i) & (i - j < 3)
    expected = attention_reference(layer, x.astype(np.float64), x, mask=mask)
    np.testing.assert_allclose(to_numpy(out), expected, atol=1e-5)
    mixed = keras_attn.MultiHeadAttention(**arguments, dtype="mixed_bfloat16")
    assert keras.backend.standardize_dtype(mixed(x).dtype) == "bfloat16"
    assert mixed.sink_logits.dtype == "float32"
    run_layer_contract(
        keras_attn.MultiHeadAttention, arguments, {"query": x},
        call_kwargs={"use_causal_mask": True}, tmp_path=tmp_path,
        mixed_precision=False, quantization_modes=("int8",),
    )  # fmt: skip


def test_blocks_take_it_for_self_attention_only():
    block = keras_attn.TransformerDecoder(
        intermediate_dim=8, num_heads=2, use_sink_logits=True
    )
    block(random_floats(1, 3, 8), random_floats(1, 4, 8))
    assert block.get_config()["use_sink_logits"] is True
    assert block.self_attention.sink_logits.path.endswith("self_attention/sink_logits")
    assert block.cross_attention.sink_logits is None
    encoder = keras_attn.TransformerEncoder(
        intermediate_dim=8, num_heads=2, use_sink_logits=True
    )
    encoder(random_floats(1, 3, 8))
    assert encoder.get_config()["use_sink_logits"] is True


def test_refusals():
    with pytest.raises(ValueError, match="sink logits.*use_sink_logits=True"):
        keras_attn.MultiHeadAttention(
            num_heads=2, use_sink_logits=True, flash_attention=True
        )
    with pytest.raises(ValueError, match="sink logits"):
        keras_attn.TransformerEncoder(
            intermediate_dim=8, num_heads=2, use_sink_logits=True,
            flash_attention=True,
        )  # fmt: skip
    with pytest.raises(TypeError, match="use_sink_logits"):
        keras_attn.MultiHeadAttention(num_heads=2, use_sink_logits="yes")
    latent = keras_attn.layers.MultiHeadLatentAttention(
        num_heads=2, kv_lora_rank=4, qk_nope_head_dim=4, qk_rope_head_dim=2,
        v_head_dim=4,
    )  # fmt: skip
    with pytest.raises(ValueError, match="use_sink_logits=True"):
        keras_attn.TransformerDecoder(
            intermediate_dim=8, num_heads=2, self_attention=latent,
            use_sink_logits=True,
        )  # fmt: skip


# --- Decoding ------------------------------------------------------------------


@pytest.fixture(scope="module")
def model():
    """A tiny gpt-oss-like `decoder_lm`: grouped heads, rotary positions,
    a windowed and a global block, random sinks."""
    keras.utils.set_random_seed(0)
    block = dict(
        intermediate_dim=32, num_heads=4, num_key_value_heads=2,
        activation="silu", normalize_first=True, normalization="rms_norm",
        gated_feedforward=True, rope_max_wavelength=10000.0,
        use_sink_logits=True,
    )  # fmt: skip
    spec = DecoderLMSpec(
        vocabulary_size=13, hidden_dim=16,
        blocks=(dict(block, sliding_window=3), block),
    )  # fmt: skip
    model = decoder_lm(spec)
    sinks = [w for w in model.weights if w.name == "sink_logits"]
    assert len(sinks) == 2
    for seed, weight in enumerate(sinks):
        weight.assign(random_floats(4, seed=seed, scale=3.0))
    return model


def test_generate_gives_the_full_pass_greedy_tokens(model):
    prompts = np.array([[3, 4, 5, 6], [7, 8, 9, 10]])
    tokens = to_numpy(generate(model, prompts, max_length=12))
    logits = to_numpy(model(tokens))
    for row, row_logits in zip(tokens, logits, strict=True):
        for position in range(4, len(row)):
            chosen = row_logits[position - 1, row[position]]
            assert chosen >= row_logits[position - 1].max() - 1e-4, position


def test_saved_model_keeps_the_sinks(model, tmp_path):
    ids = np.array([[3, 4, 5, 6, 7]])
    loaded = save_and_load(model, tmp_path, "sinks")
    np.testing.assert_allclose(to_numpy(loaded(ids)), to_numpy(model(ids)), atol=1e-6)


# --- transformers' gpt-oss -----------------------------------------------------


@pytest.mark.skipif(
    BACKEND != "torch", reason="torch's module; the formula runs on every backend"
)
def test_gpt_oss_attention_with_copied_weights():
    """transformers' `GptOssAttention` (eager) with its sinks, grouped
    heads, biases and its rotary positions given as cos/sin of the default
    rope (no YaRN): the layer with the same weights gives its output. On
    PyTorch only: importing torch and transformers besides another backend
    costs more than the check (the numbers are the formula's, checked on
    every backend above)."""
    import torch
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssAttention

    heads, kv_heads, dim, width, length = 4, 2, 8, 12, 7
    config = GptOssConfig(
        hidden_size=width, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=dim, attention_bias=True, layer_types=["full_attention"],
        num_hidden_layers=1,
    )  # fmt: skip
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    theirs = GptOssAttention(config, 0).eval()
    with torch.no_grad():
        for parameter in theirs.parameters():
            parameter.normal_(0.0, 0.5)
    ours = keras_attn.MultiHeadAttention(
        num_heads=heads, num_key_value_heads=kv_heads, key_dim=dim,
        rope_max_wavelength=10000.0, use_sink_logits=True,
    )  # fmt: skip
    ours.build((1, length, width))
    copy_gpt_oss_weights(theirs, ours, heads, kv_heads, dim)

    x = random_floats(2, length, width, seed=4)
    inverse = 10000.0 ** -(np.arange(0, dim, 2) / dim)
    angles = torch.tensor(np.arange(length)[None, :, None] * inverse[None, None])
    causal = np.triu(np.full((length, length), -np.inf), 1)
    with torch.no_grad():
        expected, _ = theirs(
            torch.tensor(x),
            (torch.cos(angles).float(), torch.sin(angles).float()),
            torch.tensor(causal[None, None], dtype=torch.float32),
        )
    np.testing.assert_allclose(
        to_numpy(ours(x, use_causal_mask=True)), expected.numpy(), atol=1e-5
    )


def copy_gpt_oss_weights(theirs, ours, heads, kv_heads, dim):
    def kernel(linear, count):  # (out, in) -> (in, heads, dim)
        return linear.weight.detach().numpy().T.reshape(-1, count, dim)

    for name, count in (("q", heads), ("k", kv_heads), ("v", kv_heads)):
        linear = getattr(theirs, f"{name}_proj")
        dense = {"q": ours.query_dense, "k": ours.key_dense, "v": ours.value_dense}
        dense[name].kernel.assign(kernel(linear, count))
        dense[name].bias.assign(linear.bias.detach().numpy().reshape(count, dim))
    output = theirs.o_proj.weight.detach().numpy().T.reshape(heads, dim, -1)
    ours.output_dense.kernel.assign(output)
    ours.output_dense.bias.assign(theirs.o_proj.bias.detach().numpy())
    ours.sink_logits.assign(theirs.sinks.detach().numpy())
