"""The Keras releases keras_attn supports and the Keras internals it leans on
(`keras_attn._keras_compat`): a Keras release that moves one fails here, not
silently elsewhere."""

import re

import keras
import numpy as np
import pytest

import keras_attn
from keras_attn import _keras_compat
from keras_attn.layers import _int8
from keras_attn.layers._machinery import dtype_config
from tests.helpers.backend import BACKEND


def test_the_installed_keras_is_supported():
    assert _keras_compat.keras_version() >= _keras_compat.MINIMUM_KERAS
    _keras_compat.check_keras_version()


@pytest.mark.parametrize("version", ["3.14.1", "3.10.0", "2.15.0"])
def test_an_older_keras_is_refused_naming_the_version_needed(version):
    with pytest.raises(
        ImportError, match=rf"Keras >= 3\.15\. Received: Keras {version}"
    ):
        _keras_compat.check_keras_version(version)


def test_development_releases_count_as_their_release():
    assert _keras_compat.keras_version("3.16.0.dev2026102704") == (3, 16, 0)
    assert _keras_compat.keras_version("3.15.1") == (3, 15, 1)
    _keras_compat.check_keras_version("3.15.0.dev2026010100")


def test_the_int8_route_is_where_this_keras_contracts():
    """Keras 3.15 contracts in each layer's `_int8_call`; from 3.16 its
    strategies contract through the layer's quantization geometry."""
    expected = "geometry" if _keras_compat.keras_version() >= (3, 16) else "int8_call"
    assert _keras_compat.INT8_ROUTE == expected


@pytest.mark.skipif(BACKEND == "torch", reason="XLA's GPU int8 dot (JAX, TensorFlow)")
@pytest.mark.parametrize("layer_class", [_int8.Dense, _int8.EinsumDense])
def test_the_int8_padding_is_reached(xla_gpu, monkeypatch, layer_class):
    """The padding runs inside Keras' int8 call on this Keras (the numbers
    are `tests/layers/test_xla_int8_rule.py`'s)."""
    padded = []

    def spy(x, spec, pads):
        padded.append(dict(pads))
        return pad_axes(x, spec, pads)

    pad_axes = _int8.pad_axes
    monkeypatch.setattr(_int8, "pad_axes", spy)
    if layer_class is _int8.Dense:
        layer = layer_class(6)
    else:
        layer = layer_class("abc,cd->abd", output_shape=(None, 6))
    layer.build((2, 3, 9))
    layer.quantize("int8")
    layer(np.ones((2, 3, 9), "float32"))
    assert padded and all(list(pads.values()) == [3] for pads in padded)


def test_the_autocast_scope_is_read_where_keras_sets_it():
    scopes = []

    class Probe(keras.layers.Layer):
        def call(self, x):
            scopes.append(_keras_compat.get_autocast_scope())
            return x

    assert _keras_compat.get_autocast_scope() is None
    Probe(dtype="mixed_float16")(np.ones((1, 2), "float32"))
    assert keras.backend.standardize_dtype(scopes[0].dtype) == "float16"


def test_the_stateless_scope_is_read_where_keras_opens_it():
    assert _keras_compat.in_stateless_scope is not None, "Keras moved it"
    assert not _keras_compat.in_stateless_scope()
    with keras.StatelessScope():
        assert _keras_compat.in_stateless_scope()


def test_dtype_policy_map_keys_match_their_sublayer_only():
    """Keys are anchored: the int8 `query` must not reach `query_norm`
    (Keras up to 3.11 matched keys with `re.search`)."""
    block = keras_attn.TransformerDecoder(8, 2, normalize_qk=True)
    inputs = keras.Input((3, 8))
    block(inputs)
    layers = {layer.path: layer for layer in block._flatten_layers() if layer.path}
    layers[f"{block.path}/self_attention/query"].quantize("int8")
    keys = dtype_config(block)["config"]["policy_map"]
    paths = list(layers)
    for key in keys:
        assert [p for p in paths if re.search(key, p)] == [
            p for p in paths if re.fullmatch(key, p)
        ], key


@pytest.mark.skipif(BACKEND == "torch", reason="XLA's GPU int8 dot (JAX, TensorFlow)")
def test_int8_is_refused_on_an_xla_gpu_where_no_route_reaches(monkeypatch):
    """A Keras that contracts where `_int8` cannot pad is refused on a GPU,
    not left with XLA's wrong int8 dot."""
    monkeypatch.setattr(_keras_compat, "INT8_ROUTE", None)
    monkeypatch.setattr(keras.distribution, "list_devices", lambda: ["gpu:0"])
    layer = _int8.Dense(6)
    layer.build((2, 9))
    with pytest.raises(NotImplementedError, match="Received: mode='int8'"):
        layer.quantize("int8")
    layer.quantize("float8")  # no int8 dot
    loaded = _int8.Dense(6, dtype=keras.dtype_policies.get("int8_from_float32"))
    with pytest.raises(NotImplementedError, match="Received: mode='int8'"):
        loaded.build((2, 9))  # as a saved int8 model loads: built quantized
    assert not loaded.weights


def test_the_padded_layers_build_as_keras_layers_do():
    """Keras reads `build`'s argument names: a lazy build from a call and
    the saved build config work as on Keras' own layers."""
    layer = _int8.Dense(6)
    layer(np.ones((2, 9), "float32"))  # built from the call
    assert layer.get_build_config() == {"input_shape": (2, 9)}
    einsum = _int8.EinsumDense("ab,bc->ac", output_shape=6)
    einsum.build_from_config(layer.get_build_config())
    assert tuple(einsum.kernel.shape) == (9, 6)


def test_a_geometry_that_reads_its_layer_is_no_route_and_import_raises_nothing():
    """The route is read at import from the class: a Keras whose
    `_quantization_geometry` reads the layer gives no route, not an error."""

    class ReadsItsLayer:
        def _quantization_geometry(self):
            return self.kernel

    assert _keras_compat._geometry_of(ReadsItsLayer) is None
    assert _keras_compat._geometry_of(object) is None
