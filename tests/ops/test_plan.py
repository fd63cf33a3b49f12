"""The attention plan: its rules as a table (any backend, any device, named),
and the accelerators' documented kernel constraints held on a CPU by test
doubles, so that a CPU run catches what only a GPU would."""

import keras
import numpy as np
import pytest

import keras_attn
from keras_attn.ops.plan import (
    RUNTIME,
    AttentionPlan,
    plan_attention,
    runtime_rows_per_chunk,
)

BACKEND = keras.backend.backend()
ON_TORCH = pytest.mark.skipif(BACKEND != "torch", reason="PyTorch's SDPA rules")

QUERY = (2, 5, 4, 8)  # (B, T, H, D)
GROUPED = (2, 5, 2, 8)  # (B, S, K, D): two query heads per key/value head
MASK = (2, 1, 5, 5)
BIAS = (1, 4, 5, 5)
LONG_QUERY = (1, 4096, 8, 8)  # 8 * 4096 * 4096 logits: chunked where explicit
LONG_KEYS = (1, 4096, 8, 8)


def plan(backend="jax", platform="gpu", dtype="float32", **kwargs):
    query, key = kwargs.pop("shapes", (QUERY, GROUPED))
    value = kwargs.pop("value", key)
    return plan_attention(
        query, key, value, dtype, backend=backend, platform=platform, **kwargs
    )


FUSED_FORMS = {
    # name: (plan arguments, is_causal, repeat_key_value_heads)
    "causal, nothing else: the kernel's is_causal": (
        dict(is_causal=True),
        True,
        False,
    ),
    "causal with a mask: folded into it": (
        dict(is_causal=True, mask_shape=MASK),
        False,
        False,
    ),
    "causal with a bias on torch: folded (torch raises for both)": (
        dict(backend="torch", platform="cpu", is_causal=True, bias_shape=BIAS),
        False,
        False,
    ),
    "causal with a bias on JAX: the kernel's is_causal": (
        dict(is_causal=True, bias_shape=BIAS),
        True,
        False,
    ),
    "grouped heads, torch, GPU, float32: repeated": (
        dict(backend="torch"),
        False,
        True,
    ),
    "grouped heads, torch, GPU, bfloat16: unrepeated": (
        dict(backend="torch", dtype="bfloat16"),
        False,
        False,
    ),
    "grouped heads, torch, CPU, float32: unrepeated": (
        dict(backend="torch", platform="cpu"),
        False,
        False,
    ),
    "grouped heads, JAX, GPU, float32: unrepeated": (dict(), False, False),
    "causal with short segment ids: their mask takes the causal one": (
        dict(is_causal=True, segmented=True),
        False,
        False,
    ),
    "torch.export of static lengths: torch's choice": (
        dict(backend="torch", platform="cpu", exporting=True),
        False,
        False,
    ),
}


@pytest.mark.parametrize("name", FUSED_FORMS)
def test_fused_forms(name):
    kwargs, is_causal, repeat = FUSED_FORMS[name]
    chosen = plan(**kwargs)
    assert chosen == AttentionPlan(
        "fused", is_causal=is_causal, repeat_key_value_heads=repeat
    )


