"""A block's own feed-forward layer (`TransformerDecoder(...,
feedforward=...)`, `TransformerEncoder(..., feedforward=...)`): the
argument resolved once, the block options it would leave unused refused,
and a clone named `feedforward` per build (as `_self_attention` does for
`self_attention`)."""

import json

import keras

from keras_attn.layers.mixture_of_experts import MixtureOfExperts


def resolve(block, feedforward, intermediate_dim, gated, use_bias):
    """The serialized form (a JSON string: no attribute Keras tracks) of
    `feedforward`, a `MixtureOfExperts` or its
    `keras.saving.serialize_keras_object` dict; `None` for `None`. Refuses
    the block's own feed-forward options alongside it."""
    if feedforward is None:
        if intermediate_dim is None:
            raise ValueError(
                "`intermediate_dim` is required unless `feedforward` is given. "
                "Received: intermediate_dim=None, feedforward=None."
            )
        return None
    layer = feedforward
    if isinstance(feedforward, dict):
        layer = keras.saving.deserialize_keras_object(feedforward)
    if not isinstance(layer, MixtureOfExperts):
        raise TypeError(
            "`feedforward` must be a `keras_attn.layers.MixtureOfExperts` or "
            "its serialized dict (`keras.saving.serialize_keras_object`). "
            f"Received: feedforward of type {type(feedforward).__name__}."
        )
    given = {"gated_feedforward": gated or None, "use_feedforward_bias": use_bias}
    given = {name: value for name, value in given.items() if value is not None}
    if given:
        raise ValueError(
            "With `feedforward`, the block's own feed-forward options would be "
            "unused (the layer carries its own). Received: "
            + ", ".join(f"{name}={value!r}" for name, value in given.items())
            + ". Set them on the `feedforward` layer, or leave them out."
        )
    return json.dumps(keras.saving.serialize_keras_object(layer))


def build(block, serialized, shape):
    """A fresh layer of `serialized` named `feedforward`, of the block's
    dtype policy, built for `shape`."""
    template = keras.saving.deserialize_keras_object(json.loads(serialized))
    config = {**template.get_config(), "name": "feedforward"}
    config["dtype"] = block.dtype_policy
    layer = type(template).from_config(config)
    layer.build(shape)
    return layer


def config_of(serialized):
    """The `feedforward` config entry: the serialized dict, or `None`."""
    return None if serialized is None else json.loads(serialized)
