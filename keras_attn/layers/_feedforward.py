"""A block's own feed-forward layer (`TransformerDecoder(...,
feedforward=...)`, `TransformerEncoder(..., feedforward=...)`): the
argument resolved once, the block options it would leave unused refused,
and a clone named `feedforward` per build (as `_self_attention` does for
`self_attention`)."""

from keras_attn.layers._sublayer_argument import clone, config_of, serialized
from keras_attn.layers.mixture_of_experts import MixtureOfExperts

__all__ = ["build", "config_of", "resolve"]


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
    given = {"gated_feedforward": gated or None, "use_feedforward_bias": use_bias}
    given = {name: value for name, value in given.items() if value is not None}
    if given:
        raise ValueError(
            "With `feedforward`, the block's own feed-forward options would be "
            "unused (the layer carries its own). Received: "
            + ", ".join(f"{name}={value!r}" for name, value in given.items())
            + ". Set them on the `feedforward` layer, or leave them out."
        )
    return serialized("feedforward", feedforward, MixtureOfExperts)


def build(block, serialized_layer, shape):
    """A fresh layer named `feedforward`, of the block's dtype policy."""
    return clone(block, serialized_layer, "feedforward", shape)
