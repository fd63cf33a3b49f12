"""MultiHeadLatentAttention (DeepSeek-V2/V3 MLA): the forward against
transformers' DeepseekV3Attention, the absorbed decoding form against the
expanded forward, its LatentCache, decoder blocks and `generate` built from
it, and its errors."""

import keras
import numpy as np
import pytest
import torch
from transformers import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3Attention,
    DeepseekV3RotaryEmbedding,
)

import keras_attn
from keras_attn.cache import DenseCache, LatentCache
from keras_attn.generation import generate
from keras_attn.layers import MultiHeadLatentAttention
from keras_attn.models import DecoderLMSpec, decoder_lm
from keras_attn.models.decoder_lm import spec_of
from tests.helpers.backend import BACKEND, to_numpy
from tests.helpers.contract import run_layer_contract
from tests.helpers.doubles import count_key_widths

# Distinct sizes, so that a swapped axis cannot pass.
WIDTH, HEADS, LATENT, NOPE, ROPE, VALUE, QUERY_LATENT = 16, 4, 7, 5, 6, 3, 11
SIZES = dict(
    num_heads=HEADS,
    kv_lora_rank=LATENT,
    qk_nope_head_dim=NOPE,
    qk_rope_head_dim=ROPE,
    v_head_dim=VALUE,
)
VOCAB = 29


def random_input(batch=2, length=5, seed=0):
    return np.random.RandomState(seed).randn(batch, length, WIDTH).astype("float32")


