"""Numerical parity with PyTorch's own attention and Transformer layers.

Each test builds a `torch.nn` reference module (CPU, float32, `eval()`, dropout
0, `batch_first=True`), gives it random weights, copies them into our layer and
compares the outputs on every Keras backend. torch is only the reference here;
our layers run on whatever `KERAS_BACKEND` is. Sizes are all distinct (batch 3,
target length 5, source length 7, width 16, 4 heads of 4, key width 10, value
width 6, feed-forward 24), so a swapped axis cannot pass by accident.
"""

import keras
import numpy as np
import pytest
import torch
from torch import nn

from keras_attn import MultiHeadAttention, TransformerDecoder, TransformerEncoder

BATCH, TARGET, SOURCE = 3, 5, 7
WIDTH, HEADS, FFN = 16, 4, 24
KEY_WIDTH, VALUE_WIDTH = 10, 6
HEAD_DIM = WIDTH // HEADS
TOLERANCE = {"atol": 1e-5, "rtol": 1e-5}
# Real-token counts per batch row; the first token is never padded, so no query
# row is left without a key (torch gives NaN there).
TARGET_LENGTHS = (5, 3, 1)
SOURCE_LENGTHS = (7, 4, 2)


@pytest.fixture(autouse=True)
def _torch_reference():
    """Seeds torch; turns off the eval-mode fast path (zeros at padded rows)."""
    torch.manual_seed(0)
    fastpath = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    yield
    torch.backends.mha.set_fastpath_enabled(fastpath)


# ----------------------------------------------------------------------------
# Helpers: inputs, masks, random torch weights, weight copying.
# ----------------------------------------------------------------------------


def _rng():
    return np.random.default_rng(2024)


def _inputs(rng, *shape):
    return rng.standard_normal(shape).astype("float32")


def _padding(lengths, length):
    """Bool `(batch, length)`, True for real tokens (our convention)."""
    return np.arange(length)[None, :] < np.asarray(lengths)[:, None]


def _torch(array):
    return torch.from_numpy(np.ascontiguousarray(array))


def _numpy(tensor):
    return tensor.detach().cpu().numpy()


def _ours(tensor):
    return keras.ops.convert_to_numpy(tensor)


def _causal_torch_mask(length):
    """torch's causal mask as bool, True above the diagonal (= may not attend).

    Bool like the key padding masks: torch warns about mixing float and bool.
    """
    return torch.isinf(nn.Transformer.generate_square_subsequent_mask(length))


def _randomize(module, rng):
    """Random weights *and* biases (torch zero-initializes the biases)."""
    with torch.no_grad():
        for submodule in module.modules():
            for name, parameter in submodule.named_parameters(recurse=False):
                values = rng.uniform(-0.5, 0.5, parameter.shape)
                if isinstance(submodule, nn.LayerNorm) and name == "weight":
                    values = 1.0 + values
                parameter.copy_(_torch(values.astype("float32")))
    return module.eval()


def _assign(variable, value):
    value = _numpy(value) if isinstance(value, torch.Tensor) else value
    assert tuple(variable.shape) == value.shape, (variable.path, value.shape)
    variable.assign(value)


def copy_attention_weights(ours, reference):
    """`torch.nn.MultiheadAttention` -> our `MultiHeadAttention` (built)."""
    width, heads = reference.embed_dim, reference.num_heads
    head_dim = width // heads
    if reference._qkv_same_embed_dim:
        query, key, value = np.split(_numpy(reference.in_proj_weight), 3, axis=0)
    else:
        query, key, value = (
            _numpy(reference.q_proj_weight),
            _numpy(reference.k_proj_weight),
            _numpy(reference.v_proj_weight),
        )
    biases = np.split(_numpy(reference.in_proj_bias), 3)
    for dense, weight, bias in zip(
        (ours.query_dense, ours.key_dense, ours.value_dense),
        (query, key, value),
        biases,
        strict=True,
    ):
        # torch: y = x @ W.T + b, and the output axis splits as (heads, head_dim).
        _assign(dense.kernel, weight.T.reshape(-1, heads, head_dim))
        _assign(dense.bias, bias.reshape(heads, head_dim))
    output = _numpy(reference.out_proj.weight)
    _assign(ours.output_dense.kernel, output.T.reshape(heads, head_dim, -1))
    _assign(ours.output_dense.bias, reference.out_proj.bias)


