"""A decoder block's own self-attention layer (`TransformerDecoder(...,
self_attention=...)`): the argument resolved once, the block options it
would leave unused refused, and a clone named `self_attention` per build."""

from keras_attn.layers._options import AttentionOptions
from keras_attn.layers._sublayer_argument import (
    clone,
    config_of,
    layer_of,
    serialized,
)
from keras_attn.layers.multi_head_latent_attention import MultiHeadLatentAttention

__all__ = ["build", "config_of", "refuse_cross_options", "resolve"]

# Block options only the block's own self-attention reads.
_SELF_ONLY = (
    "rope_max_wavelength",
    "rope_scaling_factor",
    "rope_scaling",
    "sliding_window",
    "attention_sinks",
    "use_sink_logits",
)


def resolve(block, self_attention):
    """The serialized form (a JSON string: no attribute Keras tracks) of
    `self_attention`, a `MultiHeadLatentAttention` or its
    `keras.saving.serialize_keras_object` dict; `None` for `None`."""
    if self_attention is None:
        return None
    text = serialized("self_attention", self_attention, MultiHeadLatentAttention)
    layer = layer_of(text)
    if layer.num_heads != block.num_heads:
        raise ValueError(
            "`num_heads` of the block must be its `self_attention`'s (the "
            "heads of its attention scores). Received: "
            f"num_heads={block.num_heads}, self_attention.num_heads="
            f"{layer.num_heads}."
        )
    _refuse_options(block, _SELF_ONLY, "it carries its own")
    return text


def refuse_cross_options(block):
    """Refuse attention options a decoder-only block with its own
    self-attention leaves unused (with an encoder, cross-attention reads
    them)."""
    names = [n for n in AttentionOptions.names() if n not in (*_SELF_ONLY, "use_bias")]
    given = {"qk_norm_epsilon": block.qk_norm_epsilon}
    given = {name: value for name, value in given.items() if value is not None}
    _refuse_options(block, names, "and this block has no cross-attention", given)


def _refuse_options(block, names, why, given=None):
    defaults = AttentionOptions()
    given = dict(given or {})
    given.update(
        {
            name: getattr(block, name)
            for name in names
            if getattr(block, name) != getattr(defaults, name)
        }
    )
    if given:
        raise ValueError(
            "With `self_attention`, the block's own self-attention options "
            f"would be unused ({why}). Received: "
            + ", ".join(f"{name}={value!r}" for name, value in given.items())
            + ". Set them on the `self_attention` layer, or leave them out."
        )


def build(block, serialized_layer, query_shape):
    """A fresh layer named `self_attention`, of the block's dtype policy."""
    return clone(block, serialized_layer, "self_attention", query_shape)
