"""keras_attn: attention and Transformer layers for Keras 3.

The same layers, and the same numbers, on TensorFlow, JAX and PyTorch
(`KERAS_BACKEND=tensorflow|jax|torch`).
"""

from keras_attn import distribution, generation, ops
from keras_attn.layers import (
    MultiHeadAttention,
    SinusoidalEmbedding,
    TransformerDecoder,
    TransformerEncoder,
)

__version__ = "0.3.0"

__all__ = [
    "MultiHeadAttention",
    "SinusoidalEmbedding",
    "TransformerDecoder",
    "TransformerEncoder",
    "distribution",
    "generation",
    "ops",
    "__version__",
]
