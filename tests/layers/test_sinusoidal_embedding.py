import keras
import numpy as np
import pytest

from keras_attn import SinusoidalEmbedding
from tests.helpers import random_floats, run_layer_contract, to_numpy
from tests.test_ops import EPS32, reference_encoding


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
    unscaled = SinusoidalEmbedding(6, 9, scale_embeddings=False)
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
    masked = SinusoidalEmbedding(4, 10, mask_zero=True)(ids)
    assert masked._keras_mask is not None
    x = keras.Input((None, 4))
    y = SinusoidalEmbedding()(keras.layers.Masking()(x))
    model = keras.Model(x, y._keras_mask if hasattr(y, "_keras_mask") else y)
    data = np.ones((1, 3, 4), "float32")
    data[0, 2] = 0.0
    np.testing.assert_array_equal(to_numpy(model(data)), [[True, True, False]])


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"vocabulary_size": 10}, ValueError, "embedding_dim=None"),
        ({"embedding_dim": 0, "vocabulary_size": 10}, ValueError, "embedding_dim=0"),
        ({"embedding_dim": 4, "vocabulary_size": -1}, ValueError, "vocabulary_size=-1"),
        ({"max_wavelength": 0}, ValueError, "max_wavelength=0"),
        ({"max_wavelength": "big"}, TypeError, "max_wavelength='big'"),
        ({"mask_zero": True}, ValueError, "mask_zero=True"),
        (
            {"embedding_dim": 4, "vocabulary_size": 9, "mask_zero": 1},
            TypeError,
            "mask_zero=1",
        ),
    ],
)
def test_bad_constructor_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        SinusoidalEmbedding(**kwargs)


def test_bad_inputs():
    with pytest.raises(TypeError, match="inputs.dtype=float32"):
        SinusoidalEmbedding(4, 10)(np.ones((2, 3), "float32"))
    with pytest.raises(ValueError, match=r"rank 2.*inputs.shape=\(2, 3, 4\)"):
        SinusoidalEmbedding(4, 10)(np.ones((2, 3, 4), "int32"))
    with pytest.raises(ValueError, match=r"rank 3.*inputs.shape=\(2, 3\)"):
        SinusoidalEmbedding()(np.ones((2, 3), "float32"))
    with pytest.raises(ValueError, match="embedding_dim=5, input width=4"):
        SinusoidalEmbedding(embedding_dim=5)(np.ones((2, 3, 4), "float32"))
