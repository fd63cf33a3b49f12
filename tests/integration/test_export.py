"""`model.export(...)` of a model built from every keras_attn layer.

Each exported artifact is loaded with its own runtime (TensorFlow, ONNX
Runtime, LiteRT, `torch.export`) and compared with `model.predict`, on inputs
of several shapes with padding and a fully padded row. Where Keras itself
cannot export on this backend, the test pins Keras' error (listed in the
README): it fails, and so asks for the README to be updated, when a Keras
release changes that. On PyTorch, the same model trains under
`jit_compile=True` (`torch.compile`) without a graph break in our code.
"""

import functools
import logging
import os

import keras
import numpy as np
import pytest

import keras_attn
from tests.helpers.backend import (
    BACKEND,
    groups_repeated_here,
    require,
    to_numpy,
    torch_tensor,
)

VOCAB = 50
DYNAMIC = [keras.InputSpec(shape=(None, None), dtype="int32", name="token_ids")]
FIXED = [keras.InputSpec(shape=(2, 8), dtype="int32", name="token_ids")]


def every_layer_model():
    ids = keras.Input((None,), dtype="int32", name="token_ids")
    x = keras_attn.SinusoidalEmbedding(
        vocabulary_size=VOCAB, embedding_dim=16, mask_zero=True
    )(ids)
    encoded = keras_attn.TransformerEncoder(32, 4, num_key_value_heads=2)(x)
    x = keras_attn.TransformerDecoder(32, 4, use_gate=True)(x, encoded)
    x = keras_attn.MultiHeadAttention(2, sliding_window=3)(x, use_causal_mask=True)
    return keras.Model(ids, keras.layers.Dense(VOCAB)(x))


