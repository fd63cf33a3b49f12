"""Models built from keras_attn layers: a decoder-only language model, and
keras-hub's language models converted to it."""

from keras_attn.layers.position_embedding import PositionEmbedding
from keras_attn.models.activations import gelu_approximate
from keras_attn.models.converters import from_keras_hub
from keras_attn.models.decoder_lm import DecoderLMSpec, decoder_lm

__all__ = [
    "DecoderLMSpec",
    "PositionEmbedding",
    "decoder_lm",
    "from_keras_hub",
    "gelu_approximate",
]
