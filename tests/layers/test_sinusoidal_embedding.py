"""SinusoidalEmbedding: the contract, the paper's encoding, token ids (float
ids cast as `keras.layers.Embedding` casts them), masks, positions of inputs of
any rank. Bad arguments (out-of-range ids and positional arguments included):
tests/layers/test_arguments.py."""

import keras
import numpy as np
import pytest

from keras_attn import SinusoidalEmbedding, TransformerDecoder
from tests.helpers.backend import to_numpy
from tests.helpers.builders import VOCAB, padded_ids, random_floats
from tests.helpers.contract import run_layer_contract
from tests.helpers.references import EPS32, reference_encoding


def test_layer_contract_token_ids(tmp_path):
    run_layer_contract(
        SinusoidalEmbedding,
        {"embedding_dim": 7, "vocabulary_size": 11, "mask_zero": True},
        {"inputs": np.array([[1, 2, 3, 0, 0], [4, 5, 6, 7, 10]], dtype="int32")},
        expected_output_shape=(2, 5, 7),
        tmp_path=tmp_path,
    )


def test_layer_contract_float_inputs(tmp_path):
    run_layer_contract(
        SinusoidalEmbedding,
        {"max_wavelength": 100.0},
        {"inputs": random_floats(3, 5, 9)},
        expected_output_shape=(3, 5, 9),
        tmp_path=tmp_path,
    )


@pytest.mark.parametrize("length, width", [(3000, 33), (17, 5)])
def test_float_inputs_get_exactly_the_paper_encoding(length, width):
    x = random_floats(2, length, width)
    output = to_numpy(SinusoidalEmbedding()(x))
    expected, angles = reference_encoding(length, width)
    error = np.abs(output - x - expected)
    assert np.all(error <= 3 * EPS32 * np.abs(angles) + 1e-6)


def test_token_embedding_scaled_plus_positions():
    layer = SinusoidalEmbedding(embedding_dim=6, vocabulary_size=9)
    ids = np.array([[3, 1, 8, 0]])
    output = to_numpy(layer(ids))
    table = to_numpy(layer.embeddings)
    expected = table[ids] * np.sqrt(6) + reference_encoding(4, 6)[0]
    np.testing.assert_allclose(output, expected, atol=1e-5)
    unscaled = SinusoidalEmbedding(
        embedding_dim=6, vocabulary_size=9, scale_embeddings=False
    )
    unscaled(ids)
    unscaled.set_weights(layer.get_weights())
    np.testing.assert_allclose(
        to_numpy(unscaled(ids)), table[ids] + reference_encoding(4, 6)[0], atol=1e-5
    )


def test_start_index_continues_the_positions():
    layer = SinusoidalEmbedding(embedding_dim=8, vocabulary_size=20)
    ids = np.array([[4, 5, 6, 7, 8]])
    full = to_numpy(layer(ids))
    for step in range(5):
        one = to_numpy(layer(ids[:, step : step + 1], start_index=step))
        np.testing.assert_allclose(one[:, 0], full[:, step], atol=1e-6)
    tensor_index = keras.ops.convert_to_tensor(3, dtype="int32")
    np.testing.assert_allclose(
        to_numpy(layer(ids[:, 3:], start_index=tensor_index)), full[:, 3:], atol=1e-6
    )


def test_masks_from_mask_zero_and_passed_through():
    ids = keras.Input((None,), dtype="int32")
    masked = SinusoidalEmbedding(embedding_dim=4, vocabulary_size=10, mask_zero=True)(
        ids
    )
    assert masked._keras_mask is not None
    x = keras.Input((None, 4))
    y = SinusoidalEmbedding()(keras.layers.Masking()(x))
    model = keras.Model(x, y._keras_mask if hasattr(y, "_keras_mask") else y)
    data = np.ones((1, 3, 4), "float32")
    data[0, 2] = 0.0
    np.testing.assert_array_equal(to_numpy(model(data)), [[True, True, False]])


def test_float_ids_are_cast_as_keras_embedding_casts_them():
    layer = SinusoidalEmbedding(vocabulary_size=10, embedding_dim=4)
    ids = np.array([[1, 2, 9], [0, 3, 4]])
    np.testing.assert_array_equal(
        to_numpy(layer(ids.astype("float32"))), to_numpy(layer(ids.astype("int32")))
    )


@pytest.mark.parametrize("shape", [(2, 4, 6), (2, 3, 5), (1, 2, 4, 6)])
def test_float_inputs_get_keras_hubs_sine_position_encoding(shape):
    keras_hub = pytest.importorskip("keras_hub")
    x = random_floats(*shape)
    theirs = to_numpy(
        keras_hub.layers.SinePositionEncoding()(keras.ops.convert_to_tensor(x))
    )
    np.testing.assert_allclose(
        to_numpy(SinusoidalEmbedding()(x)) - x, theirs, atol=1e-5
    )


def test_ids_of_higher_rank_get_positions_along_the_last_axis():
    layer = SinusoidalEmbedding(vocabulary_size=11, embedding_dim=6)
    ids = np.random.default_rng(0).integers(0, 11, (2, 3, 5))
    output = to_numpy(layer(ids))
    for i in range(3):
        np.testing.assert_allclose(output[:, i], to_numpy(layer(ids[:, i])), atol=1e-6)
    starts = np.array([0, 2], "int32")
    shifted = to_numpy(layer(ids, start_index=starts))
    np.testing.assert_allclose(
        shifted[1, 2], to_numpy(layer(ids[1:, 2], start_index=2))[0], atol=1e-6
    )


def test_functional_model_with_float_id_inputs_trains():
    """A `keras.Input` without `dtype="int32"` gives float ids, cast as
    `keras.layers.Embedding` casts them."""
    ids = keras.Input((None,))
    x = SinusoidalEmbedding(vocabulary_size=VOCAB, embedding_dim=16, mask_zero=True)(
        ids
    )
    x = TransformerDecoder(32, 4)(x)
    model = keras.Model(ids, keras.layers.Dense(VOCAB)(x))
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    data = padded_ids(8, 5)
    history = model.fit(data.astype("float32"), data, epochs=2, verbose=0)
    assert np.isfinite(history.history["loss"][-1])
    np.testing.assert_array_equal(
        to_numpy(model(data.astype("float32"))), to_numpy(model(data))
    )
