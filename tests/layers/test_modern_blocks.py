"""Today's families from the same blocks: parity with keras-hub's Llama,
Mistral and Gemma (1 and 2) decoder blocks (weights copied across), and the
properties of rotary positions, sliding windows, the sublayers' output norms
and the LLaMA-style block."""

import functools

import keras
import numpy as np
import pytest

from keras_attn import MultiHeadAttention, TransformerDecoder, TransformerEncoder
from tests.helpers.backend import to_numpy
from tests.helpers.builders import random_floats
from tests.helpers.contract import run_layer_contract

PARITY = dict(atol=1e-5, rtol=1e-5)
WIDTH, HEADS, KV_HEADS, HIDDEN = 16, 4, 2, 24
LLAMA = dict(
    intermediate_dim=HIDDEN,
    num_heads=HEADS,
    activation="silu",
    layer_norm_epsilon=1e-5,
    normalize_first=True,
    num_key_value_heads=KV_HEADS,
    normalization="rms_norm",
    gated_feedforward=True,
    use_bias=False,
    rope_max_wavelength=10000.0,
)
# Qwen2's biases: query, key and value alone (an attention option and a block one).
QWEN2_BIASES = dict(use_bias=True, use_output_bias=False, use_feedforward_bias=False)


def padded_batch(length=7):
    x = random_floats(3, length, WIDTH, seed=3)
    padding = np.arange(length)[None] < np.array([[length], [4], [2]])
    return x, padding


def copy_by_name(ours, theirs, names, transform=None):
    """Copy `theirs` weights into `ours`: `names` maps our sublayer paths to
    theirs; `transform(name, array)` adapts a layout where one differs."""
    mine = {w.path.split("/", 1)[1]: w for w in ours.weights}
    for our_name, their_name in names.items():
        (source,) = [w for w in theirs.weights if w.path.endswith(their_name)]
        value = to_numpy(source)
        mine[our_name].assign(transform(our_name, value) if transform else value)


def hub_module(path):
    pytest.importorskip("keras_hub")
    import importlib

    return importlib.import_module(f"keras_hub.src.models.{path}")


def llama_names(norm="layernorm"):
    return {
        "self_attention/query/kernel": "self_attention/query/kernel",
        "self_attention/key/kernel": "self_attention/key/kernel",
        "self_attention/value/kernel": "self_attention/value/kernel",
        "self_attention/attention_output/kernel": (
            "self_attention/attention_output/kernel"
        ),
        "self_attention_layer_norm/scale": f"self_attention_{norm}/scale",
        **{
            f"feedforward_{name}_dense/kernel": f"feedforward_{name}_dense/kernel"
            for name in ("intermediate", "gate", "output")
        },
        "feedforward_layer_norm/scale": f"feedforward_{norm}/scale",
    }


def test_llama_block_same_numbers_as_keras_hub():
    module = hub_module("llama.llama_decoder")
    theirs = module.LlamaTransformerDecoder(
        intermediate_dim=HIDDEN,
        num_query_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        layer_norm_epsilon=1e-5,
    )
    ours = TransformerDecoder(**LLAMA)
    x, padding = padded_batch()
    theirs(x)
    ours(x)
    assert len(ours.weights) == len(theirs.weights) == 9
    ours.set_weights(theirs.get_weights())  # the same order as keras-hub's
    expected = to_numpy(theirs(x, decoder_padding_mask=padding))
    actual = to_numpy(ours(x, decoder_padding_mask=padding))
    np.testing.assert_allclose(actual, expected, **PARITY)


def test_mistral_block_same_numbers_as_keras_hub():
    module = hub_module("mistral.mistral_transformer_decoder")
    theirs = module.MistralTransformerDecoder(
        intermediate_dim=HIDDEN,
        num_query_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        layer_norm_epsilon=1e-5,
        sliding_window=3,
    )
    ours = TransformerDecoder(**LLAMA, sliding_window=3)
    x, padding = padded_batch(9)
    theirs(x)
    ours(x)
    ours.set_weights(theirs.get_weights())
    expected = to_numpy(theirs(x, decoder_padding_mask=padding))
    actual = to_numpy(ours(x, decoder_padding_mask=padding))
    # Padded positions whose whole window is padding attend to nothing: ours
    # give zeros there, keras-hub a softmax over masked logits.
    np.testing.assert_allclose(actual[padding], expected[padding], **PARITY)


