"""The lean path through the blocks (keras_attn/layers/_lean_call.py): a
sublayer's `call` run directly where Keras' `__call__` would do nothing
more, `__call__` elsewhere; the same outputs and gradients either way, under
mixed precision, with LoRA, quantized sublayers and a `DTypePolicyMap`."""

import keras
import numpy as np
import pytest

from keras_attn import TransformerDecoder
from keras_attn.layers import _lean_call
from tests.helpers.backend import BACKEND, to_numpy, value_and_gradients
from tests.helpers.builders import random_floats

BLOCK = {"intermediate_dim": 12, "num_heads": 2, "normalize_first": True}
# The numbers of both paths, not on JAX: which path a sublayer takes is Python
# that no backend changes, and JAX's eager calls compile each operation (10 s,
# in a suite near its time limit); every JAX test of a block runs the lean path.
same_numbers = pytest.mark.skipif(
    BACKEND == "jax", reason="the lean path's numbers: TensorFlow and PyTorch"
)


@pytest.fixture
def lean_calls(monkeypatch):
    """`{sublayer path below the block: whether its calls took the lean
    path}` (a sublayer called both ways maps to `None`)."""
    calls = {}
    lean = _lean_call.lean

    def spy(layer, *arguments):
        taken = lean(layer, *arguments)
        path = (layer.path or layer.name).split("/", 1)[-1]  # below the block
        calls[path] = taken if calls.get(path, taken) == taken else None
        return taken

    monkeypatch.setattr(_lean_call, "lean", spy)
    return calls


def outputs_and_gradients(block, x, source):
    """The block's outputs and the gradients of its inputs, called through
    `__call__` (a padding mask hides the last position of row 0)."""
    mask = np.ones(x.shape[:2], bool)
    mask[0, -1] = False
    keras_mask = keras.ops.convert_to_tensor(mask)

    def call(x, source):
        return keras.ops.cast(
            block(x, source, decoder_padding_mask=keras_mask), "float32"
        )

    return value_and_gradients(call, x, source)


def assert_same_as_keras_call(block, lean_calls, monkeypatch):
    """The lean path's outputs and gradients equal those of every sublayer
    called through `Layer.__call__`, bit for bit; `lean_calls` then holds
    the lean path's calls."""
    x, source = random_floats(2, 5, 8, seed=1), random_floats(2, 5, 8, seed=2)
    block(x, source)
    lean_calls.clear()
    lean_value, lean_gradients = outputs_and_gradients(block, x, source)
    with monkeypatch.context() as patch:
        patch.setattr(_lean_call, "lean", lambda layer, *arguments: False)
        value, gradients = outputs_and_gradients(block, x, source)
    np.testing.assert_array_equal(lean_value, value)
    for lean_gradient, gradient in zip(lean_gradients, gradients, strict=True):
        np.testing.assert_array_equal(lean_gradient, gradient)


@same_numbers
@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
def test_every_sublayer_is_lean_and_the_numbers_keras_ones(
    policy, lean_calls, monkeypatch
):
    block = TransformerDecoder(**BLOCK, dtype=policy)
    assert_same_as_keras_call(block, lean_calls, monkeypatch)
    expected = {"self_attention", "cross_attention/value", "feedforward_output_dense"}
    expected |= {"self_attention_layer_norm", "self_attention/attention_output"}
    assert expected <= set(lean_calls)
    assert all(lean_calls.values()), lean_calls


@same_numbers
def test_sublayers_without_a_bias_are_lean_with_keras_numbers(lean_calls, monkeypatch):
    """Qwen2's biases (none on W_O and the feed-forward matrices): the
    projections without a bias take the lean path, Keras' numbers."""
    block = TransformerDecoder(
        **BLOCK,
        gated_feedforward=True,
        use_output_bias=False,
        use_feedforward_bias=False,
    )
    assert_same_as_keras_call(block, lean_calls, monkeypatch)
    assert block.self_attention.output_dense.bias is None
    assert block.feedforward_gate_dense.bias is None
    for path in ("self_attention/attention_output", "feedforward_gate_dense"):
        assert lean_calls[path], path
    assert all(lean_calls.values()), lean_calls


