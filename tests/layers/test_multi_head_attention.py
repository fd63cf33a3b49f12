import keras
import numpy as np
import pytest

from keras_attn import MultiHeadAttention
from tests.helpers import has_accelerator, random_floats, run_layer_contract, to_numpy

B, TQ, TK, WIDTH = 3, 5, 7, 12


def numpy_reference(layer, query, value, mask=None):
    """softmax(QK^T / sqrt(d_k)) V W_O from the layer's own weights, in float64."""
    w = {v.path.split("/")[-1]: to_numpy(v).astype(np.float64) for v in layer.weights}
    q = np.einsum("btd,dhk->bthk", query, w["query_kernel"]) + w["query_bias"]
    k = np.einsum("bsd,dhk->bshk", value, w["key_kernel"]) + w["key_bias"]
    v = np.einsum("bsd,dhk->bshk", value, w["value_kernel"]) + w["value_bias"]
    group = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    logits = np.einsum("bthk,bshk->bhts", q, k) / np.sqrt(q.shape[-1])
    if mask is not None:
        logits = np.where(mask, logits, -np.inf)
    weights = np.exp(logits - logits.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    context = np.einsum("bhts,bshk->bthk", weights, v)
    return np.einsum("bthk,hko->bto", context, w["output_kernel"]) + w["output_bias"]


def test_layer_contract_self_attention(tmp_path):
    run_layer_contract(
        MultiHeadAttention,
        {"num_heads": 4, "num_key_value_heads": 2, "dropout": 0.1, "seed": 3},
        {"query": random_floats(B, TQ, WIDTH)},
        call_kwargs={"use_causal_mask": True},
        expected_output_shape=(B, TQ, WIDTH),
        tmp_path=tmp_path,
    )


def test_layer_contract_cross_attention(tmp_path):
    run_layer_contract(
        MultiHeadAttention,
        {"num_heads": 3, "key_dim": 5, "value_dim": 7, "output_dim": 11},
        {"query": random_floats(B, TQ, WIDTH), "value": random_floats(B, TK, 9)},
        expected_output_shape=(B, TQ, 11),
        tmp_path=tmp_path,
    )


@pytest.mark.parametrize("kv_heads", [None, 2, 1])
@pytest.mark.parametrize("flash_attention", [None, False])
def test_matches_numpy_reference_with_grouped_query_heads(kv_heads, flash_attention):
    layer = MultiHeadAttention(
        num_heads=4, num_key_value_heads=kv_heads, flash_attention=flash_attention
    )
    query, value = random_floats(B, TQ, WIDTH, seed=1), random_floats(B, TK, 8, seed=2)
    padding = np.ones((B, TK), bool)
    padding[0, 4:] = False
    output = layer(query, value, value_mask=padding)
    expected = numpy_reference(layer, query, value, padding[:, None, None, :])
    np.testing.assert_allclose(to_numpy(output), expected, atol=1e-5, rtol=1e-5)
    assert layer.key_kernel.shape == (8, kv_heads or 4, WIDTH // 4)


def test_fused_and_explicit_paths_agree_with_every_mask():
    fused = MultiHeadAttention(num_heads=4, name="fused")
    explicit = MultiHeadAttention(num_heads=4, flash_attention=False)
    query, value = random_floats(B, TQ, WIDTH, seed=1), random_floats(B, TQ, WIDTH)
    fused(query, value)
    explicit(query, value)
    explicit.set_weights(fused.get_weights())
    padding = np.ones((B, TQ), bool)
    padding[1, 3:] = False
    attention_mask = np.random.default_rng(0).random((B, TQ, TQ)) > 0.3
    kwargs = dict(
        value_mask=padding, attention_mask=attention_mask, use_causal_mask=True
    )
    a = to_numpy(fused(query, value, **kwargs))
    b = to_numpy(explicit(query, value, **kwargs))
    c, scores = fused(query, value, return_attention_scores=True, **kwargs)
    np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-5)
    np.testing.assert_allclose(a, to_numpy(c), atol=1e-6, rtol=1e-5)
    allowed = (
        padding[:, None, None, :]
        & attention_mask[:, None]
        & np.tril(np.ones((TQ, TQ), bool))
    )
    scores = to_numpy(scores)
    assert np.all(scores[~np.broadcast_to(allowed, scores.shape)] == 0)


@pytest.mark.parametrize("flash_attention", [None, False])
def test_causal_mask_equals_explicit_lower_triangle(flash_attention):
    layer = MultiHeadAttention(num_heads=2, flash_attention=flash_attention)
    x = random_floats(B, TQ, 8)
    causal = to_numpy(layer(x, use_causal_mask=True))
    tril = np.tril(np.ones((TQ, TQ), bool))
    np.testing.assert_allclose(
        causal, to_numpy(layer(x, attention_mask=tril)), atol=1e-6
    )
    np.testing.assert_allclose(
        causal,
        to_numpy(layer(x, attention_mask=np.broadcast_to(tril, (B, TQ, TQ)))),
        atol=1e-6,
    )


@pytest.mark.parametrize("flash_attention", [None, False])
def test_future_and_padded_keys_do_not_leak(flash_attention):
    layer = MultiHeadAttention(num_heads=2, flash_attention=flash_attention)
    x = random_floats(B, TQ, 8)
    changed = x.copy()
    changed[:, 3:] += 5.0  # future tokens for rows 0..2, padding for all rows
    padding = np.ones((B, TQ), bool)
    padding[:, 3:] = False
    causal = [to_numpy(layer(v, use_causal_mask=True))[:, :3] for v in (x, changed)]
    np.testing.assert_allclose(causal[0], causal[1], atol=1e-6)
    padded = [to_numpy(layer(v, value_mask=padding)) for v in (x, changed)]
    np.testing.assert_allclose(padded[0][:, :3], padded[1][:, :3], atol=1e-6)


@pytest.mark.parametrize("flash_attention", [None, False])
def test_row_with_nothing_to_attend_is_finite_and_zero(flash_attention):
    layer = MultiHeadAttention(
        num_heads=2, flash_attention=flash_attention, bias_initializer="ones"
    )
    x = random_floats(2, 4, 8)
    padding = np.array([[False] * 4, [True, True, False, False]])
    output, scores = layer(x, value_mask=padding, return_attention_scores=True)
    output, scores = to_numpy(output), to_numpy(scores)
    assert np.all(np.isfinite(output))
    np.testing.assert_allclose(output[0], np.ones((4, 8)), atol=1e-6)  # bias only
    np.testing.assert_array_equal(scores[0], 0.0)
    np.testing.assert_allclose(scores[1].sum(-1), 1.0, atol=1e-6)
    fused = to_numpy(layer(x, value_mask=padding))
    np.testing.assert_allclose(fused, output, atol=1e-6)


def test_keras_mask_reaches_the_keys_and_the_output():
    ids = np.array([[3, 4, 0, 0], [5, 6, 7, 0]])
    embedding = keras.layers.Embedding(10, 8, mask_zero=True)
    layer = MultiHeadAttention(num_heads=2)
    inputs = keras.Input((None,), dtype="int32")
    x = embedding(inputs)
    outputs = layer(x)
    model = keras.Model(inputs, outputs)
    explicit = layer(embedding(ids), value_mask=ids != 0)
    np.testing.assert_allclose(to_numpy(model(ids)), to_numpy(explicit), atol=1e-6)
    assert outputs._keras_mask is not None


def test_dropout_only_in_training_and_seeded():
    layer = MultiHeadAttention(num_heads=2, dropout=0.5, seed=7)
    x = random_floats(2, 6, 8)
    inference = to_numpy(layer(x))
    np.testing.assert_allclose(inference, to_numpy(layer(x, training=False)))
    trained = to_numpy(layer(x, training=True))
    assert not np.allclose(trained, inference)
    assert np.all(np.isfinite(trained))


def test_large_activations_stay_finite_in_mixed_precision():
    for policy in ("mixed_float16", "mixed_bfloat16"):
        layer = MultiHeadAttention(num_heads=2, dtype=policy)
        x = random_floats(2, 16, 8, scale=300.0)
        for flash_attention in (None, False):
            layer.flash_attention = flash_attention
            output = to_numpy(keras.ops.cast(layer(x), "float32"))
            assert np.all(np.isfinite(output)), (policy, flash_attention)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"num_heads": 0}, ValueError, "num_heads=0"),
        ({"num_heads": 2.0}, TypeError, "num_heads=2.0"),
        (
            {"num_heads": 4, "num_key_value_heads": 3},
            ValueError,
            "num_key_value_heads=3",
        ),
        ({"num_heads": 2, "dropout": 1.0}, ValueError, "dropout=1.0"),
        ({"num_heads": 2, "dropout": -0.1}, ValueError, "dropout=-0.1"),
        ({"num_heads": 2, "key_dim": -3}, ValueError, "key_dim=-3"),
        ({"num_heads": 2, "output_dim": 0}, ValueError, "output_dim=0"),
        ({"num_heads": 2, "flash_attention": "yes"}, TypeError, "flash_attention"),
        ({"num_heads": 2, "seed": -1}, ValueError, "seed=-1"),
    ],
)
def test_bad_constructor_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        MultiHeadAttention(**kwargs)


