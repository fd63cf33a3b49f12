"""Activations the converted families use that Keras has no name for."""

import keras


@keras.saving.register_keras_serializable(package="keras_attn")
def gelu_approximate(x):
    """GELU with the tanh approximation (GPT-2, Gemma): saved by name.

    `keras.activations.gelu(x, approximate=True)` as a registered function,
    so a block using it saves to `.keras` and loads back (a
    `functools.partial` does not serialize).

    Example:
    >>> y = keras_attn.models.gelu_approximate(np.array([0.0, 1.0], "float32"))
    >>> [round(float(v), 4) for v in keras.ops.convert_to_numpy(y)]
    [0.0, 0.8412]
    """
    return keras.activations.gelu(x, approximate=True)
