"""Saving and loading: every kind of model reloads with identical outputs,
weights exactly; configs written by other keras_attn versions and damaged
files fail clearly; the reloaded model runs with unknown batch and length and
under `jit_compile`."""

import json
import re
import zipfile

import keras
import numpy as np
import pytest

import keras_attn
from keras_attn import (
    MultiHeadAttention,
    SinusoidalEmbedding,
    TransformerDecoder,
    TransformerEncoder,
)
from tests.helpers.backend import BACKEND, to_numpy
from tests.helpers.builders import REQUIRED_ARGUMENTS, VOCAB, padded_ids


def all_layers():
    """Every keras_attn layer, named; Keras masks come from `mask_zero`."""
    return {
        "source": SinusoidalEmbedding(
            vocabulary_size=VOCAB, embedding_dim=16, mask_zero=True, name="source"
        ),
        "encoder": TransformerEncoder(32, 4, num_key_value_heads=2, name="encoder"),
        "target": SinusoidalEmbedding(
            vocabulary_size=VOCAB, embedding_dim=16, mask_zero=True, name="target"
        ),
        "decoder": TransformerDecoder(
            32, 4, normalize_first=True, use_gate=True, name="decoder"
        ),
        "attention": MultiHeadAttention(
            2, key_dim=5, sliding_window=3, name="attention"
        ),
        "head": keras.layers.Dense(VOCAB, name="head"),
    }


@keras.saving.register_keras_serializable(package="keras_attn_tests")
class Translator(keras.Model):
    """A subclassed model of every keras_attn layer (Keras rebuilds it from
    float32 placeholders on load)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.parts = all_layers()

    def call(self, inputs):
        source, target = inputs
        p = self.parts
        x = p["encoder"](p["source"](source))
        y = p["decoder"](p["target"](target), x)
        return p["head"](p["attention"](y, x))


def functional_translator():
    p = all_layers()
    source = keras.Input((None,), dtype="int32", name="source_ids")
    target = keras.Input((None,), dtype="int32", name="target_ids")
    x = p["encoder"](p["source"](source))
    y = p["decoder"](p["target"](target), x)
    return keras.Model([source, target], p["head"](p["attention"](y, x)))


def sequential_classifier():
    return keras.Sequential(
        [
            keras.Input((None,), dtype="int32"),
            SinusoidalEmbedding(
                vocabulary_size=VOCAB, embedding_dim=16, mask_zero=True
            ),
            TransformerEncoder(32, 4, sliding_window=2),
            TransformerDecoder(32, 4),
            MultiHeadAttention(2, output_shape=VOCAB),
        ]
    )


@pytest.mark.parametrize("kind", ["subclassed", "functional", "sequential"])
def test_every_kind_of_model_reloads_with_identical_outputs(kind, tmp_path):
    if kind == "sequential":
        model, inputs = sequential_classifier(), padded_ids(3, 5)
    else:
        model = Translator() if kind == "subclassed" else functional_translator()
        inputs = [padded_ids(3, 5, seed=1), padded_ids(3, 4, seed=2)]
    expected = to_numpy(model(inputs))
    path = tmp_path / f"{kind}.keras"
    model.save(path)
    with _no_warning():
        loaded = keras.models.load_model(path)
    np.testing.assert_array_equal(to_numpy(loaded(inputs)), expected)
    paths = [w.path for w in model.weights]
    assert len(set(paths)) == len(paths)  # every weight has its own path
    for original, restored in zip(model.weights, loaded.weights, strict=True):
        np.testing.assert_array_equal(
            to_numpy(restored), to_numpy(original), err_msg=original.path
        )


class _no_warning:
    """Loading must not fall back to fresh weights with a mere warning."""

    def __enter__(self):
        import warnings

        self._catch = warnings.catch_warnings(record=True)
        self._log = self._catch.__enter__()
        warnings.simplefilter("always")

    def __exit__(self, *exc):
        self._catch.__exit__(*exc)
        messages = [str(w.message) for w in self._log]
        assert not [m for m in messages if "build" in m or "variables" in m], messages


# --- One saved model: configs of other versions, damaged files, shapes ------


def eager_all_layers(model, source, target):
    """`functional_translator` layer by layer, with explicit padding masks."""
    layer = {layer.name: layer for layer in model.layers}
    x = layer["source"](source)
    x = layer["encoder"](x, padding_mask=source != 0)
    y = layer["target"](target)
    y = layer["decoder"](
        y, x, decoder_padding_mask=target != 0, encoder_padding_mask=source != 0
    )
    y = layer["attention"](y, x, value_mask=source != 0)
    return to_numpy(layer["head"](y))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    keras.utils.set_random_seed(0)
    model = functional_translator()
    path = tmp_path_factory.mktemp("saved") / "model.keras"
    model.save(path)
    return model, path


def rewrite(path, out, edit_config=None, edit_files=None):
    """Copy the `.keras` zip at `path` to `out`, editing its config or files."""
    with zipfile.ZipFile(path) as archive:
        files = {name: archive.read(name) for name in archive.namelist()}
    if edit_config is not None:
        config = json.loads(files["config.json"])
        edit_config(config)
        files["config.json"] = json.dumps(config).encode()
    if edit_files is not None:
        edit_files(files)
    with zipfile.ZipFile(out, "w") as archive:
        for name, data in files.items():
            archive.writestr(name, data)
    return out


def layer_config(config, class_name):
    """The (first) config of a `class_name` layer in a functional model's config."""
    (first, *_) = [
        layer["config"]
        for layer in config["config"]["layers"]
        if layer["class_name"] == class_name
    ]
    return first