EXPLICIT = {
    # name: (plan arguments, kernel, a word of the reason)
    "flash_attention=False": (dict(flash_attention=False), "materialized", "False"),
    "dropout": (dict(dropout=True), "materialized", "dropout"),
    "returned weights": (dict(return_scores=True), "materialized", "returning"),
    "soft cap": (dict(logit_soft_cap=30.0), "materialized", "soft-capped"),
    "float64": (dict(dtype="float64"), "materialized", "float64"),
    "values of another width": (
        dict(value=GROUPED[:-1] + (3,)),
        "materialized",
        "width",
    ),
    "TensorFlow": (dict(backend="tensorflow"), "materialized", "TensorFlow"),
    "TensorFlow, long": (
        dict(backend="tensorflow", shapes=(LONG_QUERY, LONG_KEYS)),
        "chunked",
        "TensorFlow",
    ),
    "JAX on a CPU, long": (
        dict(platform="cpu", shapes=(LONG_QUERY, LONG_KEYS)),
        "chunked",
        "XLA",
    ),
    "PyTorch, long, flash_attention=False": (
        dict(backend="torch", flash_attention=False, shapes=(LONG_QUERY, LONG_KEYS)),
        "chunked",
        "False",
    ),
    "float16, JAX on a CPU: materialized (XLA refuses float32 sums there)": (
        dict(platform="cpu", dtype="float16"),
        "materialized",
        "float16",
    ),
    "float16, JAX on a TPU: materialized": (
        dict(platform="tpu", dtype="float16"),
        "materialized",
        "float16",
    ),
    "long with dropout: materialized": (
        dict(dropout=True, shapes=(LONG_QUERY, LONG_KEYS)),
        "materialized",
        "dropout",
    ),
    "segment ids, long, JAX on a GPU: chunked": (
        dict(segmented=True, shapes=(LONG_QUERY, LONG_KEYS)),
        "chunked",
        "segment ids",
    ),
    "segment ids, long, PyTorch on a GPU: chunked": (
        dict(backend="torch", segmented=True, shapes=(LONG_QUERY, LONG_KEYS)),
        "chunked",
        "segment ids",
    ),
    "unknown length, JAX (symbolic: jax.export): materialized": (
        dict(flash_attention=False, shapes=((1, None, 8, 8), (1, None, 8, 8))),
        "materialized",
        "False",
    ),
    "unknown length, PyTorch (symbolic: a loop would not export): materialized": (
        dict(backend="torch", sink_logits=True, shapes=((1, None, 8, 8),) * 2),
        "materialized",
        "sink logits",
    ),
    "unknown length, TensorFlow, training: chunked, counted at run time": (
        dict(backend="tensorflow", training=True, shapes=((1, None, 8, 8),) * 2),
        "chunked",
        "TensorFlow",
    ),
    "unknown length, TensorFlow, training, a sliding window's band: chunked": (
        dict(
            backend="tensorflow",
            training=True,
            banded=True,
            mask_shape=(1, 1, 1, None),
            shapes=((1, None, 8, 8),) * 2,
        ),  # fmt: skip
        "chunked",
        "TensorFlow",
    ),
    "unknown length, TensorFlow, inference: materialized (export takes it)": (
        dict(backend="tensorflow", shapes=((1, None, 8, 8),) * 2),
        "materialized",
        "TensorFlow",
    ),
    "unknown length, TensorFlow, a mask per row of unknown rows: materialized": (
        dict(
            backend="tensorflow",
            training=True,
            mask_shape=(1, 1, None, None),
            shapes=((1, None, 8, 8),) * 2,
        ),  # fmt: skip
        "materialized",
        "TensorFlow",
    ),
}


@pytest.mark.parametrize("name", EXPLICIT)
def test_explicit_paths_and_why(name):
    kwargs, kernel, reason = EXPLICIT[name]
    chosen = plan(**kwargs)
    assert chosen.kernel == kernel
    assert any(reason in r for r in chosen.not_fused), chosen.not_fused
    assert (chosen.chunk_rows is not None) == (kernel == "chunked")
    if None in kwargs.get("shapes", (QUERY,))[0] and kernel == "chunked":
        assert chosen.chunk_rows == RUNTIME
    if kernel == "chunked":  # the speed rule: `keras.remat` on PyTorch only
        remat = kwargs.get("backend", "jax") == "torch"
        assert chosen.chunk_gradient == ("remat" if remat else "own")


