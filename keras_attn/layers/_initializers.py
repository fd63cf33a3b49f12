"""Initializers of the attention projections."""

import math

import keras
from keras import ops


@keras.saving.register_keras_serializable(package="keras_attn")
class MatrixInitializer(keras.initializers.Initializer):
    """Draws a projection kernel as the 2-D matrix it multiplies as, then reshapes.

    Keras' variance-scaling initializers read the fans of a rank-3 kernel
    `(width, heads, dim)` as if it were a convolution; attention kernels are
    matrices `(width, heads * dim)` or `(heads * dim, width)`, so they are
    drawn as such.

    Args:
        initializer: the Keras initializer of the matrix.
        fan_in_axes: int. How many leading kernel axes are the matrix's rows.
    """

    def __init__(self, initializer, fan_in_axes=1):
        self.initializer = keras.initializers.get(initializer)
        self.fan_in_axes = fan_in_axes

    def __call__(self, shape, dtype=None):
        rows = math.prod(shape[: self.fan_in_axes])
        matrix = self.initializer((rows, math.prod(shape) // rows), dtype=dtype)
        return ops.reshape(matrix, shape)

    def get_config(self):
        return {
            "initializer": keras.initializers.serialize(self.initializer),
            "fan_in_axes": self.fan_in_axes,
        }