def test_qwen2_block_same_numbers_as_keras_hub():
    """Qwen2's block: LLaMA's, with biases on query, key and value alone
    (`use_bias=True, use_output_bias=False, use_feedforward_bias=False`;
    RMS norms have no offsets). The biases random, so that one in another's
    place, or missing, cannot pass."""
    module = hub_module("qwen.qwen_decoder")
    theirs = module.QwenTransformerDecoder(
        intermediate_dim=HIDDEN,
        num_query_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        layer_norm_epsilon=1e-5,
    )
    ours = TransformerDecoder(**{**LLAMA, **QWEN2_BIASES})
    x, padding = padded_batch()
    theirs(x)
    ours(x)
    assert len(ours.weights) == len(theirs.weights) == 12
    for seed, weight in enumerate(theirs.weights):
        if weight.path.endswith("/bias"):
            weight.assign(random_floats(*weight.shape, seed=20 + seed))
    ours.set_weights(theirs.get_weights())  # the same order as keras-hub's
    expected = to_numpy(theirs(x, decoder_padding_mask=padding))
    actual = to_numpy(ours(x, decoder_padding_mask=padding))
    np.testing.assert_allclose(actual, expected, **PARITY)


GEMMA_NAMES = {
    "self_attention/query/kernel": "attention/query/kernel",
    "self_attention/key/kernel": "attention/key/kernel",
    "self_attention/value/kernel": "attention/value/kernel",
    "self_attention/attention_output/kernel": "attention/attention_output/kernel",
    "self_attention_layer_norm/scale": "pre_attention_norm/scale",
    "feedforward_gate_dense/kernel": "ffw_gating/kernel",
    "feedforward_intermediate_dense/kernel": "ffw_gating_2/kernel",
    "feedforward_output_dense/kernel": "ffw_linear/kernel",
    "feedforward_layer_norm/scale": "pre_ffw_norm/scale",
}
GEMMA_2_NAMES = {
    **GEMMA_NAMES,
    "self_attention_output_norm/scale": "post_attention_norm/scale",
    "feedforward_output_norm/scale": "post_ffw_norm/scale",
}


def from_gemma(name, value):
    """Gemma's layouts: projections `(heads, width, dim)` where ours are
    `(width, heads, dim)`; RMS norms scale by `1 + scale` where Keras' scale
    by `scale`."""
    if name.endswith(("query/kernel", "key/kernel", "value/kernel")):
        return np.transpose(value, (1, 0, 2))
    return value + 1.0 if name.endswith("norm/scale") else value


# A cap of 0.5 changes these outputs by ~5: the test sees whether it is applied.
@pytest.mark.parametrize(
    "soft_cap, post_norms",
    [(None, False), (0.5, False), (0.5, True)],
    ids=["gemma", "soft-capped", "gemma-2"],
)
def test_gemma_block_same_numbers_as_keras_hub(soft_cap, post_norms):
    """Gemma's block with GeGLU (tanh-approximated GELU, as Gemma), RMSNorm
    and RoPE; with `logit_soft_cap`, Gemma 2's soft-capping, and with
    `post_norms` Gemma 2's post-attention and post-feed-forward norms
    (`normalize_sublayer_outputs`). Gemma's RoPE interleaves the rotated
    halves of both queries and keys: the same permutation of both leaves
    every score unchanged. Every norm gets random scales, so that a norm in
    another's place cannot pass."""
    module = hub_module("gemma.gemma_decoder_block")
    head_dim = 8
    theirs = module.GemmaDecoderBlock(
        hidden_dim=WIDTH,
        intermediate_dim=2 * HIDDEN,  # Gemma halves it for each branch
        head_dim=head_dim,
        num_query_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        logit_soft_cap=soft_cap,
        use_post_attention_norm=post_norms,
        use_post_ffw_norm=post_norms,
        layer_norm_epsilon=1e-6,
    )
    gelu_tanh = functools.partial(keras.activations.gelu, approximate=True)
    ours = TransformerDecoder(
        **{**LLAMA, "layer_norm_epsilon": 1e-6, "activation": gelu_tanh},
        key_dim=head_dim,
        logit_soft_cap=soft_cap,
        normalize_sublayer_outputs=post_norms,
    )
    x, padding = padded_batch()
    theirs(x)
    ours(x)
    norm_scales = [w for w in theirs.weights if w.path.endswith("norm/scale")]
    assert len(norm_scales) == (4 if post_norms else 2)
    for seed, scale in enumerate(norm_scales):
        scale.assign(random_floats(*scale.shape, seed=10 + seed, scale=0.5))
    names = GEMMA_2_NAMES if post_norms else GEMMA_NAMES
    assert len(ours.weights) == len(names)  # every weight of ours copied
    copy_by_name(ours, theirs, names, from_gemma)
    expected = to_numpy(theirs(x, padding_mask=padding))
    actual = to_numpy(ours(x, decoder_padding_mask=padding))
    np.testing.assert_allclose(actual, expected, **PARITY)


