"""Models built from keras_attn layers: a decoder-only language model, and
Hugging Face checkpoint folders and keras-hub's language models converted
to it."""

from keras_attn.layers.position_embedding import PositionEmbedding
from keras_attn.models.activations import gelu_approximate
from keras_attn.models.converters import from_keras_hub
from keras_attn.models.decoder_lm import DecoderLMSpec, decoder_lm
from keras_attn.models.hugging_face import (
    Tokenizer,
    from_hugging_face,
    load_tokenizer,
    to_hugging_face,
)

__all__ = [
    "DecoderLMSpec",
    "Tokenizer",
    "PositionEmbedding",
    "decoder_lm",
    "from_hugging_face",
    "from_keras_hub",
    "gelu_approximate",
    "load_tokenizer",
    "to_hugging_face",
]
