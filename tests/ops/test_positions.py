"""`keras_attn.ops.positions`: the sinusoid and rotary embeddings, against
their float64 formulas, and rotary scalings against keras-hub's layers."""

import json

import keras
import numpy as np
import pytest

from keras_attn import ops as attn_ops
from keras_attn.ops.positions import check_rope_scaling, rotary_frequencies
from tests.helpers.backend import BACKEND, programs_compiled, to_numpy
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


@pytest.mark.skipif(BACKEND != "jax", reason="JAX compiles each eager op")
def test_an_eager_rotation_on_jax_compiles_one_program(caplog):
    """On JAX an eager rotation is one XLA program (`keras_attn/_jax_eager.py`),
    not one per op (a cosine, a sine, the halves' concatenation, ...)."""
    x, positions = random_floats(2, 13, 3, 8), keras.ops.arange(13)
    compiled = programs_compiled(
        lambda: attn_ops.rotary_embedding(x, positions, 100.0), caplog
    )
    assert compiled.count("jit(compiled)") == 1, compiled
    assert "jit(cos)" not in compiled and "jit(sin)" not in compiled, compiled


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


# Hugging Face's `rope_scaling` dicts, each with the keras-hub layer (and its
# arguments) that computes it. An original context of 64 positions puts
# channels of a head of 16 in each YaRN regime and each Llama 3.1 band.
YARN = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64}
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
KERAS_HUB_SCALINGS = {
    "linear": (
        {"rope_type": "linear", "factor": 4.0},
        "RotaryEmbedding",
        {"scaling_factor": 4.0},
    ),
    "dynamic": (
        {"rope_type": "dynamic", "factor": 4.0},
        "RotaryEmbedding",
        {"scaling_factor": 4.0, "rope_type": "dynamic"},
    ),
    "yarn": (
        YARN,
        "RotaryEmbedding",
        {
            "scaling_factor": 8.0,
            "rope_type": "yarn",
            "original_max_position_embeddings": 64,
        },
    ),
    "yarn-untruncated": (
        {**YARN, "beta_fast": 16.0, "beta_slow": 2.0, "truncate": False},
        "RotaryEmbedding",
        {
            "scaling_factor": 8.0,
            "rope_type": "yarn",
            "original_max_position_embeddings": 64,
            "beta_fast": 16.0,
            "beta_slow": 2.0,
            "truncate": False,
        },
    ),
    "llama3": (
        LLAMA3,
        "LlamaRotaryEmbedding",
        {
            "frequency_adjustment_factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "pretraining_sequence_length": 64,
        },
    ),
}


def keras_hub_rotary(name, **kwargs):
    pytest.importorskip("keras_hub")
    if name == "LlamaRotaryEmbedding":
        from keras_hub.src.models.llama.llama_rotary_embedding import (
            LlamaRotaryEmbedding as layer,
        )
    else:
        from keras_hub.layers import RotaryEmbedding as layer
    return layer(max_wavelength=10000, **kwargs)


@pytest.mark.parametrize("case", list(KERAS_HUB_SCALINGS))
def test_rotary_scaling_matches_keras_hub(case):
    """Each `rope_type` rotates as keras-hub's layer does, up to position 255
    (keras-hub rounds its frequencies in float32 several times, ours once:
    up to 6e-6 apart at position 255, 1.1e-5 at 299)."""
    scaling, layer, kwargs = KERAS_HUB_SCALINGS[case]
    x = np.random.default_rng(0).uniform(-1, 1, (2, 256, 3, 16)).astype("float32")
    positions = np.arange(256)
    ours = to_numpy(attn_ops.rotary_embedding(x, positions, 1e4, scaling=scaling))
    theirs = to_numpy(keras_hub_rotary(layer, **kwargs)(x))
    np.testing.assert_allclose(ours, theirs, atol=1e-5)
    unscaled = to_numpy(attn_ops.rotary_embedding(x, positions, 1e4))
    assert np.max(np.abs(unscaled - theirs)) > 0.1  # the scaling is tested


@pytest.mark.parametrize("scaling", [YARN, LLAMA3], ids=["yarn", "llama3"])
def test_yarn_and_llama3_reach_each_regime_here(scaling):
    """The parity test above covers every regime: channels kept, channels
    divided by the factor, and channels in between."""
    plain, _ = rotary_frequencies(1e4, 16)
    scaled, _ = rotary_frequencies(1e4, 16, scaling=check_rope_scaling(scaling, "s"))
    ratio = np.asarray(plain, "float32") / np.asarray(scaled, "float32")
    kept, divided = np.isclose(ratio, 1.0), np.isclose(ratio, 8.0)
    assert kept.any() and divided.any() and not (kept | divided).all()


