"""The backend under test: its name, its devices and kernels, its arrays as
numpy, and its own autodiff."""

import importlib.util

import keras
import numpy as np
import pytest

from tests.helpers.builders import random_floats

BACKEND = keras.backend.backend()
# The module each backend needs: a machine may lack some (the GPU machine has
# no TensorFlow).
BACKEND_MODULES = {"jax": "jax", "tensorflow": "tensorflow", "torch": "torch"}


def installed(module):
    """Whether `module` can be imported on this machine."""
    return importlib.util.find_spec(module) is not None


def require(*modules):
    """Skip the calling test unless every one of `modules` is installed (a
    GPU machine may lack TensorFlow, jax2onnx or tf2onnx)."""
    missing = [module for module in modules if not installed(module)]
    if missing:
        pytest.skip(f"needs {', '.join(missing)}, not installed here")


def installed_backends(*backends):
    """Those of `backends` (default: all three) whose module is installed."""
    backends = backends or tuple(BACKEND_MODULES)
    return tuple(b for b in backends if installed(BACKEND_MODULES[b]))


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


def has_fused_kernel(batch, length, heads, head_dim):
    """Whether the backend has a fused (flash-type) attention kernel for
    bfloat16 self-attention of this shape on its device, asked of the
    backend itself: JAX's cuDNN attention, PyTorch's fused kernels (cuDNN,
    flash, memory-efficient; the flash kernel on a CPU too). TensorFlow has
    none."""
    if BACKEND == "tensorflow":
        return False
    if BACKEND == "jax":
        import jax

        x = jax.numpy.zeros((batch, length, heads, head_dim), "bfloat16")
        try:
            jax.nn.dot_product_attention(x, x, x, implementation="cudnn")
        except Exception:  # noqa: BLE001 - JAX raises several kinds
            return False
        return True
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.zeros(batch, heads, length, head_dim, dtype=torch.bfloat16, device=device)
    fused = [
        SDPBackend.CUDNN_ATTENTION,
        SDPBackend.FLASH_ATTENTION,
        SDPBackend.EFFICIENT_ATTENTION,
    ]
    try:
        with sdpa_kernel(fused):
            torch.nn.functional.scaled_dot_product_attention(x, x, x)
    except RuntimeError:
        return False
    return True


def to_numpy(x):
    return keras.ops.convert_to_numpy(x)


def groups_repeated_here():
    """The plan's rule where Keras computes now, in float32: grouped heads
    repeated on PyTorch on a GPU (`plan._repeat_groups`; an H100 run of the
    suite, 2026-11-28, followed it)."""
    from keras_attn.ops import plan

    platform = plan.platform_of(keras.ops.zeros((1,)))
    return plan._repeat_groups(BACKEND, platform, "float32")


def torch_tensor(x, dtype=None, requires_grad=False):
    """`x` as a torch tensor on the device Keras computes on: a GPU where
    there is one (tests that built theirs on the CPU failed on an H100,
    2026-11-28, beside Keras' weights on `cuda:0`)."""
    import torch

    device = keras.ops.convert_to_tensor(0.0).device
    tensor = torch.as_tensor(np.asarray(x), dtype=dtype, device=device)
    return tensor.requires_grad_(requires_grad)


def flat_numpy(outputs):
    """The outputs of a call (a tensor or a tuple) as a list of numpy arrays."""
    return [to_numpy(x) for x in keras.tree.flatten(outputs)]


def value_and_gradients(fn, *arrays, cotangent=None):
    """`fn(*arrays)` and the gradients of `sum(fn(*arrays) * c)` for a fixed
    random `c` (or `cotangent`, an array of the output's shape), as numpy
    arrays, with the backend's own autodiff."""
    tensors = [keras.ops.convert_to_tensor(x) for x in arrays]
    if cotangent is not None:
        cotangent = keras.ops.convert_to_tensor(cotangent)

    def loss(*xs):
        nonlocal cotangent
        output = fn(*xs)
        if cotangent is None:
            cotangent = keras.ops.convert_to_tensor(
                random_floats(*output.shape, seed=99)
            )
        return keras.ops.sum(output * cotangent), output

    if BACKEND == "jax":
        import jax

        (_, output), grads = jax.value_and_grad(
            loss, argnums=tuple(range(len(tensors))), has_aux=True
        )(*tensors)
    elif BACKEND == "tensorflow":
        import tensorflow as tf

        with tf.GradientTape() as tape:
            tape.watch(tensors)
            total, output = loss(*tensors)
        grads = tape.gradient(total, tensors)
    else:
        tensors = [x.clone().requires_grad_(True) for x in tensors]
        total, output = loss(*tensors)
        total.backward()
        grads = [x.grad for x in tensors]
    detach = getattr(output, "detach", lambda: output)  # torch
    return to_numpy(detach()), [to_numpy(g) for g in grads]


def compiled_value_and_gradients(fn, *arrays, cotangent=None):
    """`fn(*arrays)` and the gradients of `sum(fn(*arrays) * c)`, compiled as
    Keras compiles a train step: `jax.jit`, `tf.function(jit_compile=True)`
    (XLA, Keras' default where TensorFlow sees a GPU), eager on PyTorch.
    `c`: `cotangent`, by default drawn as `value_and_gradients` draws it for
    attention `(B, T, H, Dv)` from the query, keys and values."""
    tensors = [keras.ops.convert_to_tensor(x) for x in arrays]
    if cotangent is None:  # shaped like the attention's output
        shape = (*arrays[0].shape[:-1], arrays[2].shape[-1])
        cotangent = random_floats(*shape, seed=99)
    cotangent = keras.ops.convert_to_tensor(cotangent)

    def loss(*xs):
        output = fn(*xs)
        return keras.ops.sum(output * cotangent), output

    if BACKEND == "jax":
        import jax

        step = jax.value_and_grad(loss, argnums=tuple(range(len(arrays))), has_aux=True)
        (_, output), grads = jax.jit(step)(*tensors)
    elif BACKEND == "tensorflow":
        import tensorflow as tf

        @tf.function(jit_compile=True)
        def step(*xs):
            with tf.GradientTape() as tape:
                tape.watch(xs)
                total, output = loss(*xs)
            return output, tape.gradient(total, xs)

        output, grads = step(*tensors)
    else:
        tensors = [x.clone().requires_grad_(True) for x in tensors]
        total, output = loss(*tensors)
        total.backward()
        output, grads = output.detach(), [x.grad for x in tensors]
    return to_numpy(output), [to_numpy(g) for g in grads]


def programs_compiled(call, caplog):
    """The names of the XLA programs JAX compiles for `call()` (JAX logs
    each: `jax.log_compiles`), with no program of `keras_attn._jax_eager`
    compiled before: `jit(compiled)` for each of its calls."""
    import jax

    from keras_attn import _jax_eager

    _jax_eager.clear()
    caplog.clear()
    with jax.log_compiles(), caplog.at_level("WARNING", logger="jax"):
        call()
    messages = [record.getMessage() for record in caplog.records]
    return [m.split()[-4] for m in messages if m.startswith("Finished XLA")]
