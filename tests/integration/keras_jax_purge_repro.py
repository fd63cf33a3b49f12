"""Keras' JAX trainer loses a model's weights when a step raises (Keras
3.15.1; the README's known limits). Not a test: run it by hand,

    KERAS_BACKEND=jax python tests/integration/keras_jax_purge_repro.py

It prints "raised ValueError", then fails with `TypeError: 'NoneType' object
is not callable`: `predict` set every variable's value to None before its loop
(`_get_jax_state(..., purge_model_variables=True)`) and the error skipped the
`jax_state_sync()` that restores them.
"""

import keras
import numpy as np


class Refuse(keras.layers.Layer):
    """Raises on negative inputs where it can read them, as a check at a door."""

    def call(self, x):
        try:
            negative = np.any(keras.ops.convert_to_numpy(x) < 0)
        except Exception:  # a tracer while Keras infers the output shape
            negative = False
        if negative:
            raise ValueError("negative input")
        return x


if __name__ == "__main__":
    inputs = keras.Input((2,))
    model = keras.Model(inputs, keras.layers.Dense(2)(Refuse()(inputs)))
    model.compile(jit_compile=False)
    model.predict(np.ones((1, 2)), verbose=0)  # works
    try:
        model.predict(-np.ones((1, 2)), verbose=0)  # raises, as it should
    except ValueError:
        print("raised ValueError")
    model.predict(np.ones((1, 2)), verbose=0)  # TypeError on JAX