def test_half_precision_stays_fused_where_xla_sums_it():
    """Rule 6's float16 limit is JAX's off a GPU only: bfloat16 everywhere,
    float16 on JAX on a GPU and on PyTorch stay fused."""
    for backend, platform, dtype in (
        ("jax", "cpu", "bfloat16"),
        ("jax", "tpu", "bfloat16"),
        ("jax", "gpu", "float16"),
        ("torch", "cpu", "float16"),
    ):
        chosen = plan(backend, platform, dtype)
        assert chosen.kernel == "fused" and not chosen.not_fused, (backend, dtype)


def test_long_sequences_stay_fused_where_a_kernel_streams_them():
    for backend, platform in (("jax", "gpu"), ("torch", "cpu"), ("torch", "gpu")):
        chosen = plan(backend, platform, shapes=(LONG_QUERY, LONG_KEYS))
        assert chosen.kernel == "fused" and not chosen.not_fused


def test_long_segment_ids_stay_fused_where_flash_attention_is_true():
    chosen = plan(flash_attention=True, segmented=True, shapes=(LONG_QUERY,) * 2)
    assert chosen.kernel == "fused" and chosen.require_fused


@pytest.mark.parametrize(
    "kwargs, refused",
    [
        (dict(dropout=True), "dropout"),
        (dict(return_scores=True), "returning the attention weights"),
        (dict(logit_soft_cap=30.0), "soft-capped logits"),
        (dict(dtype="float64"), "float64 inputs"),
    ],
)
def test_flash_attention_true_refuses_what_no_fused_kernel_computes(kwargs, refused):
    with pytest.raises(ValueError, match=f"`flash_attention=True` needs.*{refused}"):
        plan(flash_attention=True, **kwargs)


def test_torch_export_of_a_dynamic_length_pins_the_composite_kernel():
    dynamic = ((1, None, 4, 8), (1, None, 2, 8))
    exported = plan("torch", "gpu", shapes=dynamic, exporting=True)
    assert exported.kernel == "fused" and exported.composite
    assert not plan("torch", "gpu", shapes=dynamic).composite  # not exporting
    assert not plan("jax", "gpu", shapes=dynamic, exporting=True).composite
    assert plan(
        "torch", "gpu", shapes=dynamic, exporting=True, flash_attention=True
    ) == AttentionPlan("fused", repeat_key_value_heads=True, require_fused=True)


@pytest.mark.parametrize(
    "length, key_length",
    [(1, 1), (16, 16), (1000, 1000), (2897, 2897), (8192, 8192), (30000, 30000),
     (8, 2**24), (0, 0)],
)  # fmt: skip
def test_rows_counted_at_run_time_follow_the_static_rule(length, key_length):
    """The rule for lengths known only at run time, on int tensors, gives the
    static rule's rows (8 heads), fewer than `MIN_CHUNK_ROWS` where there are
    fewer rows, all rows in one chunk where the static rule materializes, and
    one row where there is none."""
    static = plan("tensorflow", shapes=((1, length, 8, 8), (1, key_length, 8, 8)))
    rows = runtime_rows_per_chunk(
        keras.ops.convert_to_tensor(length, "int32"), 8,
        keras.ops.convert_to_tensor(key_length, "int32"),
    )  # fmt: skip
    expected = static.chunk_rows if static.kernel == "chunked" else max(length, 1)
    assert int(keras.ops.convert_to_numpy(rows)) == expected


def test_flash_attention_true_pins_a_fused_kernel():
    assert plan(backend="tensorflow", flash_attention=True).require_fused


# --- PyTorch's CUDA rules, on a CPU ---------------------------------------------


@ON_TORCH
def test_the_cuda_double_refuses_what_cuda_refuses(cuda_sdpa):
    """The double can fail: a mask with `is_causal`, and float32 `enable_gqa`."""
    import torch
    from torch.nn import functional

    q, kv = torch.ones(1, 4, 3, 8), torch.ones(1, 2, 3, 8)
    with pytest.raises(RuntimeError, match="is_causal=True"):
        functional.scaled_dot_product_attention(
            q, q, q, attn_mask=torch.ones(3, 3, dtype=torch.bool), is_causal=True
        )
    with pytest.raises(RuntimeError, match="enable_gqa"):
        functional.scaled_dot_product_attention(q, kv, kv, enable_gqa=True)


