"""`keras_attn.ops.positions`: the sinusoid and rotary embeddings, against
their float64 formulas."""

import keras
import numpy as np
import pytest

from keras_attn import ops as attn_ops
from tests.helpers.backend import to_numpy
from tests.helpers.builders import random_floats
from tests.helpers.references import EPS32, reference_encoding, rotary_reference


@pytest.mark.parametrize(
    "length, dim, max_wavelength, start",
    [
        (7, 16, 10000.0, 0),
        (4096, 33, 10000.0, 0),
        (50, 9, 500.0, 3000),
        (1, 1, 10.0, 0),
    ],
)
def test_sinusoid_matches_the_formula(length, dim, max_wavelength, start):
    table = to_numpy(
        attn_ops.sinusoidal_position_encoding(length, dim, max_wavelength, start)
    )
    expected, angles = reference_encoding(length, dim, max_wavelength, start)
    assert table.dtype == np.float32 and table.shape == (length, dim)
    # Float32 angles carry at most ~2 roundings (frequency, product) of error.
    bound = 3 * EPS32 * np.abs(angles) + 2e-7
    assert np.all(np.abs(table - expected) <= bound)
    # Where angles are small, that is exact to float32 precision.
    small = np.abs(angles) < 8
    np.testing.assert_allclose(table[small], expected[small], atol=1e-6)


def test_sinusoid_interleaves_sin_and_cos():
    table = to_numpy(attn_ops.sinusoidal_position_encoding(3, 4))
    np.testing.assert_allclose(table[0], [0.0, 1.0, 0.0, 1.0], atol=1e-7)
    np.testing.assert_allclose(
        table[2], [np.sin(2), np.cos(2), np.sin(2 / 100), np.cos(2 / 100)], atol=1e-6
    )


@pytest.mark.parametrize(
    "positions, dim, max_wavelength, scaling_factor",
    [
        (np.arange(7), 8, 10000.0, 1.0),
        (np.arange(8192), 64, 10000.0, 1.0),  # long contexts
        (np.arange(8192), 16, 500000.0, 8.0),  # LLaMA 3's base, interpolated
        (np.array([[0, 1, 2], [5, 6, 7]]), 4, 100.0, 1.0),  # per row
    ],
)
def test_rotary_embedding_matches_the_formula(
    positions, dim, max_wavelength, scaling_factor
):
    x = random_floats(2, positions.shape[-1], 3, dim).astype(np.float64)
    rotated = to_numpy(
        attn_ops.rotary_embedding(
            x.astype("float32"), positions, max_wavelength, scaling_factor
        )
    )
    expected, angles = rotary_reference(x, positions, max_wavelength, scaling_factor)
    assert rotated.dtype == np.float32 and rotated.shape == x.shape
    # Float32 angles carry ~2 roundings (frequency, product); each output sums
    # two products of |x| <= max|x| with the cosine and the sine.
    bound = 2 * np.max(np.abs(x)) * (3 * EPS32 * np.abs(angles) + 2e-7) + 1e-6
    assert np.all(np.abs(rotated - expected) <= bound)
    small = np.broadcast_to(np.abs(angles) < 8, x.shape)
    np.testing.assert_allclose(rotated[small], expected[small], atol=2e-6)


def test_rotary_embedding_bad_types():
    x = random_floats(1, 3, 2, 4)
    with pytest.raises(TypeError, match=r"max_wavelength='1e4' of type str"):
        attn_ops.rotary_embedding(x, np.arange(3), max_wavelength="1e4")
    # numpy scalars are numbers
    attn_ops.rotary_embedding(x, np.arange(3), max_wavelength=np.float32(1e4))


def test_rotary_embedding_keeps_norms_and_half_precision():
    x = random_floats(1, 5, 2, 8)
    rotated = to_numpy(attn_ops.rotary_embedding(x, np.arange(5) * 100))
    np.testing.assert_allclose(
        np.linalg.norm(rotated, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-5
    )
    half = attn_ops.rotary_embedding(keras.ops.cast(x, "bfloat16"), np.arange(5))
    assert keras.backend.standardize_dtype(half.dtype) == "bfloat16"


@pytest.mark.parametrize(
    "x, positions, kwargs, match",
    [
        (random_floats(1, 3, 2, 5), np.arange(3), {}, r"even.*x.shape=\(1, 3, 2, 5\)"),
        (random_floats(3, 2, 4), np.arange(3), {}, r"x.shape=\(3, 2, 4\)"),
        (random_floats(1, 3, 2, 4), np.zeros((1, 1, 3)), {}, r"positions.shape"),
        (random_floats(1, 3, 2, 4), np.arange(3), {"scaling_factor": 0}, r"=0"),
        (random_floats(1, 3, 2, 4), np.arange(3), {"max_wavelength": -1.0}, r"-1.0"),
        (random_floats(1, 3, 2, 4), np.arange(1), {}, r"positions.shape=\(1,\)"),
        (random_floats(2, 3, 2, 4), np.zeros((3, 3)), {}, r"positions.shape=\(3, 3\)"),
    ],
    ids=[
        "odd-dim",
        "rank-3",
        "positions-rank-3",
        "scaling-0",
        "wavelength-negative",
        "positions-length",
        "positions-batch",
    ],
)
def test_rotary_embedding_bad_arguments(x, positions, kwargs, match):
    with pytest.raises(ValueError, match=match):
        attn_ops.rotary_embedding(x, positions, **kwargs)
