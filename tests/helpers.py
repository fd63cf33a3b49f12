"""Shared test helpers: the layer contract every public layer must satisfy."""

import os

import keras
import numpy as np

BACKEND = keras.backend.backend()


def has_accelerator():
    """Whether the current backend runs on a GPU/TPU (CI machines have none)."""
    if BACKEND == "jax":
        import jax

        return jax.devices()[0].platform != "cpu"
    if BACKEND == "tensorflow":
        import tensorflow as tf

        return bool(tf.config.list_physical_devices("GPU"))
    import torch

    return torch.cuda.is_available()


def to_numpy(x):
    return keras.ops.convert_to_numpy(x)


def random_floats(*shape, seed=0, scale=1.0):
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(
        "float32"
    )


def functional_model(layer, inputs, call_kwargs=None):
    """Wrap `layer` in a functional model with one `keras.Input` per input array.

    Batch and length are left unknown (None), as users build them.
    """
    symbolic = {}
    for name, array in inputs.items():
        unknown = (None,) * (array.ndim - 1)  # every axis but the batch
        if array.dtype.kind == "f":  # keep the feature width
            unknown = unknown[:-1] + array.shape[-1:]
        symbolic[name] = keras.Input(shape=unknown, dtype=str(array.dtype), name=name)
    outputs = layer(**symbolic, **(call_kwargs or {}))
    return keras.Model(symbolic, outputs)


def run_layer_contract(
    layer_cls,
    init_kwargs,
    inputs,
    call_kwargs=None,
    expected_output_shape=None,
    tmp_path=None,
    mixed_precision=True,
):
    """The contract: config round trip, explicit build, eager and symbolic calls,
    `.keras` save/load, jit-compiled predict, and mixed-precision dtypes.

    Args:
        layer_cls: the layer class.
        init_kwargs: dict of constructor arguments.
        inputs: dict of call argument name -> numpy array (float or int).
        call_kwargs: dict of extra (non-tensor) call arguments.
        expected_output_shape: tuple compared with the eager output's shape.
        tmp_path: directory for the `.keras` file.
        mixed_precision: whether to check the mixed policies too.
    """
    call_kwargs = call_kwargs or {}
    # Config round trip, with every constructor argument reflected.
    layer = layer_cls(**init_kwargs)
    config = layer.get_config()
    for name, value in init_kwargs.items():
        if not isinstance(value, str | dict) and name not in ("dtype",):
            assert config[name] == value, (name, config[name], value)
    revived = layer_cls.from_config(config)
    assert revived.get_config() == config

    # Explicit build creates every weight; a call then creates none.
    shapes = {f"{name}_shape": array.shape for name, array in inputs.items()}
    layer.build(**shapes)
    assert layer.built
    weight_names = sorted(w.path for w in layer.weights)
    eager = to_numpy(layer(**inputs, **call_kwargs))
    assert sorted(w.path for w in layer.weights) == weight_names
    if expected_output_shape is not None:
        assert eager.shape == tuple(expected_output_shape)
    assert np.all(np.isfinite(eager))

    # Symbolic call in a functional model with unknown batch and length.
    model = functional_model(layer, inputs, call_kwargs)
    np.testing.assert_allclose(to_numpy(model(inputs)), eager, atol=1e-6, rtol=1e-6)

    # `.keras` save and load.
    if tmp_path is not None:
        path = os.path.join(str(tmp_path), f"{layer_cls.__name__}.keras")
        model.save(path)
        loaded = keras.models.load_model(path)
        np.testing.assert_allclose(
            to_numpy(loaded(inputs)), eager, atol=1e-6, rtol=1e-6
        )

    # jit-compiled predict equals eager.
    model.compile(jit_compile=BACKEND != "torch")
    predicted = model.predict(inputs, verbose=0, batch_size=len(eager))
    np.testing.assert_allclose(predicted, eager, atol=1e-5, rtol=1e-5)

    if mixed_precision:
        for policy in ("mixed_float16", "mixed_bfloat16"):
            check_mixed_precision(layer_cls, init_kwargs, inputs, call_kwargs, policy)
    return eager


def check_mixed_precision(layer_cls, init_kwargs, inputs, call_kwargs, policy):
    """Float32 weights, compute-dtype outputs, finite numbers."""
    layer = layer_cls(**init_kwargs, dtype=policy)
    output = layer(**inputs, **call_kwargs)
    compute_dtype = policy.split("_")[1]
    assert keras.backend.standardize_dtype(output.dtype) == compute_dtype
    for weight in layer.weights:
        if weight.trainable:
            assert keras.backend.standardize_dtype(weight.dtype) == "float32", (
                weight.path
            )
    assert np.all(np.isfinite(to_numpy(keras.ops.cast(output, "float32"))))