def pair(layer_cls, *args, **kwargs):
    """The layer, and one with the same weights on the explicit path."""
    fused = layer_cls(*args, **kwargs)
    explicit = layer_cls(*args, flash_attention=False, **kwargs)
    return fused, explicit


def same_numbers(fused, explicit, *inputs, **call_kwargs):
    expected = explicit(*inputs, **call_kwargs)
    fused.build(inputs[0].shape)
    fused.set_weights(explicit.get_weights())
    output = fused(*inputs, **call_kwargs)
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(output),
        keras.ops.convert_to_numpy(expected),
        rtol=1e-5,
        atol=1e-5,
    )


@ON_TORCH
def test_causal_attention_with_a_bias_obeys_cudas_rule(cuda_sdpa):
    """ALiBi (a bias) with the causal mask: the causal mask reaches the
    kernel folded into the bias, never as `is_causal` beside it."""
    x = np.random.default_rng(0).normal(size=(2, 5, 16)).astype("float32")
    bias = keras_attn.ops.alibi_bias(4, 5, 5)
    fused, explicit = pair(keras_attn.MultiHeadAttention, 4, key_dim=4)
    same_numbers(fused, explicit, x, attention_bias=bias, use_causal_mask=True)
    assert [call["is_causal"] for call in cuda_sdpa] == [False]


@ON_TORCH
def test_decoder_biases_obey_cudas_rule(cuda_sdpa):
    """The GPU's failing case: a decoder block, causal, with a bias."""
    x = np.random.default_rng(1).normal(size=(2, 5, 16)).astype("float32")
    bias = keras_attn.ops.alibi_bias(2, 5, 5)
    fused, explicit = pair(keras_attn.TransformerDecoder, 32, 2)
    same_numbers(fused, explicit, x, decoder_attention_bias=bias)
    assert len(cuda_sdpa) == 1


@ON_TORCH
def test_float32_grouped_heads_reach_cuda_repeated(cuda_sdpa):
    x = np.random.default_rng(2).normal(size=(2, 5, 16)).astype("float32")
    fused, explicit = pair(
        keras_attn.MultiHeadAttention, 8, key_dim=4, num_key_value_heads=2
    )
    same_numbers(fused, explicit, x, use_causal_mask=True)
    (call,) = cuda_sdpa
    assert call["key"] == (2, 8, 5, 4) and not call["enable_gqa"]


@ON_TORCH
def test_half_precision_grouped_heads_reach_cuda_unrepeated(cuda_sdpa):
    layer = keras_attn.MultiHeadAttention(
        8, key_dim=4, num_key_value_heads=2, dtype="bfloat16"
    )
    layer(np.ones((2, 5, 16), "float32"), use_causal_mask=True)
    (call,) = cuda_sdpa
    assert call["key"] == (2, 2, 5, 4) and call["enable_gqa"]


@ON_TORCH
def test_float32_grouped_caches_reach_cuda_repeated(cuda_sdpa):
    """Decoding from a heads-major cache, the heads repeated on their axis
    there: step by step equals the full pass."""
    x = np.random.default_rng(3).normal(size=(1, 4, 16)).astype("float32")
    layer = keras_attn.MultiHeadAttention(8, key_dim=4, num_key_value_heads=2)
    full = keras.ops.convert_to_numpy(layer(x, use_causal_mask=True))
    cache, steps = layer.get_empty_cache(1, 4), []
    for i in range(4):
        y, cache = layer(
            x[:, i : i + 1], use_causal_mask=True, cache=cache, cache_update_index=i
        )
        steps.append(keras.ops.convert_to_numpy(y))
    np.testing.assert_allclose(np.concatenate(steps, 1), full, rtol=1e-5, atol=1e-5)
    assert {call["key"] for call in cuda_sdpa[1:]} == {(1, 8, 4, 4)}
