"""The dtypes attention computes in: logits and softmax at least in float32."""

import keras


def at_least_float32(dtype):
    """float32, or float64 for float64 inputs."""
    return (
        "float64" if keras.backend.standardize_dtype(dtype) == "float64" else "float32"
    )