def token_ids(shape, seed):
    ids = np.random.default_rng(seed).integers(1, VOCAB, shape).astype("int32")
    ids[0, shape[1] // 2 :] = 0  # right padding
    if shape[0] > 1:
        ids[-1] = 0  # a row of padding only
    return ids


@pytest.fixture(scope="module")
def model():
    keras.utils.set_random_seed(0)
    return every_layer_model()


def run_tf_saved_model(path):
    import tensorflow as tf

    artifact = tf.saved_model.load(path)
    return lambda ids: artifact.serve(tf.constant(ids)).numpy()


def run_onnx(path):
    import onnxruntime

    session = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    return lambda ids: session.run(None, {name: ids})[0]


def run_litert(path):
    from ai_edge_litert.interpreter import Interpreter

    def run(ids):
        interpreter = Interpreter(model_path=path)
        (tensor,) = interpreter.get_input_details()
        interpreter.resize_tensor_input(tensor["index"], ids.shape)
        interpreter.allocate_tensors()
        interpreter.set_tensor(tensor["index"], ids)
        interpreter.invoke()
        return interpreter.get_tensor(interpreter.get_output_details()[0]["index"])

    return run


def run_torch(path):
    import torch

    program = torch.export.load(path).module()
    return lambda ids: to_numpy(program(torch_tensor(ids)).detach())


RUNNERS = {
    "tf_saved_model": ("", run_tf_saved_model),
    "onnx": (".onnx", run_onnx),
    "litert": (".tflite", run_litert),
    "torch": (".pt2", run_torch),
}

# What works, per backend: format -> the input signatures it exports with.
WORKS = {
    "tensorflow": {"tf_saved_model": DYNAMIC, "onnx": DYNAMIC, "litert": DYNAMIC},
    "jax": {"tf_saved_model": DYNAMIC, "onnx": FIXED},
    "torch": {"onnx": FIXED, "torch": DYNAMIC},
}


# The modules each format needs beyond the backend (a GPU machine may lack
# TensorFlow and the ONNX converters: the test is skipped there).
NEEDS = {
    "tf_saved_model": ("tensorflow",),
    "onnx": {
        "tensorflow": ("tf2onnx", "onnxruntime"),
        "jax": ("jax2onnx", "onnxruntime"),
        "torch": ("onnxscript", "onnxruntime"),
    }[BACKEND],
    "litert": ("tensorflow", "ai_edge_litert"),
    "torch": (),
}


def export_kwargs(format, signature):
    kwargs = {"format": format, "verbose": False, "input_signature": signature}
    if format == "torch":  # torch.export pins unknown dims to 1 without these
        from torch.export import Dim

        kwargs["dynamic_shapes"] = {0: Dim("batch", max=64), 1: Dim("length", max=512)}
    return kwargs


@pytest.mark.parametrize("format", sorted(WORKS[BACKEND]))
def test_exported_artifact_gives_predicts_outputs(model, format, tmp_path):
    require(*NEEDS[format])
    signature = WORKS[BACKEND][format]
    suffix, runner = RUNNERS[format]
    path = str(tmp_path / f"model{suffix}")
    model.export(path, **export_kwargs(format, signature))
    run = runner(path)
    shapes = [(2, 8)] if signature is FIXED else [(2, 8), (3, 11), (1, 5)]
    for seed, shape in enumerate(shapes):
        ids = token_ids(shape, seed)
        expected = model.predict(ids, verbose=0)
        np.testing.assert_allclose(run(ids), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(BACKEND != "torch", reason="torch.export's kernel guards")
def test_torch_export_of_dynamic_lengths_traces_the_composite_kernel(
    model, tmp_path, monkeypatch
):
    """The fused kernels' shape checks leave guards that fail dynamic lengths
    on CUDA (`min(4*L, 8*L) != 16*L`, FINDINGS.md section 1): while exporting
    them, only torch's composite kernel is enabled; a plain call is not
    pinned."""
    import torch
    from torch.nn import functional

    original, enabled = functional.scaled_dot_product_attention, []

    def spy(*args, **kwargs):
        backends = torch.backends.cuda
        fused = (backends.flash_sdp_enabled(), backends.mem_efficient_sdp_enabled())
        enabled.append((torch.compiler.is_exporting(), any(fused)))
        return original(*args, **kwargs)

    monkeypatch.setattr(functional, "scaled_dot_product_attention", spy)
    model.export(str(tmp_path / "model.pt2"), **export_kwargs("torch", DYNAMIC))
    model(token_ids((2, 8), 0))
    assert (True, False) in enabled and (True, True) not in enabled
    assert (False, True) in enabled


# Keras' own limits (keras.layers.MultiHeadAttention and keras-hub's layers
# share them): (backend, format, signature) -> (error, message).
REFUSED = {
    **{
        (backend, "torch", "dynamic"): (ValueError, "requires PyTorch backend")
        for backend in ("tensorflow", "jax")
    },
    ("jax", "litert", "dynamic"): (
        ValueError,
        "LiteRT export requires TensorFlow or PyTorch backend",
    ),
    ("jax", "onnx", "dynamic"): (ValueError, "Incompatible shapes for broadcasting"),
    ("torch", "tf_saved_model", "dynamic"): (
        RuntimeError,
        "Detected mismatch between the structure of `inputs` and `dynamic_shapes`",
    ),
    # TorchScript's ONNX exporter (dynamic shapes): Keras' MultiHeadAttention
    # fails on "a node"; ours first on torch's own `enable_gqa` argument.
    ("torch", "onnx", "dynamic"): (
        AssertionError,
        "scaled_dot_product_attention not implemented if enable_gqa is True",
    ),
    ("torch", "litert", "dynamic"): (ImportError, "litert-torch"),
}


@pytest.mark.parametrize(
    "format, signature",
    [(f, s) for b, f, s in REFUSED if b == BACKEND],
)
def test_keras_cannot_export_this_yet(model, format, signature, tmp_path):
    if format != "litert":  # its refusal on torch is the missing package
        require(*NEEDS[format])
    error, message = REFUSED[(BACKEND, format, signature)]
    if (BACKEND, format) == ("torch", "onnx") and groups_repeated_here():
        # No `enable_gqa` to fail on (a GPU in float32): the exporter fails on
        # a node, as for Keras' own layer (an H100, 2026-11-28).
        error, message = RuntimeError, "Failed to export a node"
    suffix, _ = RUNNERS[format]
    path = str(tmp_path / f"model{suffix}")
    with pytest.raises(error, match=message):
        model.export(path, **export_kwargs(format, DYNAMIC))


class DynamoLog(logging.Handler):
    """Collects `torch.compile`'s graph-break and recompile log records."""

    def __init__(self):
        super().__init__()
        self.breaks, self.recompiles = [], []

    def emit(self, record):
        kind = record.name.rsplit(".", 1)[-1]
        if kind == "__graph_breaks":
            self.breaks.append(record.getMessage())
        elif kind == "__recompiles":
            self.recompiles.append(record.getMessage())


@pytest.fixture
def dynamo_log(monkeypatch):
    """`torch.compile` traced by dynamo only (graph breaks and recompiles are
    dynamo's; the "eager" backend skips minutes of C++ compilation), logged."""
    import torch

    compile_ = functools.partial(torch.compile, backend="eager")
    monkeypatch.setattr(torch, "compile", compile_)
    torch._dynamo.reset()
    torch._logging.set_logs(graph_breaks=True, recompiles=True)
    log, dynamo_logger = DynamoLog(), logging.getLogger("torch._dynamo")
    dynamo_logger.addHandler(log)
    yield log
    dynamo_logger.removeHandler(log)
    torch._logging.set_logs()
    torch._dynamo.reset()


@pytest.mark.skipif(BACKEND != "torch", reason="torch.compile is PyTorch's")
def test_compiled_training_breaks_no_graph_in_our_code(dynamo_log):
    """`fit` with `jit_compile=True`: no graph break passes through keras_attn
    (a Keras padding mask, causal self-attention, cross-attention), and the
    second epoch compiles nothing.

    One eager step first: Keras' compiled step recompiles once when the
    gradients stop being `None` (README); that retrace would double the
    test's time and says nothing about our layers.
    """
    ids = keras.Input((None,), dtype="int32")
    x = keras.layers.Embedding(VOCAB, 8, mask_zero=True)(ids)
    x = keras_attn.TransformerDecoder(16, 2)(x, x)
    model = keras.Model(ids, keras.layers.Dense(VOCAB)(x))
    inputs = token_ids((8, 8), seed=5)
    targets = np.random.default_rng(5).standard_normal((8, 8, VOCAB), "float32")
    model.compile(optimizer="adam", loss="mse", jit_compile=False)
    model.train_on_batch(inputs[:4], targets[:4])
    model.compile(optimizer="adam", loss="mse", jit_compile=True)
    seen = []
    mark = keras.callbacks.LambdaCallback(
        on_epoch_end=lambda epoch, logs: seen.append(len(dynamo_log.recompiles))
    )
    model.fit(inputs, targets, batch_size=4, epochs=2, callbacks=[mark], verbose=0)
    package = os.path.dirname(keras_attn.__file__)
    assert not [b for b in dynamo_log.breaks if package in b]
    assert seen[1] == seen[0], dynamo_log.recompiles[seen[0] :]
    # Keras' own break (README): its train step calls `loss.backward()`.
    assert any("Tensor.backward()" in b for b in dynamo_log.breaks)