def test_linear_scaling_is_the_scaling_factor():
    x = random_floats(2, 5, 3, 8)
    linear = {"rope_type": "linear", "factor": 3.0}
    np.testing.assert_array_equal(
        to_numpy(attn_ops.rotary_embedding(x, np.arange(5), scaling=linear)),
        to_numpy(attn_ops.rotary_embedding(x, np.arange(5), scaling_factor=3.0)),
    )


def test_rope_scaling_is_filled_in_as_a_plain_dict():
    checked = check_rope_scaling({**YARN, "factor": 4}, "rope_scaling")
    defaults = {"beta_fast": 32.0, "beta_slow": 1.0, "truncate": True}
    assert checked == {**YARN, "factor": 4.0, **defaults}
    assert type(checked["factor"]) is float and json.loads(json.dumps(checked))


@pytest.mark.parametrize(
    "scaling, kwargs, error, match",
    [
        ({"rope_type": "ntk", "factor": 2.0}, {}, ValueError,
         r"`scaling\['rope_type'\]` must be 'linear' or 'dynamic' or 'yarn' or "
         r"'llama3'. Received: scaling=\{'rope_type': 'ntk'"),
        ({"factor": 2.0}, {}, ValueError, r"`scaling\['rope_type'\]` must be"),
        ({"rope_type": "linear"}, {}, ValueError,
         r"takes the keys \['rope_type', 'factor'\]\. .*missing keys \['factor'\]"),
        ({"type": "linear", "rope_type": "linear", "factor": 2.0}, {}, ValueError,
         r"unknown keys \['type'\]"),
        ({"rope_type": "yarn", "factor": 2.0}, {}, ValueError,
         r"optionally \['beta_fast', 'beta_slow', 'truncate', 'attention_factor'\]"
         r".*missing keys \['original_max_position_embeddings'\]"),
        ({**YARN, "attention_factor": 0.0}, {}, ValueError,
         r"`scaling\['attention_factor'\]` must be positive"),
        ({**YARN, "attention_scale": 1.0}, {}, ValueError,
         r"unknown keys \['attention_scale'\]"),
        ({"rope_type": "llama3", "factor": 2.0, "attention_factor": 1.0}, {},
         ValueError, r"unknown keys \['attention_factor'\]"),
        ({"rope_type": "dynamic", "factor": 0.0}, {}, ValueError,
         r"`scaling\['factor'\]` must be positive. Received: scaling\['factor'\]=0.0"),
        ({**YARN, "original_max_position_embeddings": -4}, {}, ValueError,
         r"`scaling\['original_max_position_embeddings'\]` must be a positive int"),
        ({**YARN, "beta_slow": -1.0}, {}, ValueError, r"scaling\['beta_slow'\]=-1.0"),
        ({**LLAMA3, "high_freq_factor": 1.0}, {}, ValueError,
         r"`scaling\['high_freq_factor'\]` must exceed"),
        ({**YARN, "truncate": "yes"}, {}, TypeError,
         r"`scaling\['truncate'\]` must be a bool"),
        ("yarn", {}, TypeError, r"`scaling` must be None or a dict"),
        ({"rope_type": "linear", "factor": 2.0}, {"scaling_factor": 2.0}, ValueError,
         r"`scaling` and `scaling_factor` both scale.*scaling_factor=2.0"),
    ],
    ids=[
        "unknown-type", "no-type", "missing-factor", "unknown-key", "yarn-missing",
        "attention-factor-0", "yarn-unknown", "llama3-attention-factor",
        "factor-0", "original-negative", "beta-negative", "llama3-bands",
        "truncate-str", "not-a-dict", "with-scaling-factor",
    ],
)  # fmt: skip
def test_rotary_embedding_bad_scaling(scaling, kwargs, error, match):
    x = random_floats(1, 3, 2, 4)
    with pytest.raises(error, match=match):
        attn_ops.rotary_embedding(x, np.arange(3), scaling=scaling, **kwargs)


def test_segment_positions_restart_at_each_run_compiled_too():
    """Each run of equal ids counts from 0 (an id coming back starts a new
    run); the same under TensorFlow's XLA (under `jax.jit`: the layers'
    tests, tests/layers/test_segment_ids.py)."""
    ids = np.array([[7, 7, 7, 2, 2, 7, 7, 0, 0, 0, 0], [3] * 11], dtype="int32")
    expected = [[0, 1, 2, 0, 1, 0, 1, 0, 1, 2, 3], list(range(11))]
    positions = attn_ops.segment_positions
    np.testing.assert_array_equal(to_numpy(positions(ids)), expected)
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        compiled = tf.function(positions, jit_compile=True)
        np.testing.assert_array_equal(compiled(tf.constant(ids)), expected)
