"""TransformerEncoder: the contract, Keras masks, scores, dropout. What both
blocks share: tests/layers/test_block.py; bad arguments:
tests/layers/test_arguments.py."""

import keras
import numpy as np
import pytest

from keras_attn import SinusoidalEmbedding, TransformerEncoder
from tests.helpers.backend import BACKEND, to_numpy
from tests.helpers.builders import random_floats
from tests.helpers.contract import run_layer_contract
from tests.helpers.doubles import largest_xla_array

B, T, WIDTH = 3, 7, 12


@pytest.mark.parametrize("normalize_first", [False, True])
def test_layer_contract(tmp_path, normalize_first):
    run_layer_contract(
        TransformerEncoder,
        {
            "intermediate_dim": 20,
            "num_heads": 4,
            "num_key_value_heads": 2,
            "dropout": 0.1,
            "activation": "gelu",
            "normalize_first": normalize_first,
        },
        {"inputs": random_floats(B, T, WIDTH)},
        expected_output_shape=(B, T, WIDTH),
        tmp_path=tmp_path,
        # Quantization, LoRA and policy maps act on the sublayers, which are
        # the same in either order: checked once, post-norm. Every mode on
        # the attention's projections: MultiHeadAttention's contracts.
        machinery=not normalize_first,
        quantization_modes=("int8",),
    )


def token_model(encoder, flash_attention=None):
    ids = keras.Input((None,), dtype="int32")
    x = SinusoidalEmbedding(vocabulary_size=20, embedding_dim=WIDTH, mask_zero=True)(
        ids
    )
    return keras.Model(ids, encoder(x))


@pytest.mark.parametrize("flash_attention", [None, False])
def test_keras_mask_equals_explicit_padding_mask(flash_attention):
    encoder = TransformerEncoder(16, 4, flash_attention=flash_attention)
    model = token_model(encoder)
    ids = np.array(
        [[3, 4, 5, 0, 0, 0, 0], [1, 2, 3, 4, 5, 6, 7], [9, 0, 0, 0, 0, 0, 0]]
    )
    embedded = model.layers[1](ids)
    explicit = encoder(embedded, padding_mask=ids != 0)
    np.testing.assert_allclose(to_numpy(model(ids)), to_numpy(explicit), atol=1e-6)
    unmasked = encoder(embedded, padding_mask=np.ones_like(ids, bool))
    assert not np.allclose(to_numpy(unmasked), to_numpy(explicit), atol=1e-3)
    # An attention_mask tensor beside a Keras mask: both still apply.
    everything = np.ones((3, 7, 7), bool)
    symbolic_ids = keras.Input((None,), dtype="int32")
    symbolic_mask = keras.Input((None, None), dtype="bool")
    x = model.layers[1](symbolic_ids)
    both = keras.Model(
        [symbolic_ids, symbolic_mask], encoder(x, attention_mask=symbolic_mask)
    )
    np.testing.assert_allclose(
        to_numpy(both([ids, everything])), to_numpy(explicit), atol=1e-6
    )


def test_output_carries_the_input_mask():
    model = token_model(TransformerEncoder(16, 4))
    assert model.outputs[0]._keras_mask is not None


@pytest.mark.parametrize("flash_attention", [None, False])
@pytest.mark.parametrize("normalize_first", [False, True])
def test_padded_tokens_do_not_change_real_outputs(flash_attention, normalize_first):
    encoder = TransformerEncoder(
        16, 4, normalize_first=normalize_first, flash_attention=flash_attention
    )
    x = random_floats(B, T, WIDTH)
    changed = x.copy()
    changed[:, 4:] = random_floats(B, T - 4, WIDTH, seed=9) * 10
    padding = np.zeros((B, T), bool)
    padding[:, :4] = True
    a = to_numpy(encoder(x, padding_mask=padding))
    b = to_numpy(encoder(changed, padding_mask=padding))
    np.testing.assert_allclose(a[:, :4], b[:, :4], atol=1e-5)


def test_return_attention_scores():
    encoder = TransformerEncoder(16, 4)
    x = random_floats(B, T, WIDTH)
    outputs, scores = encoder(x, return_attention_scores=True)
    assert tuple(scores.shape) == (B, 4, T, T)
    np.testing.assert_allclose(to_numpy(outputs), to_numpy(encoder(x)), atol=1e-6)


def test_dropout_active_only_in_training():
    encoder = TransformerEncoder(16, 4, dropout=0.5)
    x = random_floats(B, T, WIDTH)
    np.testing.assert_allclose(
        to_numpy(encoder(x)), to_numpy(encoder(x, training=False)), atol=1e-6
    )
    assert not np.allclose(to_numpy(encoder(x, training=True)), to_numpy(encoder(x)))


@pytest.mark.skipif(BACKEND != "tensorflow", reason="TensorFlow traces unknown lengths")
def test_variable_length_model_trains_in_chunks_under_xla(small_chunks):
    """`keras.Input((None, width))` trained by `model.fit(jit_compile=True)`
    on batches of two lengths: Keras traces the step with the length unknown,
    and the attention still goes in chunks (4 rows here), counted in the
    graph: XLA's program of a gradient step at 64 tokens holds no `(T, T)`
    weights, where the materialized path's holds `B * H * T * T`."""
    import tensorflow as tf

    inputs = keras.Input((None, 8))
    model = keras.Model(inputs, TransformerEncoder(16, num_heads=2)(inputs))
    model.compile("adam", "mse", jit_compile=True)
    spec = tf.TensorSpec((2, None, 8), tf.float32)

    def batches():
        for length in (64, 40):
            x = random_floats(2, length, 8, seed=length)
            yield x, x

    data = tf.data.Dataset.from_generator(batches, output_signature=(spec, spec))
    losses = model.fit(data, verbose=0).history["loss"]
    assert np.isfinite(losses).all() and (2, None, 2, 4) in small_chunks.calls

    def gradient(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x, training=True)))
        return tape.gradient(loss, model.trainable_variables)

    def largest(x):
        traced = tf.function(gradient, input_signature=[spec], jit_compile=True)
        return largest_xla_array(traced, x)

    x = tf.constant(random_floats(2, 64, 8))
    assert largest(x) < 64 * 64
    small_chunks()  # one chunk of all rows: the weights of the whole length
    assert largest(x) >= 2 * 2 * 64 * 64