def test_llama_block_parameter_count_is_the_closed_formula():
    """Per block: `W (H + 2 K) D` query/key/value, `H D W` output, `3 W F`
    gated feed-forward, `2 W` RMS norm scales; no biases."""
    block = TransformerDecoder(**LLAMA)
    block(random_floats(1, 3, WIDTH))
    d = WIDTH // HEADS
    expected = WIDTH * (HEADS + 2 * KV_HEADS) * d + HEADS * d * WIDTH
    expected += 3 * WIDTH * HIDDEN + 2 * WIDTH
    assert block.count_params() == expected


@pytest.mark.parametrize(
    "layer",
    [
        MultiHeadAttention(HEADS, rope_max_wavelength=10000.0),
        TransformerDecoder(**LLAMA),
    ],
    ids=["attention", "decoder"],
)
def test_rotary_attention_depends_only_on_relative_positions(layer):
    """Shifting every position by the same offset changes no output, and
    reversing the tokens (with no causal mask) does change it: the positions
    matter. Keras' `layer(x, x)` is self-attention too."""
    x = random_floats(2, 6, WIDTH)
    kwargs = {"use_causal_mask": False}
    output = to_numpy(layer(x, **kwargs))
    shifted = to_numpy(layer(x, positions=np.arange(6) + 1000, **kwargs))
    np.testing.assert_allclose(shifted, output, atol=2e-5)
    reversed_back = to_numpy(layer(x[:, ::-1].copy(), **kwargs))[:, ::-1]
    assert not np.allclose(reversed_back, output, atol=1e-3)
    if isinstance(layer, MultiHeadAttention):  # Keras' form, `layer(x, x)`
        per_row = np.stack([np.arange(6) + 7, np.arange(6) + 300])
        x = keras.ops.convert_to_tensor(x)
        keras_style = to_numpy(layer(x, x, positions=per_row))
        np.testing.assert_allclose(keras_style, output, atol=2e-5)


def test_encoder_rotates_the_positions_of_its_self_attention():
    encoder = TransformerEncoder(**{**LLAMA, "gated_feedforward": False})
    x = random_floats(2, 6, WIDTH)
    output = to_numpy(encoder(x))
    reversed_back = to_numpy(encoder(x[:, ::-1].copy()))[:, ::-1]
    assert not np.allclose(reversed_back, output, atol=1e-3)
    assert encoder.self_attention.rope_max_wavelength == 10000.0


def test_a_token_beyond_the_window_changes_nothing_downstream():
    window = 3
    block = TransformerDecoder(**LLAMA, sliding_window=window)
    x = random_floats(1, 8, WIDTH)
    changed = x.copy()
    changed[:, 2] += 5.0
    a, b = to_numpy(block(x)), to_numpy(block(changed))
    np.testing.assert_allclose(a[:, 2 + window :], b[:, 2 + window :], atol=1e-6)
    assert not np.allclose(a[:, 2 + window - 1], b[:, 2 + window - 1], atol=1e-4)


def test_cached_decoding_with_rope_and_window_equals_the_full_pass():
    block = TransformerDecoder(**LLAMA, sliding_window=3)
    x, padding = padded_batch(8)
    full = to_numpy(block(x, decoder_padding_mask=padding))
    cache = block.get_empty_self_attention_cache(3, 8)
    steps = []
    for i in range(8):
        y, cache = block(
            x[:, i : i + 1],
            decoder_padding_mask=padding,
            self_attention_cache=cache,
            self_attention_cache_update_index=i,
        )
        steps.append(to_numpy(y))
    np.testing.assert_allclose(np.concatenate(steps, axis=1), full, atol=1e-5)


MODERN = dict(normalize_qk=True, logit_soft_cap=30.0, rope_scaling_factor=2.0)
OUTPUT_NORMS = {"normalize_sublayer_outputs": True}  # a block option


