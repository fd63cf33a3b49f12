"""The Keras internals keras_attn leans on, each held where Keras keeps it:
a Keras release that moves one fails here, not silently elsewhere."""

import keras
import numpy as np

import keras_attn
from keras_attn._checks import in_keras_step
from keras_attn.layers._machinery import all_layers


def test_all_layers_walks_nested_layers_once():
    block = keras_attn.TransformerDecoder(intermediate_dim=8, num_heads=2)
    inputs = keras.Input((3, 4))
    model = keras.Model(inputs, keras.layers.Dense(4, name="head")(block(inputs)))
    names = [layer.name for layer in all_layers(model)]
    assert "head" in names and block.name in names
    assert "query" in names and "feedforward_output_dense" in names
    assert len(names) == len(set(map(id, all_layers(model))))
    assert model.name not in names


class _Records(keras.layers.Layer):
    """Records, at each call, whether it runs in a Keras stateless scope."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seen = []

    def call(self, x):
        self.seen.append(in_keras_step())
        return x


def test_jax_trainer_steps_run_in_the_stateless_scope_checks_read_no_values_in():
    """`concrete_value` reads nothing where `in_keras_step()`: JAX's trainer
    takes the weights out of the variables around its steps (Keras 3.15),
    so an error raised in one would lose them."""
    records = _Records()
    inputs = keras.Input((2,))
    model = keras.Model(inputs, keras.layers.Dense(2)(records(inputs)))
    model.compile(jit_compile=False)
    records.seen.clear()
    model(np.ones((1, 2), "float32"))
    model.predict(np.ones((1, 2), "float32"), verbose=0)
    eager, *steps = records.seen
    assert not eager
    assert steps and all(steps) == (keras.config.backend() == "jax")
