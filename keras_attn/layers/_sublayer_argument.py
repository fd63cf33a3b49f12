"""A block argument that is a layer (`feedforward=`, `self_attention=`):
taken as the layer or its `keras.saving.serialize_keras_object` dict, kept
serialized, and cloned under the sublayer's name at each build, so that
each block owns its layer and its config holds the dict."""

import json

import keras


def serialized(argument, value, cls):
    """`value` (a `cls` or its serialized dict) as a JSON string: no
    attribute Keras tracks, and the same layer whatever form was given."""
    layer = value
    if isinstance(value, dict):
        layer = keras.saving.deserialize_keras_object(value)
    if not isinstance(layer, cls):
        raise TypeError(
            f"`{argument}` must be a `keras_attn.layers.{cls.__name__}` or its "
            "serialized dict (`keras.saving.serialize_keras_object`). "
            f"Received: {argument} of type {type(value).__name__}."
        )
    return json.dumps(keras.saving.serialize_keras_object(layer))


def layer_of(serialized_layer):
    """The layer a `serialized` string describes (not built)."""
    return keras.saving.deserialize_keras_object(json.loads(serialized_layer))


def clone(block, serialized_layer, name, shape):
    """A fresh layer of `serialized_layer` named `name`, of the block's dtype
    policy, built for `shape`."""
    template = layer_of(serialized_layer)
    config = {**template.get_config(), "name": name, "dtype": block.dtype_policy}
    layer = type(template).from_config(config)
    layer.build(shape)
    return layer


def config_of(serialized_layer):
    """The config entry: the serialized dict, or `None`."""
    return None if serialized_layer is None else json.loads(serialized_layer)