@pytest.mark.parametrize(
    "layer_cls, kwargs, inputs",
    [
        (
            MultiHeadAttention,
            {
                "num_heads": 4,
                "num_key_value_heads": 2,
                "rope_max_wavelength": 500.0,
                "use_output_bias": False,
            },
            {"query": random_floats(2, 5, WIDTH)},
        ),
        (
            TransformerDecoder,
            {**LLAMA, "sliding_window": 3, **OUTPUT_NORMS, **QWEN2_BIASES},
            {"decoder_sequence": random_floats(2, 5, WIDTH)},
        ),
        (
            TransformerEncoder,
            # No offsets, feed-forward biases alone (Llama's `mlp_bias=True`).
            {
                **LLAMA,
                "normalization": "layer_norm",
                "use_feedforward_bias": True,
                **OUTPUT_NORMS,
            },
            {"inputs": random_floats(2, 5, WIDTH)},
        ),
    ],
    ids=["attention", "llama-decoder", "encoder"],
)
def test_layer_contract_with_every_new_option(tmp_path, layer_cls, kwargs, inputs):
    """Config, `.keras` round trip, spec, jit and mixed precision with RoPE,
    QK-norm, soft-capping, biases on query, key and value alone (and in the
    blocks RMSNorm, the gated network, a window, the sublayers' output
    norms; in the encoder no biases but the feed-forward's); quantize, LoRA
    and dtype policy maps on the LLaMA block, which has every sublayer kind
    the others have."""
    run_layer_contract(
        layer_cls,
        {**kwargs, **MODERN},
        inputs,
        expected_output_shape=(2, 5, WIDTH),
        tmp_path=tmp_path,
        machinery=layer_cls is TransformerDecoder,
        quantization_modes=("int8",),  # every mode: the attention's contracts
    )


def randomize(*norms):
    """Random weights in `norms` (scales, and offsets where they have them),
    so that no two are alike."""
    for i, norm in enumerate(norms):
        for j, weight in enumerate(norm.weights):
            weight.assign(random_floats(*weight.shape, seed=2 * i + j))


def test_post_norm_normalizes_each_sublayer_output_then_the_sum():
    """Post-norm with `normalize_sublayer_outputs`: each step is
    `Norm(x + Norm_out(F(x)))`, written out here with the decoder's own
    sublayers (self-attention, cross-attention, the gated feed-forward); a
    build then a call creates no weight. (The LLaMA sizes, whose operations
    the tests above have JAX compile: this one takes no compilation of its
    own.)"""
    options = {"normalize_first": False, "normalize_sublayer_outputs": True}
    block = TransformerDecoder(**{**LLAMA, **options})
    (x, _), memory = padded_batch(), random_floats(3, 7, WIDTH, seed=1)
    block.build(x.shape, memory.shape)
    paths = [w.path for w in block.weights]
    output_norms = [
        block.self_attention_output_norm,
        block.cross_attention_output_norm,
        block.feedforward_output_norm,
    ]
    assert [norm.name for norm in output_norms] == [
        "self_attention_output_norm",
        "cross_attention_output_norm",
        "feedforward_output_norm",
    ]
    randomize(*output_norms, block.self_attention_layer_norm)
    actual = to_numpy(block(x, memory))
    assert [w.path for w in block.weights] == paths

    def step(norm, output_norm, x, branch):
        return norm(x + output_norm(branch))

    x = keras.ops.convert_to_tensor(x)
    h = step(
        block.self_attention_layer_norm,
        block.self_attention_output_norm,
        x,
        block.self_attention(x, use_causal_mask=True),
    )
    h = step(
        block.cross_attention_layer_norm,
        block.cross_attention_output_norm,
        h,
        block.cross_attention(h, memory),
    )
    gate = keras.activations.silu(block.feedforward_gate_dense(h))
    hidden = gate * block.feedforward_intermediate_dense(h)
    expected = step(
        block.feedforward_layer_norm,
        block.feedforward_output_norm,
        h,
        block.feedforward_output_dense(hidden),
    )
    np.testing.assert_allclose(actual, to_numpy(expected), atol=1e-5)


@pytest.mark.parametrize("layer_cls", [TransformerEncoder, TransformerDecoder])
def test_normalize_sublayer_outputs_must_be_a_bool(layer_cls):
    with pytest.raises(
        TypeError,
        match=r"`normalize_sublayer_outputs` must be a bool.*"
        r"normalize_sublayer_outputs='yes' of type str",
    ):
        layer_cls(HIDDEN, HEADS, normalize_sublayer_outputs="yes")
    assert not layer_cls(HIDDEN, HEADS).normalize_sublayer_outputs