@same_numbers
def test_lora_adapters_reach_the_lean_path(lean_calls, monkeypatch):
    block = TransformerDecoder(**BLOCK)
    block(random_floats(2, 5, 8), random_floats(2, 5, 8))
    block.enable_lora(2, b_initializer="ones")  # adapters that change outputs
    assert_same_as_keras_call(block, lean_calls, monkeypatch)
    assert lean_calls["cross_attention/query"]
    assert lean_calls["feedforward_output_dense"]


@same_numbers
def test_quantized_sublayers_go_through_keras_call(lean_calls, monkeypatch):
    block = TransformerDecoder(**BLOCK)
    block(random_floats(2, 5, 8), random_floats(2, 5, 8))
    # Two of them (Keras' `quantize` collects garbage, seconds for them all).
    block.self_attention.query_dense.quantize("int8")
    block.feedforward_output_dense.quantize("int8")
    assert_same_as_keras_call(block, lean_calls, monkeypatch)
    assert lean_calls["self_attention/query"] is False
    assert lean_calls["feedforward_output_dense"] is False
    assert lean_calls["self_attention/key"] and lean_calls["feedforward_layer_norm"]


@same_numbers
def test_a_sublayer_of_another_policy_goes_through_keras_call(lean_calls, monkeypatch):
    """A `DTypePolicyMap` gives the self-attention's input projections
    float32 in a mixed block: only `__call__` leaves the block's autocast
    scope for them."""
    policy = keras.dtype_policies.DTypePolicyMap("mixed_bfloat16")
    policy["probe/self_attention/(query|key|value)$"] = "float32"
    block = TransformerDecoder(**BLOCK, dtype=policy, name="probe")
    assert_same_as_keras_call(block, lean_calls, monkeypatch)
    assert lean_calls["self_attention/value"] is False
    assert lean_calls["self_attention/query"] is False
    assert lean_calls["cross_attention/value"] and lean_calls["self_attention"]


def test_a_call_without_keras_autocast_scope_goes_through_keras_call(lean_calls):
    """`block.call` (as `stateless_call` runs it) sets no autocast scope: the
    mixed sublayers must enter their own, as through `block(...)`."""
    block = TransformerDecoder(**BLOCK, dtype="mixed_bfloat16")
    x = keras.ops.cast(random_floats(2, 5, 8), "bfloat16")
    expected = to_numpy(block(x))
    lean_calls.clear()
    np.testing.assert_array_equal(to_numpy(block.call(x)), expected)
    assert lean_calls["self_attention"] is False
    assert lean_calls["self_attention/query"]  # in the scope of the attention's call
    assert lean_calls["feedforward_intermediate_dense"] is False


def test_arguments_that_keras_call_would_convert_go_through_it():
    dense = keras.layers.Dense(3)
    dense.build((None, 4))
    x = keras.ops.ones((2, 4))
    assert _lean_call.lean(dense, x, None, 1, keras.ops.ones((2,), "int32"))
    assert not _lean_call.lean(dense, x, np.ones(2))  # made a tensor
    assert not _lean_call.lean(dense, x, {"nested": [np.ones(2)]})
    assert not _lean_call.lean(dense, keras.ops.cast(x, "float16"))  # cast
    assert not _lean_call.lean(dense, x, keras.ops.cast(x, "float16"))


def test_training_reaches_the_dropouts_on_the_lean_path(lean_calls):
    """`training=True` passed down explicitly: the block's dropout and the
    attention weights' drop, with every sublayer on the lean path (where no
    `__call__` sets Keras' training context)."""
    x = keras.ops.convert_to_tensor(random_floats(2, 5, 8))
    block = TransformerDecoder(**BLOCK, dropout=0.5)
    inference = to_numpy(block(x))
    lean_calls.clear()
    training = to_numpy(block(x, training=True))
    assert all(lean_calls.values()), lean_calls
    assert {"dropout", "self_attention"} <= set(lean_calls)
    assert not np.allclose(training, inference)
    # The attention's own: the same block with only its weights dropped.
    attention = block.self_attention
    hidden = keras.ops.cast(x, attention.compute_dtype)
    kept = to_numpy(attention.call(hidden, hidden, training=False))
    dropped = to_numpy(attention.call(hidden, hidden, training=True))
    assert not np.allclose(kept, dropped)


