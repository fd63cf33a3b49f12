"""keras_attn: attention and Transformer layers for Keras 3.

The same layers, and the same numbers, on TensorFlow, JAX and PyTorch
(`KERAS_BACKEND=tensorflow|jax|torch`).
"""

import keras_attn._keras_compat  # noqa: F401 (first: refuses a Keras too old)
from keras_attn import cache, distribution, generation, models, ops
from keras_attn._version import __version__
from keras_attn.layers import (
    MultiHeadAttention,
    SinusoidalEmbedding,
    TransformerDecoder,
    TransformerEncoder,
)

__all__ = [
    "MultiHeadAttention",
    "SinusoidalEmbedding",
    "TransformerDecoder",
    "TransformerEncoder",
    "cache",
    "distribution",
    "generation",
    "models",
    "ops",
    "__version__",
]
