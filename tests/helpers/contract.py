"""The layer contract every public layer must satisfy: `run_layer_contract`
and its `check_*` pieces."""

import inspect
import os
import warnings

import keras
import numpy as np

from tests.helpers.backend import BACKEND, flat_numpy, to_numpy
from tests.helpers.builders import functional_model

# `model.quantize(mode)` output error relative to float (`||q - f|| / ||f||`),
# measured ~0.01, ~0.05-0.09 and ~0.09-0.11 on small random layers.
QUANTIZATION_TOLERANCE = {"int8": 0.05, "float8": 0.25, "int4": 0.35}
QUANTIZABLE = (keras.layers.EinsumDense, keras.layers.Dense, keras.layers.Embedding)


def save_and_load(model, tmp_path, name):
    path = os.path.join(str(tmp_path), f"{name}.keras")
    model.save(path)
    return keras.models.load_model(path)


def assert_outputs_close(actual, expected, tolerance=1e-6):
    for a, e in zip(flat_numpy(actual), flat_numpy(expected), strict=True):
        np.testing.assert_allclose(a, e, atol=tolerance, rtol=tolerance)


def relative_error(actual, expected):
    actual, expected = to_numpy(actual), to_numpy(expected)
    return float(np.linalg.norm(actual - expected) / np.linalg.norm(expected))


def run_layer_contract(
    layer_cls,
    init_kwargs,
    inputs,
    call_kwargs=None,
    expected_output_shape=None,
    tmp_path=None,
    mixed_precision=True,
    machinery=True,
    quantization_modes=tuple(QUANTIZATION_TOLERANCE),
):
    """The contract: config round trip, explicit build, eager and symbolic calls,
    `compute_output_shape`/`compute_output_spec`, `.keras` save/load,
    jit-compiled predict, mixed-precision dtypes, and Keras' machinery:
    `quantize` in every mode, `enable_lora` and `DTypePolicyMap`, each with a
    `.keras` round trip.

    Args:
        layer_cls: the layer class.
        init_kwargs: dict of constructor arguments.
        inputs: dict of call argument name -> numpy array (float or int).
        call_kwargs: dict of extra (non-tensor) call arguments.
        expected_output_shape: tuple compared with the eager output's shape.
        tmp_path: directory for the `.keras` files; without it, nothing is
            saved (and Keras' machinery is not checked).
        mixed_precision: whether to check the mixed policies too.
        machinery: whether to check quantize, LoRA and policy maps (each
            with a `.keras` round trip).
        quantization_modes: the `quantize` modes checked (each compiles the
            quantized kernels anew, seconds on JAX).
    """
    call_kwargs = call_kwargs or {}
    check_config_round_trip(layer_cls, init_kwargs)

    # Explicit build creates every weight; a call then creates none.
    layer = layer_cls(**init_kwargs)
    layer.build(**{f"{name}_shape": array.shape for name, array in inputs.items()})
    assert layer.built
    weight_names = sorted(w.path for w in layer.weights)
    eager = layer(**inputs, **call_kwargs)
    assert sorted(w.path for w in layer.weights) == weight_names
    if expected_output_shape is not None:
        assert flat_numpy(eager)[0].shape == tuple(expected_output_shape)
    assert all(np.all(np.isfinite(x)) for x in flat_numpy(eager))
    check_output_spec(layer, inputs, call_kwargs, eager)

    # Symbolic call in a functional model with unknown batch and length.
    model = functional_model(layer, inputs, call_kwargs)
    assert_outputs_close(model(inputs), eager)
    if tmp_path is not None:
        assert_outputs_close(save_and_load(model, tmp_path, "float")(inputs), eager)

    # jit-compiled predict equals eager.
    model.compile(jit_compile=BACKEND != "torch")
    batch = len(next(iter(inputs.values())))
    predicted = model.predict(inputs, verbose=0, batch_size=batch)
    assert_outputs_close(predicted, eager, tolerance=1e-5)

    if mixed_precision:
        for policy in ("mixed_float16", "mixed_bfloat16"):
            check_mixed_precision(layer_cls, init_kwargs, inputs, call_kwargs, policy)
    if machinery and tmp_path is not None and _quantizable_sublayers(layer):
        for mode in quantization_modes:
            check_quantization(
                layer_cls, init_kwargs, inputs, call_kwargs, mode, tmp_path
            )
        check_lora(layer_cls, init_kwargs, inputs, call_kwargs, tmp_path)
        check_dtype_policy_map(layer_cls, init_kwargs, inputs, call_kwargs, tmp_path)
    return flat_numpy(eager)[0]