def _copy_dense(ours, linear):
    _assign(ours.kernel, _numpy(linear.weight).T)
    _assign(ours.bias, linear.bias)


def _copy_norm(ours, norm):
    _assign(ours.gamma, norm.weight)
    _assign(ours.beta, norm.bias)


def copy_block_weights(ours, reference):
    """A torch encoder/decoder layer -> our `TransformerEncoder`/`Decoder`."""
    copy_attention_weights(ours.self_attention, reference.self_attn)
    _copy_norm(ours.self_attention_layer_norm, reference.norm1)
    feedforward_norm = reference.norm2
    if hasattr(reference, "multihead_attn"):  # A decoder layer.
        copy_attention_weights(ours.cross_attention, reference.multihead_attn)
        _copy_norm(ours.cross_attention_layer_norm, reference.norm2)
        feedforward_norm = reference.norm3
    _copy_dense(ours.feedforward_intermediate_dense, reference.linear1)
    _copy_dense(ours.feedforward_output_dense, reference.linear2)
    _copy_norm(ours.feedforward_layer_norm, feedforward_norm)


def _block_kwargs(normalize_first, activation):
    ours = dict(
        intermediate_dim=FFN,
        num_heads=HEADS,
        activation=activation,
        normalize_first=normalize_first,
        layer_norm_epsilon=1e-5,
    )
    reference = dict(
        d_model=WIDTH,
        nhead=HEADS,
        dim_feedforward=FFN,
        dropout=0.0,
        activation=activation,
        layer_norm_eps=1e-5,
        batch_first=True,
        norm_first=normalize_first,
    )
    return ours, reference


# ----------------------------------------------------------------------------
# MultiHeadAttention vs torch.nn.MultiheadAttention.
# ----------------------------------------------------------------------------

ATTENTION_CASES = {
    # name: (cross-attention, key padding, causal, explicit attention mask)
    "self": (False, False, False, False),
    "self_padding": (False, True, False, False),
    "self_causal": (False, False, True, False),
    "self_causal_padding": (False, True, True, False),
    "cross": (True, False, False, False),
    "cross_padding": (True, True, False, False),
    "cross_causal_padding": (True, True, True, False),
    "cross_attention_mask": (True, True, False, True),
}


def _attention_case(case, rng):
    """Our layer's call kwargs and torch's, for one `ATTENTION_CASES` entry."""
    cross, padded, causal, explicit_mask = ATTENTION_CASES[case]
    query = _inputs(rng, BATCH, TARGET, WIDTH)
    ours, reference = {}, {}
    if cross:
        key = _inputs(rng, BATCH, SOURCE, KEY_WIDTH)
        value = _inputs(rng, BATCH, SOURCE, VALUE_WIDTH)
        ours.update(value=value, key=key)
        lengths, key_length = SOURCE_LENGTHS, SOURCE
    else:
        key = value = query
        lengths, key_length = TARGET_LENGTHS, TARGET
    reference_inputs = (_torch(query), _torch(key), _torch(value))
    if padded:
        padding = _padding(lengths, key_length)
        ours["value_mask"] = padding
        reference["key_padding_mask"] = _torch(~padding)  # torch: True = ignore.
    allowed = np.ones((BATCH, TARGET, key_length), bool)
    if causal:
        ours["use_causal_mask"] = True
        allowed &= np.tril(np.ones((TARGET, key_length), bool))
    if explicit_mask:
        mask = rng.random((BATCH, TARGET, key_length)) < 0.6
        mask[:, :, 0] = True  # Key 0 is never padded: every row sees a key.
        ours["attention_mask"] = mask
        allowed &= mask
    if causal or explicit_mask:
        if not cross and not explicit_mask:
            reference.update(attn_mask=_causal_torch_mask(TARGET), is_causal=True)
        else:  # torch wants (batch * heads, T, S), batch-major; True = ignore.
            reference["attn_mask"] = _torch(np.repeat(~allowed, HEADS, axis=0))
    return query, ours, reference_inputs, reference


