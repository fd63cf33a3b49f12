"""Inputs and models that several test modules build: random arrays and token
ids, a functional model around one layer, and the small models that
generation, training and saving run."""

import keras
import numpy as np

from keras_attn import (
    MultiHeadAttention,
    SinusoidalEmbedding,
    TransformerDecoder,
    TransformerEncoder,
)

# --- Inputs -------------------------------------------------------------------


def random_floats(*shape, seed=0, scale=1.0):
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(
        "float32"
    )


# The arguments each layer cannot do without.
REQUIRED_ARGUMENTS = {
    MultiHeadAttention: {"num_heads": 2},
    TransformerEncoder: {"intermediate_dim": 8, "num_heads": 2},
    TransformerDecoder: {"intermediate_dim": 8, "num_heads": 2},
    SinusoidalEmbedding: {},
}
VOCAB = 11  # vocabulary of the token-id tests, a size no other axis has


def random_ids(*shape, seed=0, high=VOCAB):
    """Int32 token ids in [1, high): no padding."""
    return np.random.default_rng(seed).integers(1, high, shape).astype("int32")


def padded_ids(*shape, seed=0):
    """`random_ids` whose first row is padding (id 0) from its middle on."""
    ids = random_ids(*shape, seed=seed)
    ids[0, shape[1] // 2 :] = 0
    return ids


# --- Models -------------------------------------------------------------------


def functional_model(layer, inputs, call_kwargs=None):
    """Wrap `layer` in a functional model with one `keras.Input` per input array.

    Batch and length are left unknown (None), as users build them.
    """
    symbolic = {}
    for name, array in inputs.items():
        unknown = (None,) * (array.ndim - 1)  # every axis but the batch
        if array.dtype.kind == "f":  # keep the feature width
            unknown = unknown[:-1] + array.shape[-1:]
        symbolic[name] = keras.Input(shape=unknown, dtype=str(array.dtype), name=name)
    outputs = layer(**symbolic, **(call_kwargs or {}))
    return keras.Model(symbolic, outputs)


# The vocabulary and width of the generation tests' models.
GENERATION_VOCAB, GENERATION_WIDTH = 13, 16


def decoder_only_model(vocabulary_size, width, num_key_value_heads=None, seed=0):
    """Two causal decoders on a padding-aware sinusoidal embedding, with a
    Dropout and a LayerNormalization on the way to a Dense head."""
    keras.utils.set_random_seed(seed)
    ids = keras.Input((None,), dtype="int32", name="ids")
    x = SinusoidalEmbedding(
        vocabulary_size=vocabulary_size, embedding_dim=width, mask_zero=True
    )(ids)
    x = TransformerDecoder(32, 4, num_key_value_heads=num_key_value_heads)(x)
    x = keras.layers.Dropout(0.1)(x)
    x = TransformerDecoder(32, 4, normalize_first=True)(x)
    x = keras.layers.LayerNormalization()(x)
    return keras.Model(ids, keras.layers.Dense(vocabulary_size)(x))


def one_decoder_model(vocabulary_size, width, seed=0, head=None):
    """One decoder: `(model, its ids input, its logits tensor)`; `head`, a
    layer, goes after the logits."""
    keras.utils.set_random_seed(seed)
    ids = keras.Input((None,), dtype="int32", name="ids")
    x = SinusoidalEmbedding(
        vocabulary_size=vocabulary_size, embedding_dim=width, mask_zero=True
    )(ids)
    x = TransformerDecoder(32, 4)(x)
    logits = keras.layers.Dense(vocabulary_size)(x)
    return keras.Model(ids, head(logits) if head else logits), ids, logits


def encoder_decoder_model(
    vocabulary_size, width, intermediate_dim=32, num_encoders=1, decoders=({},), seed=0
):
    """A padding-aware sinusoidal embedding of the source, `num_encoders`
    encoders; one of the target, one cross-attending decoder per dict of
    `decoders` (its options); a Dense head. Four heads in every block."""
    keras.utils.set_random_seed(seed)
    source = keras.Input((None,), dtype="int32", name="source")
    target = keras.Input((None,), dtype="int32", name="target")
    x = SinusoidalEmbedding(
        vocabulary_size=vocabulary_size, embedding_dim=width, mask_zero=True
    )(source)
    for _ in range(num_encoders):
        x = TransformerEncoder(intermediate_dim, 4)(x)
    y = SinusoidalEmbedding(
        vocabulary_size=vocabulary_size, embedding_dim=width, mask_zero=True
    )(target)
    for options in decoders:
        y = TransformerDecoder(intermediate_dim, 4, **options)(y, x)
    return keras.Model([source, target], keras.layers.Dense(vocabulary_size)(y))


def llama_model(
    vocabulary_size,
    width,
    intermediate_dim=32,
    windows=(3, None),
    tied=True,
    seed=0,
    **options,
):
    """Today's decoder-only family: Keras' `ReversibleEmbedding` (no
    positions), one LLaMA-style decoder per entry of `windows` (its sliding
    window, or None): RoPE, grouped-query attention, RMSNorm, SwiGLU, no
    biases, and `options`; Keras' RMSNorm; the tied embedding as head, or a
    Dense one."""
    keras.utils.set_random_seed(seed)
    ids = keras.Input((None,), dtype="int32", name="ids")
    embedding = keras.layers.ReversibleEmbedding(vocabulary_size, width, mask_zero=True)
    x = embedding(ids)
    for window in windows:
        x = TransformerDecoder(
            intermediate_dim,
            4,
            activation="silu",
            normalize_first=True,
            num_key_value_heads=2,
            normalization="rms_norm",
            gated_feedforward=True,
            use_bias=False,
            rope_max_wavelength=10000.0,
            sliding_window=window,
            **options,
        )(x)
    x = keras.layers.RMSNormalization()(x)
    head = embedding if tied else keras.layers.Dense(vocabulary_size, name="head")
    return keras.Model(ids, head(x, reverse=True) if tied else head(x))
