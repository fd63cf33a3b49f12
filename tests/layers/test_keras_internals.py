"""The Keras internals keras_attn leans on, each held where Keras keeps it:
a Keras release that moves one fails here, not silently elsewhere."""

import keras

import keras_attn
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