def check_config_round_trip(layer_cls, init_kwargs):
    """Every constructor argument is in the config, which recreates the layer."""
    layer = layer_cls(**init_kwargs)
    config = layer.get_config()
    for name, value in init_kwargs.items():
        if not isinstance(value, str | dict) and name not in ("dtype",):
            assert config[name] == value, (name, config[name], value)
    revived = layer_cls.from_config(config)
    assert revived.get_config() == config


def check_output_spec(layer, inputs, call_kwargs, eager):
    """`compute_output_spec` and `compute_output_shape` describe the eager call."""
    symbolic = {
        name: keras.KerasTensor(array.shape, dtype=str(array.dtype))
        for name, array in inputs.items()
    }
    spec = keras.tree.flatten(layer.compute_output_spec(**symbolic, **call_kwargs))
    outputs = keras.tree.flatten(eager)
    assert len(spec) == len(outputs)
    for expected, actual in zip(spec, outputs, strict=True):
        assert tuple(expected.shape) == tuple(actual.shape)
        assert keras.backend.standardize_dtype(
            expected.dtype
        ) == keras.backend.standardize_dtype(actual.dtype)
    accepted = inspect.signature(layer.compute_output_shape).parameters
    shapes = {
        f"{name}_shape": array.shape
        for name, array in inputs.items()
        if f"{name}_shape" in accepted
    }
    assert tuple(layer.compute_output_shape(**shapes)) == tuple(outputs[0].shape)


def check_mixed_precision(layer_cls, init_kwargs, inputs, call_kwargs, policy):
    """Float32 weights, compute-dtype outputs and specs, finite numbers."""
    layer = layer_cls(**init_kwargs, dtype=policy)
    output = layer(**inputs, **call_kwargs)
    compute_dtype = policy.split("_")[1]
    assert keras.backend.standardize_dtype(flat_output(output).dtype) == compute_dtype
    for weight in layer.weights:
        if weight.trainable:
            assert keras.backend.standardize_dtype(weight.dtype) == "float32", (
                weight.path
            )
    check_output_spec(layer, inputs, call_kwargs, output)
    assert np.all(np.isfinite(to_numpy(keras.ops.cast(flat_output(output), "float32"))))


def flat_output(outputs):
    return keras.tree.flatten(outputs)[0]


def _quantizable_sublayers(layer):
    return [
        s
        for s in layer._flatten_layers(include_self=False)
        if isinstance(s, QUANTIZABLE)
    ]


def _fresh_model(layer_cls, init_kwargs, inputs, call_kwargs, **layer_kwargs):
    keras.utils.set_random_seed(7)
    layer = layer_cls(**init_kwargs, **layer_kwargs)
    return layer, functional_model(layer, inputs, call_kwargs)


