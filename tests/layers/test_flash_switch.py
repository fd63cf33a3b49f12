"""Keras' global switch, `keras.config.disable_flash_attention()` (issue 28):
honoured where `flash_attention=None`, as Keras' own `MultiHeadAttention`
honours it (`flash_attention or is_flash_attention_enabled()`), by the one
plan, for the op and the layers; an explicit `flash_attention=True` wins."""

import keras
import numpy as np
import pytest

import keras_attn
from keras_attn import ops as attn_ops
from keras_attn.ops.plan import AttentionPlan, plan_attention
from tests.helpers.backend import BACKEND, has_accelerator, to_numpy
from tests.helpers.builders import random_floats

B, T, H, S, K, D = 2, 3, 4, 5, 2, 8


@pytest.fixture
def flash_disabled():
    """`keras.config.disable_flash_attention()`, put back afterwards as it was
    (Keras' public switch has two states: `None`, the default, which
    `enable_flash_attention()` sets, and `False`)."""
    before = keras.config.is_flash_attention_enabled()
    assert before in (None, False)
    keras.config.disable_flash_attention()
    assert keras.config.is_flash_attention_enabled() is False
    yield
    if before is None:
        keras.config.enable_flash_attention()


fuses = pytest.mark.skipif(
    BACKEND == "tensorflow", reason="TensorFlow runs no fused kernel anyway"
)


def plan(backend, platform, **kwargs):
    return plan_attention(
        (B, T, H, D),
        (B, S, K, D),
        (B, S, K, D),
        "float32",
        backend=backend,
        platform=platform,
        **kwargs,
    )


WHERE_FUSED = [("jax", "gpu"), ("torch", "cpu"), ("torch", "gpu")]


@pytest.mark.parametrize("backend, platform", WHERE_FUSED)
def test_the_plan_runs_no_fused_kernel_after_disable(flash_disabled, backend, platform):
    """Rule 4, for every backend and device the plan knows (so on any backend
    under test)."""
    chosen = plan(backend, platform)
    assert chosen.kernel == "materialized"
    assert len(chosen.not_fused) == 1
    assert "keras.config.disable_flash_attention()" in chosen.not_fused[0]
    assert plan(backend, platform, flash_attention=False).kernel == "materialized"


@pytest.mark.parametrize("backend, platform", WHERE_FUSED)
def test_flash_attention_true_wins_over_the_switch(flash_disabled, backend, platform):
    """As in Keras' layer, where `True or False` is `True`."""
    chosen = plan(backend, platform, flash_attention=True)
    assert chosen.kernel == "fused" and chosen.require_fused


@pytest.mark.parametrize("backend, platform", WHERE_FUSED)
def test_enable_flash_attention_restores_the_default(flash_disabled, backend, platform):
    keras.config.enable_flash_attention()
    assert keras.config.is_flash_attention_enabled() is None
    assert plan(backend, platform).kernel == "fused"


@fuses
def test_the_op_runs_no_fused_kernel_after_disable(flash_disabled, fused_calls):
    """Keras' own op ignores the switch; ours honours it, with the explicit
    path's numbers."""
    q = random_floats(B, T, H, D, seed=1)
    kv = random_floats(B, S, K, D, seed=2)
    keras.config.enable_flash_attention()
    attn_ops.dot_product_attention(q, kv, kv, is_causal=True)
    assert len(fused_calls) == 1  # fused at the default
    keras.config.disable_flash_attention()
    output = attn_ops.dot_product_attention(q, kv, kv, is_causal=True)
    assert len(fused_calls) == 1
    expected = attn_ops.dot_product_attention(
        q, kv, kv, is_causal=True, flash_attention=False
    )
    np.testing.assert_allclose(to_numpy(output), to_numpy(expected), atol=1e-6)


@fuses
def test_layers_run_no_fused_kernel_after_disable(flash_disabled, fused_calls):
    """Our `MultiHeadAttention`, created before the switch or after (the plan
    reads it at each call), and the blocks built on it; as Keras' own layer
    does."""
    x = random_floats(B, T, 16)
    created_before = keras_attn.MultiHeadAttention(num_heads=2)
    keras.config.enable_flash_attention()
    created_before(x, use_causal_mask=True)
    fused_before = len(fused_calls)
    assert fused_before > 0  # fused at the default
    keras.config.disable_flash_attention()
    created_before(x, use_causal_mask=True)
    keras_attn.MultiHeadAttention(num_heads=2)(x)
    keras_attn.TransformerEncoder(32, num_heads=2)(x)
    keras_attn.TransformerDecoder(32, num_heads=2)(x)
    assert len(fused_calls) == fused_before
    assert keras.layers.MultiHeadAttention(2, 8)._flash_attention is False


@pytest.mark.skipif(
    BACKEND != "torch" or has_accelerator(),
    reason="a fused kernel on a CPU: PyTorch's (JAX's flash kernel needs a GPU)",
)
def test_a_layer_with_flash_attention_true_stays_fused(flash_disabled, fused_calls):
    layer = keras_attn.MultiHeadAttention(num_heads=2, flash_attention=True)
    layer(random_floats(B, T, 16), use_causal_mask=True)
    assert len(fused_calls) == 1


def test_flash_attention_false_is_explicit_whatever_the_switch_says(fused_calls):
    """Unlike Keras' layer, where `False or None` is `None` (fused where it
    can): ours stays explicit with the switch at its default."""
    assert keras.config.is_flash_attention_enabled() is None
    layer = keras_attn.MultiHeadAttention(num_heads=2, flash_attention=False)
    layer(random_floats(B, T, 16))
    assert fused_calls == []
    chosen = plan("torch", "cpu", flash_attention=False)
    assert chosen == AttentionPlan("materialized", not_fused=("flash_attention=False",))


@fuses
def test_generate_loops_compiled_before_the_switch_are_not_reused(
    flash_disabled, fused_calls
):
    """`generate` keeps its compiled loops per model; one traced under the
    switch (explicit kernels) is not reused once the switch is back to its
    default, nor the other way round."""
    ids = keras.Input((None,), dtype="int32")
    x = keras.layers.Embedding(11, 16)(ids)
    x = keras_attn.TransformerDecoder(32, num_heads=2)(x)
    model = keras.Model(ids, keras.layers.Dense(11)(x))
    prompt = np.array([[1, 2, 3]])
    expected = keras_attn.generation.generate(model, prompt, max_new_tokens=3)
    assert fused_calls == []
    keras.config.enable_flash_attention()
    tokens = keras_attn.generation.generate(model, prompt, max_new_tokens=3)
    assert fused_calls, "the loop traced without the switch was reused"
    np.testing.assert_array_equal(tokens, expected)
