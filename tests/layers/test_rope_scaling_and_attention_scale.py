"""The attention options `rope_scaling` (Hugging Face's dicts; the numbers
are tested against keras-hub in tests/ops/test_positions.py) and
`attention_scale` (the logits' multiplier, on every kernel path), on
`MultiHeadAttention` and the blocks."""

import json

import numpy as np
import pytest

from keras_attn import MultiHeadAttention, TransformerDecoder
from tests.helpers.backend import BACKEND, to_numpy
from tests.helpers.builders import functional_model, random_floats
from tests.helpers.contract import check_config_round_trip, save_and_load

# The sizes of the other attention tests: their kernels are compiled already.
WIDTH, HEADS, KEY_DIM = 8, 2, 4
ROPE = {"rope_max_wavelength": 100.0}
SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 4.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8,
    },
}
TOLERANCE = dict(atol=1e-5, rtol=1e-5)


def attention(**kwargs):
    return MultiHeadAttention(num_heads=HEADS, **kwargs)


@pytest.mark.parametrize(
    "options",
    [{**ROPE, "rope_scaling": SCALINGS["yarn"]}, {"attention_scale": 0.125}],
    ids=["rope_scaling", "attention_scale"],
)
def test_config_and_keras_file_round_trip(tmp_path, options):
    layer = attention(**options)
    config = layer.get_config()
    assert json.loads(json.dumps(config)) == config
    if "rope_scaling" in options:  # a plain dict, not Keras' tracked one
        assert type(config["rope_scaling"]) is dict
    check_config_round_trip(MultiHeadAttention, {"num_heads": HEADS, **options})
    x = random_floats(2, 6, WIDTH)
    model = functional_model(layer, {"query": x}, {"use_causal_mask": True})
    loaded = save_and_load(model, tmp_path, "options")
    inputs = {"query": x}
    np.testing.assert_allclose(
        to_numpy(loaded(inputs)), to_numpy(model(inputs)), atol=1e-6
    )
    assert loaded.layers[-1].get_config() == config


def test_rope_scaling_is_saved_with_its_defaults():
    layer = attention(**ROPE, rope_scaling=SCALINGS["yarn"])
    defaults = {"beta_fast": 32.0, "beta_slow": 1.0, "truncate": True}
    assert layer.get_config()["rope_scaling"] == {**SCALINGS["yarn"], **defaults}


def test_the_blocks_take_both_options_and_cross_attention_gets_no_scaling():
    options = {"rope_scaling": SCALINGS["llama3"], "attention_scale": 0.2}
    arguments = {"intermediate_dim": 16, "num_heads": 2, **ROPE, **options}
    check_config_round_trip(TransformerDecoder, arguments)
    decoder = TransformerDecoder(**arguments)
    assert json.loads(json.dumps(decoder.get_config())) == decoder.get_config()
    decoder(random_floats(2, 3, 8), random_floats(2, 5, 8))
    assert decoder.self_attention.rope_scaling == SCALINGS["llama3"]
    assert decoder.cross_attention.rope_scaling is None
    assert decoder.cross_attention.attention_scale == 0.2


def scaled_query_copy(layer, factor):
    """A default-scaled twin of `layer` whose queries are `factor` times
    larger: `attention_scale=s` equals a query kernel (and bias) times
    `s * sqrt(key_dim)`."""
    config = {**layer.get_config(), "attention_scale": None}
    twin = MultiHeadAttention.from_config(config)
    twin.build((2, 6, WIDTH))
    twin.set_weights(layer.get_weights())
    for weight in twin.query_dense.weights:
        weight.assign(weight * factor)
    return twin


@pytest.mark.parametrize(
    "options",
    [
        {"flash_attention": None},
        {"flash_attention": False},
        {"flash_attention": False, "logit_soft_cap": 2.0},
        {"flash_attention": None, **ROPE, "rope_scaling": SCALINGS["dynamic"]},
    ],
    ids=["fused", "explicit", "soft-capped", "rope-scaled"],
)
def test_attention_scale_equals_scaled_queries(options, fused_calls):
    """On every path, and soft-capping after the scale; the fused kernel runs
    where the backend has one (not TensorFlow)."""
    scale = 0.05
    layer = attention(attention_scale=scale, **options)
    x = random_floats(2, 6, WIDTH)
    mask = np.arange(6)[None] < np.array([[6], [4]])  # a padded row
    ours = to_numpy(layer(x, query_mask=mask, use_causal_mask=True))
    twin = scaled_query_copy(layer, scale * np.sqrt(KEY_DIM))
    expected = to_numpy(twin(x, query_mask=mask, use_causal_mask=True))
    np.testing.assert_allclose(ours, expected, **TOLERANCE)
    unscaled = attention(**options)
    unscaled.build(x.shape)
    unscaled.set_weights(layer.get_weights())
    unscaled = to_numpy(unscaled(x, query_mask=mask, use_causal_mask=True))
    assert not np.allclose(unscaled, ours, atol=1e-3)
    fused = options["flash_attention"] is None and BACKEND != "tensorflow"
    assert bool(fused_calls) == fused


@pytest.mark.parametrize("scaling", list(SCALINGS))
def test_cached_decoding_equals_the_full_call(scaling):
    """Step by step through a key/value cache (rotary positions from the
    cache index), as the full causal call, with `attention_scale` too."""
    layer = attention(**ROPE, rope_scaling=SCALINGS[scaling], attention_scale=0.3)
    x = random_floats(2, 6, WIDTH)
    full = to_numpy(layer(x, use_causal_mask=True))
    cache, steps = layer.get_empty_cache(2, 6), []
    for i in range(6):
        output, cache = layer(
            x[:, i : i + 1], use_causal_mask=True, cache=cache, cache_update_index=i
        )
        steps.append(to_numpy(output))
    np.testing.assert_allclose(np.concatenate(steps, axis=1), full, **TOLERANCE)
    plain = attention(**ROPE, attention_scale=0.3)
    plain.build(x.shape)
    plain.set_weights(layer.get_weights())
    assert not np.allclose(to_numpy(plain(x, use_causal_mask=True)), full, atol=1e-4)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"rope_scaling": SCALINGS["linear"]}, ValueError,
         r"`rope_scaling` scales rotary positions.*rope_max_wavelength=None"),
        ({**ROPE, "rope_scaling": SCALINGS["linear"], "rope_scaling_factor": 2.0},
         ValueError,
         r"`rope_scaling` and `rope_scaling_factor` both scale.*"
         r"rope_scaling_factor=2.0"),
        ({**ROPE, "rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, ValueError,
         r"`rope_scaling` of rope_type 'yarn'.*"
         r"missing keys \['original_max_position_embeddings'\]"),
        ({**ROPE, "rope_scaling": {"rope_type": "linear", "factor": -2.0}},
         ValueError, r"rope_scaling\['factor'\]=-2.0"),
        ({"attention_scale": 0.0}, ValueError,
         r"`attention_scale` must be positive. Received: attention_scale=0.0"),
        ({"attention_scale": "1/8"}, TypeError, r"attention_scale='1/8' of type str"),
    ],
    ids=["no-rope", "with-factor", "yarn-missing", "factor-negative",
         "scale-0", "scale-str"],
)  # fmt: skip
@pytest.mark.parametrize("cls", [MultiHeadAttention, TransformerDecoder])
def test_bad_options(cls, kwargs, error, match):
    required = {"intermediate_dim": 8} if cls is TransformerDecoder else {}
    with pytest.raises(error, match=match):
        cls(num_heads=2, **required, **kwargs)