@pytest.fixture
def torch_calls(monkeypatch):
    """`{torch_eager function: calls that gave a result}` (PyTorch only)."""
    from keras_attn import _torch_eager as torch_eager

    calls = {}

    def spied(name, function):
        def spy(*arguments):
            result = function(*arguments)
            calls[name] = calls.get(name, 0) + (result is not None)
            return result

        return spy

    for name in ("layer_norm", "rms_norm"):
        monkeypatch.setattr(torch_eager, name, spied(name, getattr(torch_eager, name)))
    # Every projection goes through a bound one (which may call `projection`).
    bind = torch_eager.bound_projection

    def bound(*arguments):  # its functions' calls count as projections
        call = bind(*arguments)
        return None if call is None else spied("projection", call)

    monkeypatch.setattr(torch_eager, "bound_projection", bound)
    return calls


@pytest.mark.skipif(BACKEND != "torch", reason="Keras' own calls as torch calls")
@pytest.mark.parametrize(
    "policy, normalization",
    [
        ("float32", "layer_norm"),
        ("mixed_bfloat16", "rms_norm"),
        ("float64", "rms_norm"),
        ("mixed_float16", "layer_norm"),
    ],
)
def test_keras_own_sublayers_run_as_their_torch_calls(
    policy, normalization, lean_calls, torch_calls, monkeypatch
):
    """On PyTorch the lean path runs Keras' own projections and norms as the
    torch calls their `call` makes (keras_attn/_torch_eager.py), with
    Keras' numbers and gradients bit for bit; Keras computes a float16
    matmul in float32 on a CPU, so the feed-forward's `Dense` keeps its call
    there; Keras 3.15 computes float64 in float32, so float64 keeps Keras'
    calls."""
    block = TransformerDecoder(
        **BLOCK, dtype=policy, normalization=normalization, activation="gelu"
    )
    assert_same_as_keras_call(block, lean_calls, monkeypatch)
    if policy == "float64":  # Keras computes it in float32: its calls kept
        assert not any(torch_calls.values()), torch_calls
        return
    assert torch_calls[normalization] > 0
    projections = 8 if policy == "mixed_float16" else 10  # 8 EinsumDense, 2 Dense
    assert torch_calls["projection"] == 2 * projections  # two calls: build, lean


@pytest.mark.skipif(BACKEND != "torch", reason="Keras' own calls as torch calls")
def test_a_decoding_binds_projections_without_a_bias(torch_calls):
    """A decoding's bound projections (`SublayerCalls`) of a W_O and a
    feed-forward matrix without a bias: torch calls, Keras' numbers."""
    block = TransformerDecoder(
        **BLOCK, use_output_bias=False, use_feedforward_bias=False
    )
    x = keras.ops.convert_to_tensor(random_floats(2, 5, 8))
    block(x)
    output, dense = block.self_attention.output_dense, block.feedforward_output_dense
    context = keras.ops.convert_to_tensor(random_floats(2, 5, 2, 4, seed=1))
    hidden = keras.ops.convert_to_tensor(random_floats(2, 5, 12, seed=2))
    torch_calls.clear()
    calls = _lean_call.SublayerCalls()
    for layer, inputs in ((output, context), (dense, hidden)):
        assert layer.bias is None
        expected = to_numpy(layer(inputs))
        np.testing.assert_array_equal(to_numpy(calls(layer, inputs)), expected)
    assert torch_calls["projection"] == 2


def test_a_layer_norm_over_other_axes_keeps_keras_call():
    """Only a norm over the last axis is one torch call; the others keep
    Keras' `call` (whose numbers the lean path then gives)."""
    norm = keras.layers.LayerNormalization(axis=(1, 2))
    x = keras.ops.convert_to_tensor(random_floats(2, 3, 4))
    norm.build(x.shape)
    np.testing.assert_array_equal(
        to_numpy(_lean_call.call_sublayer(norm, x)), to_numpy(norm(x))
    )


@pytest.mark.skipif(BACKEND != "torch", reason="Keras' own calls as torch calls")
def test_a_subclass_kernel_property_is_asked():
    """A `Dense` subclass that keeps Keras' `call` but derives its kernel
    (weight normalization, a scale): the torch call reads its `kernel`."""

    class Doubled(keras.layers.Dense):
        @property
        def kernel(self):
            return self._kernel * 2.0

    dense = Doubled(3)
    x = keras.ops.convert_to_tensor(random_floats(2, 4))
    dense.build(x.shape)
    np.testing.assert_array_equal(
        to_numpy(_lean_call.SublayerCalls()(dense, x)), to_numpy(dense(x))
    )