def test_heads_must_divide_the_width():
    with pytest.raises(ValueError, match="num_heads=5, query width=12"):
        MultiHeadAttention(num_heads=5)(random_floats(2, 3, 12))
    assert (
        MultiHeadAttention(num_heads=5, key_dim=4)(random_floats(2, 3, 12)).shape[-1]
        == 12
    )


@pytest.mark.parametrize(
    "call_kwargs, match",
    [
        ({"query": random_floats(2, 12)}, r"`query` must have rank 3"),
        ({"value_mask": np.ones((2, 4), bool)}, r"value_mask.shape=\(2, 4\)"),
        ({"key_mask": np.ones((2, 5, 1), bool)}, r"key_mask.shape=\(2, 5, 1\)"),
        ({"attention_mask": np.ones((2, 3, 4), bool)}, r"attention_mask.shape"),
        ({"attention_mask": np.ones((5,), bool)}, r"attention_mask.*rank 2 or 3 or 4"),
        ({"key": random_floats(2, 4, 12)}, "same length"),
    ],
)
def test_bad_call_arguments(call_kwargs, match):
    layer = MultiHeadAttention(num_heads=2)
    query, value = random_floats(2, 3, 12), random_floats(2, 5, 12)
    layer(query, value)
    weights = [w.copy() for w in layer.get_weights()]
    kwargs = {"query": query, "value": value, **call_kwargs}
    with pytest.raises(ValueError, match=match):
        layer(**kwargs)
    for before, after in zip(weights, layer.get_weights(), strict=True):
        np.testing.assert_array_equal(before, after)


def test_flash_attention_true_is_never_silently_ignored():
    layer = MultiHeadAttention(num_heads=2, flash_attention=True, dtype="bfloat16")
    x = random_floats(2, 4, 8)
    if not has_accelerator():
        # No flash kernel on a CPU: the backend must say so, not fall back.
        with pytest.raises((ValueError, RuntimeError, ImportError)):
            layer(x)
    else:
        assert layer(x).shape == (2, 4, 8)
