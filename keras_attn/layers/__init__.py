"""The public layers of keras_attn, one module each."""

from keras_attn.layers.mixture_of_experts import MixtureOfExperts
from keras_attn.layers.multi_head_attention import MultiHeadAttention
from keras_attn.layers.multi_head_latent_attention import MultiHeadLatentAttention
from keras_attn.layers.position_embedding import PositionEmbedding
from keras_attn.layers.sinusoidal_embedding import SinusoidalEmbedding
from keras_attn.layers.transformer_decoder import TransformerDecoder
from keras_attn.layers.transformer_encoder import TransformerEncoder

__all__ = [
    "MixtureOfExperts",
    "MultiHeadAttention",
    "MultiHeadLatentAttention",
    "PositionEmbedding",
    "SinusoidalEmbedding",
    "TransformerDecoder",
    "TransformerEncoder",
]
