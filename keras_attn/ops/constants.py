"""Constant tensors from Python numbers."""

import keras
from keras import ops

if keras.config.backend() == "torch":
    from keras_attn import _torch_eager as torch_eager
else:
    torch_eager = None


def constant(values, dtype, like):
    """`values`, a list or tuple of Python numbers, as a tensor of `dtype` on
    the device of the tensor `like`: `keras.ops.convert_to_tensor(values,
    dtype)`. On PyTorch that walks the sequence through Keras' tree utilities
    element by element (many times torch's own call, which makes the same
    tensor: `torch_eager.constant`), so there it is torch's own call
    (`benchmarks/results/torch_overhead.md` measured it).

    A sequence rather than a numpy array: a constant that `torch.compile`
    folds, where an array made in the traced function breaks the graph.
    Beside a symbolic `like` (`keras.Input`), Keras' call, which has no device.
    """
    if torch_eager is not None and not isinstance(like, keras.KerasTensor):
        return torch_eager.constant(values, dtype, like)
    return ops.convert_to_tensor(values, dtype=dtype)