def transformers_attention(q_lora_rank, rope_interleave):
    """A tiny DeepseekV3Attention, its weights random, and its rotary table."""
    config = DeepseekV3Config(
        hidden_size=WIDTH,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        q_lora_rank=q_lora_rank,
        kv_lora_rank=LATENT,
        qk_nope_head_dim=NOPE,
        qk_rope_head_dim=ROPE,
        v_head_dim=VALUE,
        rope_interleave=rope_interleave,
        vocab_size=VOCAB,
        num_hidden_layers=1,
        intermediate_size=8,
        moe_intermediate_size=8,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    attention = DeepseekV3Attention(config, layer_idx=0).eval()
    for weight in attention.parameters():
        torch.nn.init.normal_(weight, std=0.3)
    return attention, DeepseekV3RotaryEmbedding(config)


def copy_weights(layer, attention):
    """transformers' `(out, in)` matrices into the layer's per-head kernels."""
    w = {k: v.detach().numpy() for k, v in attention.state_dict().items()}
    qk = NOPE + ROPE
    if layer.q_lora_rank is None:
        layer.query.kernel.assign(w["q_proj.weight"].T.reshape(WIDTH, HEADS, qk))
    else:
        layer.query_a.kernel.assign(w["q_a_proj.weight"].T)
        layer.query_a_norm.scale.assign(w["q_a_layernorm.weight"])
        rank = layer.q_lora_rank
        layer.query_b.kernel.assign(w["q_b_proj.weight"].T.reshape(rank, HEADS, qk))
    layer.key_value_a.kernel.assign(w["kv_a_proj_with_mqa.weight"].T)
    layer.key_value_a_norm.scale.assign(w["kv_a_layernorm.weight"])
    kv_b = w["kv_b_proj.weight"].T.reshape(LATENT, HEADS, NOPE + VALUE)
    layer.key_value_b.kernel.assign(kv_b)
    output = w["o_proj.weight"].T.reshape(HEADS, VALUE, WIDTH)
    layer.attention_output.kernel.assign(output)


def transformers_output(attention, rope, x):
    x = torch.tensor(x)
    positions = torch.arange(x.shape[1])[None].expand(x.shape[0], -1)
    causal = torch.full((x.shape[1],) * 2, float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        return attention(x, rope(x, positions), causal)[0].numpy()


@pytest.fixture(scope="module", params=[(None, True), (None, False), (11, True)])
def pair(request):
    """The layer and transformers' module with the same weights: direct
    queries with interleaved and plain rotary channels, low-rank queries."""
    q_lora_rank, interleave = request.param
    attention, rope = transformers_attention(q_lora_rank, interleave)
    layer = MultiHeadLatentAttention(
        **SIZES, q_lora_rank=q_lora_rank, rope_interleave=interleave
    )
    layer.build((None, None, WIDTH))
    copy_weights(layer, attention)
    return layer, attention, rope


def test_forward_matches_transformers(pair):
    layer, attention, rope = pair
    x = random_input()
    expected = transformers_output(attention, rope, x)
    actual = to_numpy(layer(x, use_causal_mask=True))
    np.testing.assert_allclose(actual, expected, atol=1e-5)


def test_absorbed_decoding_equals_the_expanded_forward(pair):
    """Token by token through `decode_unchecked` (absorbed), and a prefill
    then a step through `call` with the cache (expanded): the full pass."""
    layer, attention, rope = pair
    x = random_input(length=6, seed=1)
    expected = transformers_output(attention, rope, x)
    cache, steps = layer.get_empty_cache(2, max_length=6), []
    for i in range(6):
        token = keras.ops.convert_to_tensor(x[:, i : i + 1])
        y, cache = layer.decode_unchecked(token, cache, i, mask=cache.mask(i, 1))
        steps.append(to_numpy(y))
    np.testing.assert_allclose(np.concatenate(steps, 1), expected, atol=1e-5)
    cache = layer.get_empty_cache(2, max_length=6)
    first, cache = layer(x[:, :4], use_causal_mask=True, cache=cache,
                         cache_update_index=0)  # fmt: skip
    rest, cache = layer(x[:, 4:], use_causal_mask=True, cache=cache,
                        cache_update_index=4)  # fmt: skip
    actual = np.concatenate([to_numpy(first), to_numpy(rest)], 1)
    np.testing.assert_allclose(actual, expected, atol=1e-5)


def test_the_cache_holds_the_normalized_latent_and_the_rotated_key(pair):
    layer = pair[0]
    x = random_input(length=3, seed=2)
    cache = layer.get_empty_cache(2, max_length=5)
    _, cache = layer(x, use_causal_mask=True, cache=cache, cache_update_index=0)
    held = to_numpy(cache.latent)
    assert isinstance(cache, LatentCache) and held.shape == (2, 5, LATENT + ROPE)
    latent, rope = (to_numpy(t) for t in layer._latents(x, np.arange(3)))
    np.testing.assert_allclose(held[:, :3], np.concatenate([latent, rope], -1))
    assert not held[:, 3:].any()  # not written yet
    rms = np.sqrt((held[:, :3, :LATENT] ** 2).mean(-1))  # the norm's scale is random
    assert not np.allclose(rms, 1.0) and cache.nbytes == 2 * 5 * (LATENT + ROPE) * 4


def test_layer_contract(tmp_path):
    """Config, symbolic and compiled calls, `.keras`, mixed precision,
    quantization, LoRA and policy maps."""
    run_layer_contract(
        MultiHeadLatentAttention,
        dict(SIZES, q_lora_rank=QUERY_LATENT),
        {"query": random_input(length=3)},
        {"use_causal_mask": True},
        expected_output_shape=(2, 3, WIDTH),
        tmp_path=tmp_path,
        quantization_modes=("int8",),
    )


def test_lora_adapts_every_projection_and_decoding_follows():
    layer = MultiHeadLatentAttention(**SIZES, q_lora_rank=QUERY_LATENT)
    x = random_input(length=4, seed=3)
    before = to_numpy(layer(x, use_causal_mask=True))
    layer.enable_lora(2)
    names = {w.path.split("/")[-2] for w in layer.trainable_weights}
    assert names == {"query_a", "query_b", "key_value_a", "key_value_b",
                     "attention_output"}  # fmt: skip
    for weight in layer.trainable_weights:  # B starts at zero: move it
        weight.assign(np.full(weight.shape, 0.1, "float32"))
    after = to_numpy(layer(x, use_causal_mask=True))
    assert not np.allclose(after, before, atol=1e-3)
    cache = layer.get_empty_cache(2, 4)
    _, cache = layer.decode_unchecked(keras.ops.convert_to_tensor(x[:, :3]), cache,
                                      0, mask=cache.mask(0, 3))  # fmt: skip
    y, _ = layer.decode_unchecked(keras.ops.convert_to_tensor(x[:, 3:]), cache, 3,
                                  mask=cache.mask(3, 1))  # fmt: skip
    np.testing.assert_allclose(to_numpy(y), after[:, 3:], atol=1e-5)


def mla_model():
    keras.utils.set_random_seed(0)
    attention = MultiHeadLatentAttention(**SIZES, q_lora_rank=QUERY_LATENT)
    block = dict(
        intermediate_dim=24,
        num_heads=HEADS,
        normalize_first=True,
        normalization="rms_norm",
        gated_feedforward=True,
        activation="silu",
        self_attention=keras.saving.serialize_keras_object(attention),
    )
    spec = DecoderLMSpec(vocabulary_size=VOCAB, hidden_dim=WIDTH,
                         blocks=(block, block))  # fmt: skip
    return decoder_lm(spec)


@pytest.fixture(scope="module")
def model():
    return mla_model()


def assert_greedy(model, max_length):
    """Greedy tokens of `generate` are the argmax of one full pass."""
    prompts = np.array([[3, 4, 5, 6], [7, 8, 9, 10]])
    tokens = to_numpy(generate(model, prompts, max_length=max_length))
    logits = to_numpy(model(tokens))
    for row, row_logits in zip(tokens, logits, strict=True):
        for position in range(4, len(row)):
            chosen = row_logits[position - 1, row[position]]
            assert chosen >= row_logits[position - 1].max() - 1e-4, position


def test_generate_greedy_equals_the_full_forward(model):
    """Past the first cache segment (64 positions) too; each block has its
    own layer."""
    blocks = [layer for layer in model.layers if "transformer_layer" in layer.name]
    first, second = (b.self_attention for b in blocks)
    assert first is not second and first.name == "self_attention"
    assert isinstance(first, MultiHeadLatentAttention)
    assert_greedy(model, max_length=68)


@pytest.mark.skipif(
    BACKEND != "torch",
    reason="suite time (40 s on JAX, 20 s on TensorFlow, compiling the int8 "
    "kernels): the branch is keras.ops alone, the same on every backend",
)
def test_quantized_models_decode_in_the_expanded_form():
    """An int8 `key_value_b` holds no float W_UK to absorb: the steps expand
    the latents instead, and still give the full pass's argmax."""
    quantized = mla_model()
    quantized.quantize("int8")
    assert_greedy(quantized, max_length=10)


def test_left_padded_prompts_decode_as_each_prompt_alone(model):
    """A shorter prompt is left-padded, and its padding is never attended
    to: its row decodes as the prompt alone."""
    together = to_numpy(generate(model, [[3, 4, 5, 6], [7, 8]], max_length=10))
    alone = to_numpy(generate(model, [[7, 8]], max_length=8))
    np.testing.assert_array_equal(together[1, :8], alone[0])  # rows come back unpadded


def test_a_prompts_prefill_skips_slots_in_the_absorbed_form(
    model, small_chunks, monkeypatch
):
    """The absorbed prefill (index 0 of a `LatentCache`) is causal attention
    to the chunked path: chunks of 4 rows of a 9-token prompt compute fewer
    slots than the prompt's, and the tokens and scores are the materialized
    path's."""
    widths = count_key_widths(monkeypatch)
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9]]
    tokens, scores = generate(model, prompts, max_length=12, return_scores=True)
    assert small_chunks.calls and min(widths) < 9, widths
    small_chunks()
    expected = generate(model, prompts, max_length=12, return_scores=True)
    np.testing.assert_array_equal(to_numpy(tokens), to_numpy(expected[0]))
    np.testing.assert_allclose(
        to_numpy(scores), to_numpy(expected[1]), atol=1e-5, rtol=1e-5
    )


