"""The dtypes attention computes in: logits and softmax at least in float32;
positions and indices in int32."""

import functools

import keras
from keras import ops


def at_least_float32(dtype):
    """float32, or float64 for float64 inputs."""
    return (
        "float64" if keras.backend.standardize_dtype(dtype) == "float64" else "float32"
    )


@functools.cache
def dtype_name(dtype):
    """Keras' name of a dtype (`keras.backend.standardize_dtype`), found once
    per dtype: Keras' function costs microseconds of attribute checks, a
    decoding step asks it dozens of times."""
    return keras.backend.standardize_dtype(dtype)


def cast_to(x, dtype):
    """`x` as a tensor of `dtype` (`keras.ops.cast`): a tensor already of it
    as it is (a no-op cast still costs an op on PyTorch's eager steps)."""
    if not ops.is_tensor(x):
        return ops.convert_to_tensor(x, dtype)
    return x if dtype_name(x.dtype) == dtype_name(dtype) else ops.cast(x, dtype)


def int32(index):
    """An index (a Python int, or an int tensor) as int32: TensorFlow compares
    no int32 positions with an int64 index and takes start indices of one
    dtype."""
    return index if isinstance(index, int) else cast_to(index, "int32")
