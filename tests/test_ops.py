import numpy as np
import pytest

from keras_attn import ops as attn_ops
from tests.helpers import random_floats, to_numpy

EPS32 = 2.0**-24


def reference_encoding(length, dim, max_wavelength=10000.0, start=0):
    """The paper's formula in float64, straight from its definition."""
    pos = np.arange(start, start + length, dtype=np.float64)[:, None]
    i = np.arange(dim)[None, :]
    angles = pos / np.power(max_wavelength, (2 * (i // 2)) / dim)
    return np.where(i % 2 == 0, np.sin(angles), np.cos(angles)), angles


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


def test_causal_mask_with_offset():
    mask = to_numpy(attn_ops.causal_mask(2, 5, query_offset=3))
    np.testing.assert_array_equal(mask, [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]])


def test_merge_attention_masks_shapes_and_logic():
    padding = np.array([[True, False, True]])
    assert attn_ops.merge_attention_masks() is None
    merged = to_numpy(attn_ops.merge_attention_masks(padding, np.eye(3, dtype=bool)))
    assert merged.shape == (1, 1, 3, 3)
    np.testing.assert_array_equal(merged[0, 0], np.eye(3) * [1, 0, 1])
    only_padding = to_numpy(attn_ops.merge_attention_masks(padding))
    assert only_padding.shape == (1, 1, 1, 3)


def numpy_attention(q, k, v, mask):
    logits = np.einsum("bthd,bshd->bhts", q, k) / np.sqrt(q.shape[-1])
    logits = np.where(mask, logits, -np.inf)
    weights = np.exp(logits - logits.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    return np.einsum("bhts,bshd->bthd", weights, v)


@pytest.mark.parametrize("fused", [True, False])
def test_dot_product_attention_matches_numpy_with_masks(fused):
    q, k, v = (random_floats(2, 5, 3, 4, seed=s) for s in range(3))
    padding = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], bool)
    mask = padding[:, None, None, :] & np.tril(np.ones((5, 5), bool))
    out = attn_ops.dot_product_attention(
        q, k, v, mask=padding[:, None, None, :], is_causal=True, fused=fused
    )
    np.testing.assert_allclose(
        to_numpy(out), numpy_attention(q, k, v, mask), atol=1e-5, rtol=1e-5
    )


@pytest.mark.parametrize("fused", [True, False])
def test_rows_that_attend_to_nothing_give_zeros(fused):
    q = random_floats(1, 3, 2, 4)
    mask = np.array([[True, False, True], [False, False, False], [True, True, True]])
    out = to_numpy(
        attn_ops.dot_product_attention(q, q, q, mask=mask[None, None], fused=fused)
    )
    assert np.all(np.isfinite(out))
    np.testing.assert_array_equal(out[0, 1], 0.0)
    assert np.abs(out[0, 0]).sum() > 0


def test_explicit_path_needed_for_scores():
    q = random_floats(1, 3, 2, 4)
    with pytest.raises(ValueError, match="fused=False"):
        attn_ops.dot_product_attention(q, q, q, return_scores=True)
    out, scores = attn_ops.dot_product_attention(
        q, q, q, fused=False, return_scores=True
    )
    np.testing.assert_allclose(to_numpy(scores).sum(-1), 1.0, atol=1e-6)