def _attention_pair(cross, flash_attention, query, ours_kwargs):
    kdim, vdim = (KEY_WIDTH, VALUE_WIDTH) if cross else (None, None)
    reference = nn.MultiheadAttention(
        WIDTH, HEADS, dropout=0.0, batch_first=True, kdim=kdim, vdim=vdim
    )
    reference = _randomize(reference, _rng())
    ours = MultiHeadAttention(num_heads=HEADS, flash_attention=flash_attention)
    ours(query, **ours_kwargs)  # Build.
    copy_attention_weights(ours, reference)
    return ours, reference


@pytest.mark.parametrize("flash_attention", [None, False], ids=["fused", "explicit"])
@pytest.mark.parametrize("case", list(ATTENTION_CASES))
def test_multi_head_attention_matches_torch(case, flash_attention):
    query, ours_kwargs, reference_inputs, reference_kwargs = _attention_case(
        case, _rng()
    )
    ours, reference = _attention_pair(
        ATTENTION_CASES[case][0], flash_attention, query, ours_kwargs
    )
    with torch.no_grad():
        expected, _ = reference(
            *reference_inputs, need_weights=False, **reference_kwargs
        )
    output = ours(query, **ours_kwargs)
    assert tuple(output.shape) == (BATCH, TARGET, WIDTH)
    np.testing.assert_allclose(_ours(output), _numpy(expected), **TOLERANCE)


@pytest.mark.parametrize("case", list(ATTENTION_CASES))
def test_multi_head_attention_scores_match_torch(case):
    query, ours_kwargs, reference_inputs, reference_kwargs = _attention_case(
        case, _rng()
    )
    ours, reference = _attention_pair(
        ATTENTION_CASES[case][0], None, query, ours_kwargs
    )
    with torch.no_grad():
        expected, averaged = reference(
            *reference_inputs, need_weights=True, **reference_kwargs
        )
        _, per_head = reference(
            *reference_inputs,
            need_weights=True,
            average_attn_weights=False,
            **reference_kwargs,
        )
    output, scores = ours(query, return_attention_scores=True, **ours_kwargs)
    key_length = SOURCE if ATTENTION_CASES[case][0] else TARGET
    assert tuple(scores.shape) == (BATCH, HEADS, TARGET, key_length)
    scores = _ours(scores)
    np.testing.assert_allclose(_ours(output), _numpy(expected), **TOLERANCE)
    np.testing.assert_allclose(scores, _numpy(per_head), **TOLERANCE)
    np.testing.assert_allclose(scores.mean(axis=1), _numpy(averaged), **TOLERANCE)


# ----------------------------------------------------------------------------
# TransformerEncoder vs torch.nn.TransformerEncoderLayer.
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("masks", ["none", "padding", "padding_and_attention"])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("normalize_first", [False, True], ids=["post", "pre"])
def test_transformer_encoder_matches_torch(normalize_first, activation, masks):
    rng = _rng()
    inputs = _inputs(rng, BATCH, SOURCE, WIDTH)
    ours_args, reference_args = _block_kwargs(normalize_first, activation)
    reference = _randomize(nn.TransformerEncoderLayer(**reference_args), rng)
    ours_kwargs, reference_kwargs = {}, {}
    if masks != "none":
        padding = _padding(SOURCE_LENGTHS, SOURCE)
        ours_kwargs["padding_mask"] = padding
        reference_kwargs["src_key_padding_mask"] = _torch(~padding)
    if masks == "padding_and_attention":
        allowed = rng.random((BATCH, SOURCE, SOURCE)) < 0.6
        allowed[:, :, 0] = True  # Every row keeps a key.
        ours_kwargs["attention_mask"] = allowed
        # torch: (batch * heads, T, T), batch-major, True = may not attend.
        reference_kwargs["src_mask"] = _torch(np.repeat(~allowed, HEADS, axis=0))
    ours = TransformerEncoder(**ours_args)
    ours(inputs, **ours_kwargs)
    copy_block_weights(ours, reference)
    with torch.no_grad():
        expected = reference(_torch(inputs), **reference_kwargs)
    output = ours(inputs, **ours_kwargs)
    np.testing.assert_allclose(_ours(output), _numpy(expected), **TOLERANCE)