def test_spec_and_keras_round_trips(model, tmp_path):
    tokens = np.array([[1, 2, 3, 4, 5]])
    expected = to_numpy(model(tokens))
    again = decoder_lm(spec_of(model))
    again.set_weights(model.get_weights())
    np.testing.assert_allclose(to_numpy(again(tokens)), expected, atol=1e-6)
    path = str(tmp_path / "mla.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    np.testing.assert_allclose(to_numpy(loaded(tokens)), expected, atol=1e-6)


def test_the_latent_cache_is_under_an_eighth_of_a_dense_one():
    """DeepSeek-V3's attention shapes (128 heads there, 16 here): per token
    `512 + 64` numbers against `2 * 16 * 192` (0.094); read from `nbytes`."""
    mla = MultiHeadLatentAttention(
        num_heads=16, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128,
    )  # fmt: skip
    mha = keras_attn.MultiHeadAttention(num_heads=16, key_dim=192)
    for layer in (mla, mha):
        layer.build((None, None, 32))
    latent = mla.get_empty_cache(1, 64)
    dense = DenseCache(mha.get_empty_cache(1, 64))
    ratio = latent.nbytes / dense.nbytes
    assert ratio == pytest.approx((512 + 64) / (2 * 16 * 192)) and ratio <= 1 / 8


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(SIZES, qk_rope_head_dim=5), "qk_rope_head_dim"),
        (dict(SIZES, kv_lora_rank=0), "kv_lora_rank"),
        (dict(SIZES, q_lora_rank=-1), "q_lora_rank"),
        (dict(SIZES, rope_interleave="yes"), "rope_interleave"),
        (dict(SIZES, rope_scaling={"rope_type": "bad"}), "rope_scaling"),
        (dict(SIZES, flash_attention=True), "flash_attention|width"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        MultiHeadLatentAttention(**kwargs)


def test_bad_calls():
    layer = MultiHeadLatentAttention(**SIZES)
    x = random_input(length=3)
    layer(x)
    with pytest.raises(ValueError, match="query"):
        layer(np.zeros((2, 3, WIDTH + 1), "float32"))
    with pytest.raises(ValueError, match="cache_update_index"):
        layer(x, cache=layer.get_empty_cache(2, 4))
    with pytest.raises(TypeError, match="LatentCache"):
        layer(x, cache=np.zeros((2, 2, HEADS, 4, 11), "float32"),
              cache_update_index=0)  # fmt: skip
    with pytest.raises(ValueError, match="cache.latent"):
        layer(x, cache=LatentCache.empty(2, 4, LATENT), cache_update_index=0)
    with pytest.raises(ValueError, match="value_mask"):
        layer(x, value_mask=np.ones((2, 4), bool))
    with pytest.raises(ValueError, match="dtype"):
        layer.get_empty_cache(2, 4, dtype="int8")


def test_blocks_refuse_options_the_layer_carries():
    attention = MultiHeadLatentAttention(**SIZES)
    block = dict(intermediate_dim=8, num_heads=HEADS, self_attention=attention)
    with pytest.raises(ValueError, match="rope_max_wavelength"):
        keras_attn.TransformerDecoder(**block, rope_max_wavelength=10000.0)
    with pytest.raises(ValueError, match="sliding_window"):
        keras_attn.TransformerDecoder(**block, sliding_window=4)
    with pytest.raises(ValueError, match="num_heads"):
        keras_attn.TransformerDecoder(**dict(block, num_heads=2))
    with pytest.raises(TypeError, match="self_attention"):
        keras_attn.TransformerDecoder(**dict(block, self_attention="mla"))
    decoder_only = keras_attn.TransformerDecoder(**block, num_key_value_heads=2)
    with pytest.raises(ValueError, match="num_key_value_heads"):
        decoder_only(random_input())