LAYER_CLASSES = [
    "MultiHeadAttention",
    "SinusoidalEmbedding",
    "TransformerEncoder",
    "TransformerDecoder",
]


@pytest.mark.parametrize("class_name", LAYER_CLASSES)
def test_config_from_a_newer_version_names_the_unknown_key(saved, tmp_path, class_name):
    _, path = saved
    newer = rewrite(
        path,
        tmp_path / "newer.keras",
        lambda config: layer_config(config, class_name).update(rope_theta=1e4),
    )
    version = re.escape(keras_attn.__version__)
    with pytest.raises(
        ValueError,
        match=rf"Cannot create {class_name} .* keras_attn {version}\. Received: "
        r"unknown arguments \['rope_theta'\]\. .*upgrade keras_attn",
    ):
        keras.models.load_model(newer)


@pytest.mark.parametrize(
    "class_name, key",
    [
        ("MultiHeadAttention", "num_heads"),
        ("TransformerEncoder", "intermediate_dim"),
        ("TransformerDecoder", "num_heads"),
    ],
)
def test_config_without_a_required_key_names_it(saved, tmp_path, class_name, key):
    _, path = saved
    older = rewrite(
        path,
        tmp_path / "older.keras",
        lambda config: layer_config(config, class_name).pop(key),
    )
    with pytest.raises(
        ValueError,
        match=rf"Cannot create {class_name} .*missing required arguments \['{key}'\]"
        r".*downgrade keras_attn",
    ):
        keras.models.load_model(older)


@pytest.mark.parametrize(
    "cls",
    [MultiHeadAttention, SinusoidalEmbedding, TransformerEncoder, TransformerDecoder],
)
def test_from_config_checks_keys_and_still_round_trips(cls):
    config = cls(**REQUIRED_ARGUMENTS[cls]).get_config()
    assert cls.from_config(config).get_config() == config
    for key in REQUIRED_ARGUMENTS[cls]:
        config.pop(key)
    config.update(rope_theta=1.0, use_rotary=True)
    missing = sorted(REQUIRED_ARGUMENTS[cls])
    missing = re.escape(f" and missing required arguments {missing}") if missing else ""
    with pytest.raises(
        ValueError,
        match=rf"{cls.__name__} .*unknown arguments \['rope_theta', 'use_rotary'\]"
        + missing,
    ):
        cls.from_config(config)


def test_subclasses_that_take_their_own_kwargs_still_load():
    class Tagged(MultiHeadAttention):  # takes "tag" through **kwargs
        def __init__(self, **kwargs):
            self.tag = kwargs.pop("tag", None)
            super().__init__(**kwargs)

        def get_config(self):
            return {**super().get_config(), "tag": self.tag}

    config = Tagged(num_heads=2, tag="mine").get_config()
    assert Tagged.from_config(config).tag == "mine"


def test_truncated_file_is_not_a_keras_archive(saved, tmp_path):
    # Keras (3.15) says "File not found" for any `.keras` path that is not a
    # zip file, then "Please ensure the file is an accessible `.keras` zip file".
    _, path = saved
    data = path.read_bytes()
    for size in (0, 100, len(data) // 2, len(data) - 10):
        truncated = tmp_path / f"truncated_{size}.keras"
        truncated.write_bytes(data[:size])
        with pytest.raises(ValueError, match=r"an accessible `\.keras` zip file"):
            keras.models.load_model(truncated)


def test_truncated_weights_inside_the_archive(saved, tmp_path):
    _, path = saved

    def cut_weights(files):
        files["model.weights.h5"] = files["model.weights.h5"][:-1000]

    damaged = rewrite(path, tmp_path / "damaged.keras", edit_files=cut_weights)
    with pytest.raises(OSError, match="truncated file"):
        keras.models.load_model(damaged)


def all_layers_inputs(batch, source_length, target_length, seed=0):
    """Token ids with right padding, a fully padded source and target row."""
    rng = np.random.default_rng(seed)
    source = rng.integers(1, VOCAB, (batch, source_length)).astype("int32")
    target = rng.integers(1, VOCAB, (batch, target_length)).astype("int32")
    source[0, source_length // 2 + 1 :] = 0
    if batch > 1:
        source[-1] = 0
        target[-1, 1:] = 0
        target[-2] = 0
    return source, target


SHAPES = [(1, 1, 1), (3, 7, 4)]  # (batch, source length, target length)


def test_unknown_batch_and_length(saved):
    model, _ = saved
    for shape in SHAPES:
        source, target = all_layers_inputs(*shape)
        expected = eager_all_layers(model, source, target)
        assert np.all(np.isfinite(expected))
        predicted = model.predict([source, target], verbose=0, batch_size=shape[0])
        np.testing.assert_allclose(predicted, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(
    BACKEND == "torch",
    reason="jit_compile=True on torch means torch.compile (Keras: experimental); "
    "keras_attn checks XLA compilation on jax and tensorflow only",
)
def test_jit_compile(saved):
    model, path = saved
    compiled = keras.models.load_model(path)
    compiled.compile(jit_compile=True)
    for shape in SHAPES:
        source, target = all_layers_inputs(*shape)
        expected = eager_all_layers(model, source, target)
        predicted = compiled.predict([source, target], verbose=0, batch_size=shape[0])
        np.testing.assert_allclose(predicted, expected, atol=1e-5, rtol=1e-5)
