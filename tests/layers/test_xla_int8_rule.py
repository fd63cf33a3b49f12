"""Every int8 x int8 contraction our layers hand to JAX has contracted sizes
that are multiples of 4, for odd widths too: the rule of XLA's GPU int8 dot
(`tests/helpers/doubles.py`, `int8_contractions`), held on a CPU. The
numbers stay Keras' own int8 numbers, on every backend."""

import contextlib

import keras
import numpy as np
import pytest

import keras_attn
from keras_attn.layers import _int8
from keras_attn.ops.plan import platform_of
from tests.helpers.backend import BACKEND, value_and_gradients
from tests.helpers.doubles import int8_contractions

RNG = np.random.default_rng(0)


def odd_models():
    """Models whose contracted widths are odd: query width 8 and key/value
    width 9 (FINDINGS.md's failing case), 3 heads of 5 (W_O contracts 15),
    and blocks of width 9 with a feed-forward width of 7."""
    query, source, block = (
        keras.Input((4, 8)),
        keras.Input((6, 9)),
        keras.Input((4, 9)),
    )
    attention = keras_attn.MultiHeadAttention(num_heads=3, key_dim=5)
    encoder = keras_attn.TransformerEncoder(7, 3, normalize_first=True)
    decoder = keras_attn.TransformerDecoder(
        7, 3, activation="gelu", gated_feedforward=True
    )
    return {
        "attention": keras.Model([query, source], attention(query, source)),
        "encoder": keras.Model(block, encoder(block)),
        "decoder": keras.Model(block, decoder(block)),
    }


@pytest.mark.skipif(BACKEND != "jax", reason="JAX's traced dots")
@pytest.mark.parametrize("name", ["attention", "encoder", "decoder"])
def test_int8_contractions_are_multiples_of_4(xla_gpu, name):
    """Traced only (the numbers: `test_padding_changes_no_number`, and the
    layer contracts' int8 tolerance)."""
    model = odd_models()[name]
    inputs = [
        RNG.normal(size=(2, *x.shape[1:])).astype("float32") for x in model.inputs
    ]
    model.quantize("int8")

    sizes = int8_contractions(
        lambda *inputs: model(list(inputs) if len(inputs) > 1 else inputs[0]),
        *inputs,
    )

    assert sizes, "no int8 dot was traced: the check saw nothing"
    assert all(size % 4 == 0 for dot in sizes for size in dot), sizes


def on_cpu():
    """JAX and TensorFlow: Keras' CPU device (under which Keras' PyTorch
    variables refuse int8 kernels: `requires_grad` on an int8 tensor)."""
    return contextlib.nullcontext() if BACKEND == "torch" else keras.device("cpu:0")


LAYERS = {
    # (keras_attn's, Keras' own, the input shape): contracted sizes 3 x 5 and 9
    "einsum": (
        lambda cls: cls("abcd,cde->abe", output_shape=(None, 6), bias_axes="e"),
        (_int8.EinsumDense, keras.layers.EinsumDense),
        (2, 4, 3, 5),
    ),
    "dense": (
        lambda cls: cls(6, activation="relu"),
        (_int8.Dense, keras.layers.Dense),
        (2, 4, 9),
    ),
}


@pytest.mark.parametrize("name", LAYERS)
def test_padding_changes_no_number(xla_gpu, name):
    """Padded and Keras' unpadded int8 contractions agree exactly, forward
    and in the inputs' gradient, with LoRA on, on every backend (padded, as
    on a GPU, on JAX and TensorFlow; torch keeps Keras' call)."""
    make, classes, shape = LAYERS[name]
    inputs = RNG.normal(size=shape).astype("float32")
    # Keras' own layer computes on the CPU: on a real GPU its unpadded int8
    # dot is the fault (an H100, 2026-11-28: exactly twice the CPU's numbers,
    # where ours, padded, gave the CPU's). PyTorch keeps Keras' call anyway.
    with on_cpu():
        keras_own = make(classes[1])
        keras_own.build(shape)
    ours = make(classes[0])
    ours.build(shape)
    ours.set_weights(keras_own.get_weights())
    with on_cpu():
        keras_own.quantize("int8")
        keras_own.enable_lora(2)
        expected_output, (expected_gradient,) = value_and_gradients(keras_own, inputs)
    ours.quantize("int8")
    ours.enable_lora(2)
    ours.set_weights(keras_own.get_weights())  # LoRA's random A too

    output, (gradient,) = value_and_gradients(ours, inputs)

    np.testing.assert_array_equal(output, expected_output)
    np.testing.assert_array_equal(gradient, expected_gradient)
    if BACKEND == "jax":
        assert int8_contractions(keras_own, inputs)  # the fault this avoids
        sizes = int8_contractions(ours, inputs)
        assert all(size % 4 == 0 for dot in sizes for size in dot), sizes


def test_nothing_is_padded_on_a_cpu():
    """Off an XLA GPU the int8 call is Keras' own: no copy of the kernel."""
    if platform_of(None) == "gpu":
        pytest.skip("a GPU: the padding is the other tests' subject")
    layer = _int8.Dense(6)
    layer.build((2, 9))
    layer.quantize("int8")
    inputs = RNG.normal(size=(2, 9)).astype("float32")
    assert _int8.padding("...a,ab->...b", (9, 6), inputs) == {}
    if BACKEND == "jax":
        assert int8_contractions(layer, inputs) == [(9,)]
