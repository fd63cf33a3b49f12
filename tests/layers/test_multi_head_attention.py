"""MultiHeadAttention: the contract, numbers against numpy and against Keras'
own layer (the same weights), masks, biases, sliding windows, attention axes,
the dispatcher's choices and `flash_attention`. Bad arguments:
tests/layers/test_arguments.py."""

import keras
import numpy as np
import pytest

import keras_attn
from keras_attn import MultiHeadAttention, TransformerDecoder, TransformerEncoder
from tests.helpers.backend import (
    BACKEND,
    groups_repeated_here,
    has_fused_kernel,
    to_numpy,
)
from tests.helpers.builders import random_floats
from tests.helpers.contract import run_layer_contract
from tests.helpers.references import attention_reference, masking_bias

B, TQ, TK, WIDTH = 3, 5, 7, 12
TOLERANCE = {"atol": 1e-5, "rtol": 1e-5}


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
        {"num_heads": 3, "key_dim": 5, "value_dim": 7, "output_shape": (11,)},
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
    expected = attention_reference(layer, query, value, padding[:, None, None, :])
    np.testing.assert_allclose(to_numpy(output), expected, atol=1e-5, rtol=1e-5)
    assert tuple(layer.key_dense.kernel.shape) == (8, kv_heads or 4, WIDTH // 4)


@pytest.mark.parametrize(
    "use_bias, use_output_bias", [(True, False), (False, True), (True, None)]
)
def test_output_bias_by_its_own_option_matches_numpy_reference(
    use_bias, use_output_bias
):
    """W_O's bias by `use_output_bias` (`None`: as `use_bias`), the query,
    key and value biases by `use_bias` (Qwen2: `True, False`), in the
    weights, the config and the numbers (random biases)."""
    layer = MultiHeadAttention(
        num_heads=4,
        num_key_value_heads=2,
        use_bias=use_bias,
        use_output_bias=use_output_bias,
        bias_initializer=keras.initializers.RandomNormal(seed=1),
    )
    query, value = random_floats(B, TQ, WIDTH, seed=1), random_floats(B, TK, 8, seed=2)
    output = layer(query, value)
    biases = {w.path.split("/", 1)[1] for w in layer.weights if w.name == "bias"}
    expected_biases = {f"{p}/bias" for p in ("query", "key", "value") if use_bias}
    output_bias = use_bias if use_output_bias is None else use_output_bias
    expected_biases |= {"attention_output/bias"} if output_bias else set()
    assert biases == expected_biases
    assert len(layer.weights) == 4 + len(expected_biases)
    assert layer.get_config()["use_output_bias"] is use_output_bias
    expected = attention_reference(layer, query, value)
    np.testing.assert_allclose(to_numpy(output), expected, atol=1e-5, rtol=1e-5)


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


def test_flash_attention_true_is_never_silently_ignored():
    """It runs exactly where the backend has a fused kernel for the shape,
    and raises elsewhere (never falls back)."""
    layer = MultiHeadAttention(num_heads=2, flash_attention=True, dtype="bfloat16")
    x = random_floats(2, 4, 8)
    if not has_fused_kernel(batch=2, length=4, heads=2, head_dim=4):
        with pytest.raises((ValueError, RuntimeError, ImportError)):
            layer(x)
    else:
        assert layer(x).shape == (2, 4, 8)


def test_layer_contract_attention_axes_gate_and_window(tmp_path):
    run_layer_contract(
        MultiHeadAttention,
        {
            "num_heads": 2,
            "key_dim": 3,
            "attention_axes": (2,),
            "use_gate": True,
            "sliding_window": 2,
            "output_shape": (4, 2),
        },
        {"query": random_floats(2, 3, 5, 7), "value": random_floats(2, 3, 4, 6)},
        expected_output_shape=(2, 3, 5, 4, 2),
        tmp_path=tmp_path,
    )


# --- Drop-in for keras.layers.MultiHeadAttention ---------------------------

KERAS_CASES = {
    "self-attention": ({"num_heads": 2, "key_dim": 3}, (3, 5, 7), None, {}),
    "cross-attention-value-dim": (
        {"num_heads": 3, "key_dim": 2, "value_dim": 5},
        (3, 5, 7),
        (3, 11, 4),
        {},
    ),
    "no-bias-gate": (
        {"num_heads": 2, "key_dim": 3, "use_bias": False, "use_gate": True},
        (3, 5, 7),
        (3, 11, 4),
        {},
    ),
    "output-shape-tuple": (
        {"num_heads": 2, "key_dim": 3, "output_shape": (2, 3)},
        (3, 5, 7),
        None,
        {},
    ),
    "sliding-window-causal": (
        {"num_heads": 2, "key_dim": 3, "sliding_window": 2},
        (3, 7, 5),
        None,
        {"use_causal_mask": True},
    ),
    "sliding-window": (
        {"num_heads": 2, "key_dim": 3, "sliding_window": 3},
        (3, 7, 5),
        None,
        {},
    ),
    "rank-4-last-axis": (
        {"num_heads": 2, "key_dim": 3, "attention_axes": (2,)},
        (2, 3, 5, 7),
        (2, 3, 11, 4),
        {},
    ),
    "rank-4-first-axis-negative": (
        {"num_heads": 2, "key_dim": 3, "attention_axes": -3},
        (2, 5, 3, 7),
        (2, 11, 3, 4),
        {},
    ),
    "rank-5-two-axes-gate": (
        {"num_heads": 2, "key_dim": 3, "attention_axes": (2, 3), "use_gate": True},
        (2, 3, 4, 5, 7),
        (2, 3, 2, 3, 4),
        {},
    ),
    "rank-4-all-axes": ({"num_heads": 2, "key_dim": 3}, (2, 3, 5, 7), None, {}),
}


def keras_twins(init, query_shape, value_shape):
    """Keras' MultiHeadAttention and ours with Keras' weights, and inputs.

    Keras' layer is the reference through its explicit path (with
    `return_attention_scores=True`): in Keras 3.15 its fused path fails on
    JAX for `value_dim != key_dim`.
    """
    query = random_floats(*query_shape, seed=1)
    value = query if value_shape is None else random_floats(*value_shape, seed=2)
    theirs = keras.layers.MultiHeadAttention(**init)
    ours = MultiHeadAttention(**init)
    theirs.build(query.shape, value.shape)
    ours.build(query.shape, value.shape)
    ours.set_weights(theirs.get_weights())
    return ours, theirs, query, value


@pytest.mark.parametrize("flash_attention", [None, False])
@pytest.mark.parametrize("case", list(KERAS_CASES))
def test_same_weights_and_numbers_as_keras_multi_head_attention(case, flash_attention):
    init, query_shape, value_shape, call = KERAS_CASES[case]
    ours, theirs, query, value = keras_twins(init, query_shape, value_shape)
    ours.flash_attention = flash_attention
    assert [w.path.split("/", 1)[1] for w in ours.weights] == [
        w.path.split("/", 1)[1] for w in theirs.weights
    ]
    expected, expected_scores = theirs(
        query, value, return_attention_scores=True, **call
    )
    output, scores = ours(query, value, return_attention_scores=True, **call)
    np.testing.assert_allclose(to_numpy(output), to_numpy(expected), **TOLERANCE)
    np.testing.assert_allclose(to_numpy(scores), to_numpy(expected_scores), **TOLERANCE)
    np.testing.assert_allclose(
        to_numpy(ours(query, value, **call)), to_numpy(expected), **TOLERANCE
    )


def test_the_query_itself_as_value_with_a_key_of_its_own():
    """Keras' call form `layer(x, x, key=k)`: `value` is the query tensor, the
    key another one (comparing `key` and `query` by value raised here)."""
    ours, theirs, query, _ = keras_twins(
        {"num_heads": 2, "key_dim": 6}, (B, TQ, WIDTH), None
    )
    query = keras.ops.convert_to_tensor(query)
    key = keras.ops.convert_to_tensor(random_floats(B, TQ, WIDTH, seed=3))
    expected, _ = theirs(query, query, key=key, return_attention_scores=True)
    output = ours(query, query, key=key)
    np.testing.assert_allclose(to_numpy(output), to_numpy(expected), **TOLERANCE)


@pytest.mark.parametrize(
    "query_shape, value_shape, axes",
    [((2, 3, 5, 7), (2, 3, 11, 7), (2,)), ((2, 3, 4, 5, 7), (2, 3, 2, 3, 7), (2, 3))],
)
def test_attention_mask_of_higher_rank_inputs_as_in_keras(
    query_shape, value_shape, axes
):
    """`(batch, *batch axes, *query attention axes, *key attention axes)`."""
    init = {"num_heads": 2, "key_dim": 3, "attention_axes": axes}
    ours, theirs, query, value = keras_twins(init, query_shape, value_shape)
    batch_axes = [a for a in range(1, len(query_shape) - 1) if a not in axes]
    shape = [query_shape[0], *(query_shape[a] for a in batch_axes)]
    shape += [query_shape[a] for a in axes] + [value_shape[a] for a in axes]
    mask = np.random.default_rng(3).random(shape) > 0.4
    mask.reshape(-1, mask.shape[-1])[:, 0] = True  # every row attends somewhere
    expected, _ = theirs(
        query, value, attention_mask=mask, return_attention_scores=True
    )
    for flash_attention in (None, False):
        ours.flash_attention = flash_attention
        output = ours(query, value, attention_mask=mask)
        np.testing.assert_allclose(to_numpy(output), to_numpy(expected), **TOLERANCE)


def test_causal_mask_of_higher_rank_inputs_runs_over_the_attention_axis():
    layer = MultiHeadAttention(2, key_dim=3, attention_axes=(2,))
    x = random_floats(2, 3, 5, 7)
    causal = np.broadcast_to(np.tril(np.ones((5, 5), bool)), (2, 3, 5, 5))
    np.testing.assert_allclose(
        to_numpy(layer(x, use_causal_mask=True)),
        to_numpy(layer(x, attention_mask=causal)),
        **TOLERANCE,
    )


@pytest.mark.parametrize(
    "query_dims, value_dims, key_dims, output_shape",
    [
        ((4, 8), (2, 8), None, None),
        ((4, 8), (2, 8), (2, 3), None),
        ((4, 8), (2, 8), None, (3, 4)),
        ((4, 8), (2, 8), (2, 3), (1, 5)),
        ((4, 2, 3, 8), (1, 1, 5, 8), (1, 1, 5, 2), None),
        ((4, 2, 3, 8), (1, 1, 5, 8), (1, 1, 5, 2), (3, 2)),
        ((4, 2, 3, 8), (4, 2, 3, 7), (4, 2, 3, 8), None),
    ],
)
def test_compute_output_shape_as_in_keras(
    query_dims, value_dims, key_dims, output_shape
):
    """Keras' `test_compute_output_shape` cases (attention over every inner axis)."""
    layer = MultiHeadAttention(2, key_dim=2, value_dim=2, output_shape=output_shape)
    query_shape, value_shape = (7, *query_dims), (7, *value_dims)
    key_shape = (7, *key_dims) if key_dims else None
    key = None if key_shape is None else np.ones(key_shape, "float32")
    output = layer(
        np.ones(query_shape, "float32"), np.ones(value_shape, "float32"), key
    )
    assert (
        layer.compute_output_shape(query_shape, value_shape, key_shape) == output.shape
    )
    lists = [
        None if s is None else list(s) for s in (query_shape, value_shape, key_shape)
    ]
    assert layer.compute_output_shape(*lists) == output.shape


@pytest.mark.parametrize(
    "query_shape, value_shape, key_shape",
    [
        ((2, 4, 8), (2, 2, 8), (2, 1, 7)),
        ((2, 4, 2, 3, 8), (2, 1, 1, 5, 8), (2, 1, 15, 5, 2)),
    ],
)
def test_key_and_value_of_other_lengths_raise_as_in_keras(
    query_shape, value_shape, key_shape
):
    layer = MultiHeadAttention(4, key_dim=2, value_dim=2)
    with pytest.raises(ValueError, match=r"must be equal"):
        layer.compute_output_shape(query_shape, value_shape, key_shape)
    with pytest.raises(ValueError, match=r"must be equal"):
        layer(*(np.ones(s, "float32") for s in (query_shape, value_shape, key_shape)))


def test_output_shape_int_tuple_and_output_dim_alias():
    x = random_floats(2, 4, 16)
    assert tuple(MultiHeadAttention(2, key_dim=4, output_shape=8)(x).shape) == (2, 4, 8)
    assert tuple(MultiHeadAttention(2, key_dim=4, output_shape=(8, 3))(x).shape) == (
        2,
        4,
        8,
        3,
    )
    alias = MultiHeadAttention(2, key_dim=4, output_dim=8)
    assert tuple(alias(x).shape) == (2, 4, 8)
    assert (
        alias.get_config()["output_shape"] == (8,)
        and "output_dim" not in alias.get_config()
    )


@pytest.mark.parametrize("flash_attention", [None, False])
def test_attention_bias_is_added_to_the_scaled_logits(flash_attention):
    layer = MultiHeadAttention(
        4, num_key_value_heads=2, flash_attention=flash_attention
    )
    query, value = random_floats(3, 5, 8, seed=1), random_floats(3, 7, 6, seed=2)
    bias = random_floats(3, 4, 5, 7, seed=3)
    _, scores = layer(query, value, return_attention_scores=True)
    _, biased = layer(query, value, attention_bias=bias, return_attention_scores=True)
    # log-softmax shifts by a per-row constant: the bias is what changed.
    difference = np.log(to_numpy(biased)) - np.log(to_numpy(scores)) - bias
    np.testing.assert_allclose(difference - difference[..., :1], 0.0, atol=1e-4)
    fused = layer(query, value, attention_bias=bias)
    np.testing.assert_allclose(
        to_numpy(fused), to_numpy(layer(query, value, attention_bias=bias)), **TOLERANCE
    )


@pytest.mark.parametrize("flash_attention", [None, False])
@pytest.mark.parametrize("bias_shape", [(3, 4, 5, 7), (1, 4, 5, 7), (4, 1, 7), (7,)])
def test_a_masking_bias_equals_the_mask(flash_attention, bias_shape):
    layer = MultiHeadAttention(
        4, num_key_value_heads=2, flash_attention=flash_attention
    )
    query, value = random_floats(3, 5, 8, seed=1), random_floats(3, 7, 6, seed=2)
    mask = np.random.default_rng(0).random(bias_shape) > 0.3
    mask[..., 0] = True
    masked = layer(query, value, attention_mask=np.broadcast_to(mask, (3, 4, 5, 7)))
    biased = layer(query, value, attention_bias=masking_bias(mask))
    np.testing.assert_allclose(to_numpy(biased), to_numpy(masked), **TOLERANCE)


@pytest.mark.parametrize("flash_attention", [None, False])
def test_a_bias_together_with_masks(flash_attention):
    """Keras' torch kernel takes a bias or a mask; both reach it folded."""
    layer = MultiHeadAttention(
        4, num_key_value_heads=2, flash_attention=flash_attention
    )
    query, value = random_floats(3, 5, 8, seed=1), random_floats(3, 7, 6, seed=2)
    rng = np.random.default_rng(0)
    bias = random_floats(1, 4, 5, 7, seed=3)
    padding = rng.random((3, 7)) > 0.3
    padding[:, 0] = True
    padding[2] = False  # a row of padding only: zeros
    mask = rng.random((3, 5, 7)) > 0.3
    output = layer(
        query, value, value_mask=padding, attention_mask=mask, attention_bias=bias
    )
    allowed = padding[:, None, None, :] & mask[:, None]
    expected = layer(query, value, attention_bias=bias + masking_bias(allowed))
    expected = np.where(
        allowed.any(-1)[:, 0, :, None],
        to_numpy(expected),
        to_numpy(layer.output_dense.bias),
    )
    np.testing.assert_allclose(to_numpy(output), expected, **TOLERANCE)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("flash_attention", [None, False])
def test_sliding_window_scores_vanish_outside_the_band(causal, flash_attention):
    """Keras' `test_sliding_window`, and the fused path gives the same output."""
    layer = MultiHeadAttention(2, key_dim=4, sliding_window=3)
    x = random_floats(1, 6, 8)
    output, scores = layer(x, use_causal_mask=causal, return_attention_scores=True)
    i, j = np.indices((6, 6))
    band = (np.abs(i - j) < 3) & ((j <= i) if causal else True)
    scores = to_numpy(scores)
    assert np.all(scores[..., band] > 0) and np.all(scores[..., ~band] == 0)
    layer.flash_attention = flash_attention
    np.testing.assert_allclose(
        to_numpy(layer(x, use_causal_mask=causal)), to_numpy(output), **TOLERANCE
    )
    mask = to_numpy(keras_attn.ops.sliding_window_mask(6, 6, 3))
    np.testing.assert_array_equal(mask, np.abs(i - j) < 3)


def test_sliding_window_in_cached_decoding_equals_the_full_call():
    layer = MultiHeadAttention(4, num_key_value_heads=2, sliding_window=2)
    x = random_floats(2, 6, 8)
    full = to_numpy(layer(x, use_causal_mask=True))
    cache = layer.get_empty_cache(2, 6)
    first, cache = layer(
        x[:, :3], use_causal_mask=True, cache=cache, cache_update_index=0
    )
    steps = [to_numpy(first)]
    for i in range(3, 6):
        step, cache = layer(
            x[:, i : i + 1], use_causal_mask=True, cache=cache, cache_update_index=i
        )
        steps.append(to_numpy(step))
    np.testing.assert_allclose(np.concatenate(steps, axis=1), full, **TOLERANCE)


@pytest.mark.parametrize("int64", [False, True], ids=["int", "int64"])
def test_cached_tokens_without_a_causal_mask_see_the_keys_written_so_far(int64):
    """Without a causal mask, tokens written at an index see every key
    written so far and no slot after them, whatever those hold; one token
    alone too. The index may be an int64 (TensorFlow compares no int32
    positions with an int64)."""
    layer = MultiHeadAttention(2, key_dim=4)
    x = random_floats(2, 6, 8)
    five, six = to_numpy(layer(x[:, :5])), to_numpy(layer(x))
    cache = random_floats(2, 2, 2, 7, 4, seed=5)  # other keys in every slot

    def at(index):
        return np.int64(index) if int64 else index

    _, cache = layer(x[:, :2], cache=cache, cache_update_index=at(0))
    rest, cache = layer(x[:, 2:5], cache=cache, cache_update_index=at(2))
    np.testing.assert_allclose(to_numpy(rest), five[:, 2:], **TOLERANCE)
    last, _ = layer(x[:, 5:], cache=cache, cache_update_index=at(5))
    np.testing.assert_allclose(to_numpy(last), six[:, 5:], **TOLERANCE)


def test_grouped_query_heads_reach_the_fused_kernel_unrepeated(fused_calls):
    layer = MultiHeadAttention(6, key_dim=4, num_key_value_heads=2)
    x = random_floats(3, 5, 8)
    layer(x)
    if BACKEND == "tensorflow":  # no fused TensorFlow kernel: the explicit path
        assert fused_calls == []
    else:
        assert fused_calls == [(3, 5, 6 if groups_repeated_here() else 2, 4)]


ON_TORCH = pytest.mark.skipif(
    BACKEND != "torch", reason="PyTorch's scaled_dot_product_attention"
)


@ON_TORCH
@pytest.mark.parametrize("padding", [False, True])
def test_torch_receives_causal_grouped_attention_in_its_own_form(sdpa_calls, padding):
    """Causal without padding is `is_causal=True` and no mask; grouped heads
    arrive unrepeated (but on a GPU in float32, where the plan repeats them:
    `tests/ops/test_plan.py`); no kernel is pinned; a padding mask keeps a
    fused kernel (torch's CPU flash kernel here)."""
    from torch.nn.attention import SDPBackend

    layer = MultiHeadAttention(8, key_dim=4, num_key_value_heads=2)
    x = random_floats(2, 5, 16)
    mask = np.array([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], bool) if padding else None
    layer(x, query_mask=mask, use_causal_mask=True)
    (call,) = sdpa_calls
    repeated = groups_repeated_here()
    key_heads = 8 if repeated else 2
    assert (call["query"], call["key"]) == ((2, 8, 5, 4), (2, key_heads, 5, 4))
    assert call["enable_gqa"] is not repeated and not call["pinned"]
    assert call["is_causal"] is not padding
    assert (call["attn_mask"] is None) is not padding
    if not repeated:  # on a GPU, the memory-efficient or cuDNN kernel
        assert call["kernel"] == SDPBackend.FLASH_ATTENTION.value


@ON_TORCH
def test_torch_reads_a_grouped_cache_in_place(sdpa_calls):
    layer = MultiHeadAttention(8, key_dim=4, num_key_value_heads=2)
    x = random_floats(2, 1, 16)
    layer.build(x.shape)
    cache = layer.get_empty_cache(2, 6)
    layer(x, use_causal_mask=True, cache=cache, cache_update_index=2)
    (call,) = sdpa_calls
    repeated = groups_repeated_here()
    key_heads = 8 if repeated else 2
    assert (call["query"], call["key"]) == ((2, 8, 1, 4), (2, key_heads, 6, 4))
    assert call["enable_gqa"] is not repeated and not call["pinned"]


@ON_TORCH
def test_flash_attention_true_rules_out_torchs_composite_kernel(
    sdpa_calls, monkeypatch
):
    import torch

    layer = MultiHeadAttention(4, key_dim=8, flash_attention=True)
    x = random_floats(2, 5, 16)
    layer(x, use_causal_mask=True)
    assert sdpa_calls[0]["pinned"]  # the composite "math" kernel is off

    def no_kernel(*args, **kwargs):
        raise RuntimeError("No available kernel. Aborting execution.")

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", no_kernel)
    with pytest.raises(ValueError, match=r"`flash_attention=True`.*no fused"):
        layer(x, use_causal_mask=True)


@pytest.mark.parametrize(
    "cls, args",
    [
        (MultiHeadAttention, (2,)),
        (TransformerEncoder, (8, 2)),
        (TransformerDecoder, (8, 2)),
    ],
)
def test_flash_attention_true_refuses_to_return_scores(cls, args):
    layer = cls(*args, flash_attention=True)
    with pytest.raises(ValueError, match=r"`return_attention_scores=True` needs"):
        layer(random_floats(2, 3, 8), return_attention_scores=True)


@pytest.mark.parametrize("flash_attention", [None, False])
def test_heads_of_width_one_as_many_as_the_positions(flash_attention):
    """Keras 3.15 on TensorFlow adds an `EinsumDense` bias of shape (heads, 1)
    with `tf.nn.bias_add` over axis 1 when the length equals the number of
    heads (keras.layers.MultiHeadAttention gives wrong numbers there). We
    refuse that case on TensorFlow; elsewhere the numbers are the paper's."""
    layer = MultiHeadAttention(
        3,
        key_dim=1,
        flash_attention=flash_attention,
        bias_initializer=keras.initializers.RandomNormal(seed=1),
    )
    x = random_floats(5, 3, 7)  # 3 positions, 3 heads of width 1
    if BACKEND == "tensorflow":
        with pytest.raises(ValueError, match=r"length=3, heads=3, head width=1"):
            layer(x)
        x = random_floats(5, 4, 7)  # another length is exact
    output = to_numpy(layer(x))
    np.testing.assert_allclose(output, attention_reference(layer, x, x), **TOLERANCE)


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_a_bias_with_a_mask_in_half_precision(policy):
    layer = MultiHeadAttention(2, dtype=policy)
    x = random_floats(2, 5, 8)
    padding = np.array([[True] * 5, [True, True, True, False, False]])
    bias = keras_attn.ops.alibi_bias(2, 5, 5)
    output = layer(x, value_mask=padding, attention_bias=bias)
    reference = MultiHeadAttention(2)
    reference(x)
    reference.set_weights(layer.get_weights())
    expected = reference(x, value_mask=padding, attention_bias=bias)
    np.testing.assert_allclose(
        to_numpy(keras.ops.cast(output, "float32")), to_numpy(expected), atol=0.05
    )


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_half_precision_compiles(policy):
    """`predict` compiles the call where Keras compiles (`jax.jit`, XLA on
    TensorFlow): in float16 on a CPU, JAX's fused kernel failed to compile
    there (plan rule 6), while eager calls ran."""
    inputs = keras.Input((5, 8))
    layer = MultiHeadAttention(2, dtype=policy)
    model = keras.Model(inputs, layer(inputs, use_causal_mask=True))
    model.compile()
    x = random_floats(2, 5, 8)
    np.testing.assert_allclose(
        to_numpy(keras.ops.cast(model.predict(x, verbose=0), "float32")),
        to_numpy(keras.ops.cast(model(x), "float32")),
        atol=0.01,
    )


def test_cache_writes_are_checked_against_the_keys_they_write():
    """A cross-attention cache takes the whole source from the index on; a
    tensor index is checked too, in eager calls."""
    layer = MultiHeadAttention(2)
    query, memory = random_floats(2, 1, 8), random_floats(2, 6, 8)
    layer(query, memory)
    cache = np.zeros((2, 2, 2, 6, 4), "float32")
    layer(query, memory, cache=cache, cache_update_index=0)
    with pytest.raises(ValueError, match=r"room for the 6 new positions.*=3"):
        layer(query, memory, cache=cache, cache_update_index=3)
    index = keras.ops.convert_to_tensor(1, dtype="int32")
    with pytest.raises(ValueError, match=r"room for the 6 new positions.*=1"):
        layer(query, memory, cache=cache, cache_update_index=index)


def test_chunked_attention_trains_like_the_materialized_path(small_chunks):
    """The chunked path inside each backend's compiled train step (XLA, a
    `tf.function`, eager torch): the same weights after two SGD steps."""
    x = random_floats(2, 10, 16, seed=3)
    padding = np.arange(10)[None, :] < np.array([[10], [6]])

    def trained_weights():
        keras.utils.set_random_seed(7)
        inputs = keras.Input((10, 16))
        mask = keras.Input((10,), dtype="bool")
        layer = TransformerDecoder(32, 4, num_key_value_heads=2, flash_attention=False)
        model = keras.Model([inputs, mask], layer(inputs, decoder_padding_mask=mask))
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        for _ in range(2):
            model.train_on_batch([x, padding], x)
        return model.get_weights()

    chunked = trained_weights()
    assert small_chunks.calls, "the chunked path did not run"
    small_chunks()
    for ours, theirs in zip(chunked, trained_weights(), strict=True):
        np.testing.assert_allclose(ours, theirs, **TOLERANCE)


def test_the_call_record_lists_the_arguments_of_call_in_order():
    """`call` builds its `AttentionCall` positionally: a field out of order
    would hand one argument's value to another."""
    import dataclasses
    import inspect

    from keras_attn.layers._attention_call import AttentionCall

    parameters = list(inspect.signature(MultiHeadAttention.call).parameters)[1:]
    fields = [f.name for f in dataclasses.fields(AttentionCall) if f.init]
    assert fields == parameters


@pytest.mark.skipif(BACKEND != "tensorflow", reason="a TF graph of unknown length")
def test_a_cached_call_traced_with_an_unknown_length():
    """In a `tf.function` of unknown query length the length is a tensor:
    whether the queries are one new token is not known when traced, so the
    causal mask over the cache is built (no Python `bool` of a tensor)."""
    import tensorflow as tf

    attention = MultiHeadAttention(num_heads=2, key_dim=4)
    cache = np.zeros((2, 2, 2, 3, 4), "float32")
    attention(random_floats(2, 3, 8), random_floats(2, 3, 8), cache=cache)

    signature = [tf.TensorSpec([2, None, 8]), tf.TensorSpec(cache.shape)]

    @tf.function(input_signature=signature)
    def step(x, cache):
        return attention(x, x, cache=cache, cache_update_index=0, use_causal_mask=True)

    full, _ = step(random_floats(2, 3, 8), cache)
    first, _ = step(random_floats(2, 3, 8)[:, :1], cache)
    np.testing.assert_allclose(to_numpy(first), to_numpy(full)[:, :1], atol=1e-6)