def check_quantization(layer_cls, init_kwargs, inputs, call_kwargs, mode, tmp_path):
    """`model.quantize(mode)` reaches every projection and token table (but
    the table in float8, which Keras' `Embedding` lacks), stays close to
    float, and reloads from `.keras` with identical outputs."""
    layer, model = _fresh_model(layer_cls, init_kwargs, inputs, call_kwargs)
    if not _eligible_sublayers(layer, mode):  # a token table alone, in float8
        return
    expected = model(inputs)
    with warnings.catch_warnings():  # "does not have a `quantize` method" for the rest
        warnings.simplefilter("ignore")
        model.quantize(mode)
    assert quantized_share(layer, mode) == 1.0
    quantized = model(inputs)
    error = relative_error(flat_output(quantized), flat_output(expected))
    assert error < QUANTIZATION_TOLERANCE[mode], (mode, error)
    assert_outputs_close(save_and_load(model, tmp_path, mode)(inputs), quantized)


def _eligible_sublayers(layer, mode):
    """The sublayers `mode` quantizes: Keras' `Embedding` has no float8 mode."""
    sublayers = _quantizable_sublayers(layer)
    if mode == "float8":
        sublayers = [s for s in sublayers if not isinstance(s, keras.layers.Embedding)]
    return sublayers


def quantized_share(layer, mode):
    """The share of the kernel/table parameters of `layer` that `mode` converted."""
    sublayers = _eligible_sublayers(layer, mode)
    sizes = {id(s): _parameter_count(s) for s in sublayers}
    converted = sum(sizes[id(s)] for s in sublayers if s.quantization_mode == mode)
    return converted / sum(sizes.values())


def _parameter_count(sublayer):
    if isinstance(sublayer, keras.layers.Embedding):
        return sublayer.input_dim * sublayer.output_dim
    shape = getattr(sublayer, "original_kernel_shape", None) or sublayer.kernel.shape
    return int(np.prod(shape))


def check_lora(layer_cls, init_kwargs, inputs, call_kwargs, tmp_path):
    """After `enable_lora`, only adapters train, `fit` trains them, and the
    model reloads (adapters merged) with identical outputs."""
    layer, model = _fresh_model(layer_cls, init_kwargs, inputs, call_kwargs)
    frozen = {w.path: to_numpy(w).copy() for w in model.weights}
    layer.enable_lora(2)
    adapters = model.trainable_weights
    assert adapters and all(w.name.startswith("lora_") for w in adapters)
    outputs = keras.tree.flatten(model(inputs))
    if len(outputs) == 1:  # one output: fit it to random targets
        target = np.random.default_rng(1).standard_normal(outputs[0].shape)
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        model.fit(inputs, target.astype("float32"), epochs=2, verbose=0)
        for weight in model.weights:
            if weight.path in frozen:
                np.testing.assert_array_equal(to_numpy(weight), frozen[weight.path])
        assert any(
            not np.allclose(to_numpy(w), 0.0) for w in adapters if w.name.endswith("b")
        )
    assert_outputs_close(
        save_and_load(model, tmp_path, "lora")(inputs), model(inputs), 1e-5
    )


def check_dtype_policy_map(layer_cls, init_kwargs, inputs, call_kwargs, tmp_path):
    """A `DTypePolicyMap` naming one sublayer's path quantizes that sublayer
    from the start, and the layer reloads from `.keras` with identical outputs."""
    probe = layer_cls(**init_kwargs, name="probe")
    probe.build(**{f"{name}_shape": array.shape for name, array in inputs.items()})
    target = _quantizable_sublayers(probe)[0].path
    policy_map = keras.dtype_policies.DTypePolicyMap()
    policy_map[target] = keras.dtype_policies.QuantizedDTypePolicy("int8", "float32")
    layer, model = _fresh_model(
        layer_cls, init_kwargs, inputs, call_kwargs, dtype=policy_map, name="probe"
    )
    (sublayer,) = [s for s in layer._flatten_layers() if s.path == target]
    assert sublayer.quantization_mode == "int8"
    others = [s for s in _quantizable_sublayers(layer) if s is not sublayer]
    assert all(s.quantization_mode is None for s in others)
    outputs = model(inputs)
    assert_outputs_close(save_and_load(model, tmp_path, "policy_map")(inputs), outputs)