# ----------------------------------------------------------------------------
# TransformerDecoder vs torch.nn.TransformerDecoderLayer / a causal encoder layer.
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("padded", [False, True], ids=["dense", "padded"])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("normalize_first", [False, True], ids=["post", "pre"])
def test_transformer_decoder_matches_torch(normalize_first, activation, padded):
    rng = _rng()
    target = _inputs(rng, BATCH, TARGET, WIDTH)
    source = _inputs(rng, BATCH, SOURCE, WIDTH)
    ours_args, reference_args = _block_kwargs(normalize_first, activation)
    reference = _randomize(nn.TransformerDecoderLayer(**reference_args), rng)
    ours_kwargs = {}
    reference_kwargs = dict(tgt_mask=_causal_torch_mask(TARGET), tgt_is_causal=True)
    if padded:
        target_padding = _padding(TARGET_LENGTHS, TARGET)
        source_padding = _padding(SOURCE_LENGTHS, SOURCE)
        ours_kwargs.update(
            decoder_padding_mask=target_padding, encoder_padding_mask=source_padding
        )
        reference_kwargs.update(
            tgt_key_padding_mask=_torch(~target_padding),
            memory_key_padding_mask=_torch(~source_padding),
        )
    ours = TransformerDecoder(**ours_args)
    ours(target, source, **ours_kwargs)
    copy_block_weights(ours, reference)
    with torch.no_grad():
        expected = reference(_torch(target), _torch(source), **reference_kwargs)
    output = ours(target, source, **ours_kwargs)
    assert tuple(output.shape) == (BATCH, TARGET, WIDTH)
    np.testing.assert_allclose(_ours(output), _numpy(expected), **TOLERANCE)


@pytest.mark.parametrize("padded", [False, True], ids=["dense", "padded"])
@pytest.mark.parametrize("normalize_first", [False, True], ids=["post", "pre"])
def test_decoder_only_matches_causal_torch_encoder_layer(normalize_first, padded):
    """A GPT block is torch's encoder layer with a causal source mask."""
    rng = _rng()
    inputs = _inputs(rng, BATCH, SOURCE, WIDTH)
    ours_args, reference_args = _block_kwargs(normalize_first, "gelu")
    reference = _randomize(nn.TransformerEncoderLayer(**reference_args), rng)
    ours_kwargs = {}
    reference_kwargs = dict(src_mask=_causal_torch_mask(SOURCE), is_causal=True)
    if padded:
        padding = _padding(SOURCE_LENGTHS, SOURCE)
        ours_kwargs["decoder_padding_mask"] = padding
        reference_kwargs["src_key_padding_mask"] = _torch(~padding)
    ours = TransformerDecoder(**ours_args)
    ours(inputs, **ours_kwargs)
    copy_block_weights(ours, reference)
    with torch.no_grad():
        expected = reference(_torch(inputs), **reference_kwargs)
    output = ours(inputs, **ours_kwargs)
    np.testing.assert_allclose(_ours(output), _numpy(expected), **TOLERANCE)


def test_keras_gelu_is_torch_exact_gelu():
    """Keras' `"gelu"` is the exact erf GELU, like torch's `activation="gelu"`."""
    values = np.linspace(-6.0, 6.0, 97, dtype="float32")
    ours = keras.activations.get("gelu")(keras.ops.convert_to_tensor(values))
    expected = nn.functional.gelu(_torch(values), approximate="none")
    np.testing.assert_allclose(_ours(ours), _numpy(expected), **TOLERANCE)
