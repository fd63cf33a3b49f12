"""A decoder-only language model from keras_attn blocks: token ids to logits."""

import dataclasses

import keras

from keras_attn.layers import TransformerDecoder
from keras_attn.layers.position_embedding import PositionEmbedding


@dataclasses.dataclass(frozen=True)
class DecoderLMSpec:
    """Everything `decoder_lm` builds, read from a config (never guessed).

    Attributes:
        vocabulary_size: int. Rows of the token table.
        hidden_dim: int. Width of the residual stream.
        blocks: one dict of `TransformerDecoder` arguments per block.
        normalization: the final norm, `"layer_norm"` or `"rms_norm"`.
        layer_norm_epsilon: the final norm's epsilon.
        use_bias: whether the final layer norm has an offset.
        tie_weights: whether the output head is the token table, transposed
            (else `ReversibleEmbedding` holds a head matrix of its own).
        positions: learned positions `PositionEmbedding(positions)` (GPT-2),
            or None (rotary positions in the blocks).
        embedding_scale: the token vectors are multiplied by it (Gemma's
            `sqrt(hidden_dim)`), or None.
        final_logit_soft_cap: `cap * tanh(logits / cap)` on the logits
            (Gemma 2), or None.
        dropout: dropout on the embeddings (GPT-2).
        dtype: the model's dtype policy.
    """

    vocabulary_size: int
    hidden_dim: int
    blocks: tuple
    normalization: str = "rms_norm"
    layer_norm_epsilon: float = 1e-6
    use_bias: bool = False
    tie_weights: bool = True
    positions: int | None = None
    embedding_scale: float | None = None
    final_logit_soft_cap: float | None = None
    dropout: float = 0.0
    dtype: object = None


def decoder_lm(spec, name="decoder_lm"):
    """The functional `keras.Model` of `spec`: int token ids `(batch, length)`
    to float logits `(batch, length, vocabulary_size)`, which
    `keras_attn.generation.generate` decodes with caches.

    Layers, by name: `token_embedding` (Keras' `ReversibleEmbedding`, also
    the head), `embedding_scale` (a `Rescaling`), `position_embedding`,
    `embedding_dropout`, `transformer_layer_{i}`, `final_norm`; those a spec
    does not ask for are left out.

    Example:
    >>> block = dict(intermediate_dim=32, num_heads=2, normalize_first=True,
    ...              rope_max_wavelength=10000.0)
    >>> spec = keras_attn.models.DecoderLMSpec(
    ...     vocabulary_size=50, hidden_dim=16, blocks=(block, block))
    >>> model = keras_attn.models.decoder_lm(spec)
    >>> tuple(model(np.array([[1, 2, 3]])).shape)
    (1, 3, 50)
    """
    dtype = spec.dtype
    token_ids = keras.Input((None,), dtype="int32", name="token_ids")
    embedding = keras.layers.ReversibleEmbedding(
        spec.vocabulary_size,
        spec.hidden_dim,
        tie_weights=spec.tie_weights,
        logit_soft_cap=spec.final_logit_soft_cap,
        dtype=dtype,
        name="token_embedding",
    )
    x = embedding(token_ids)
    if spec.embedding_scale is not None:
        x = keras.layers.Rescaling(
            spec.embedding_scale, dtype=dtype, name="embedding_scale"
        )(x)
    if spec.positions is not None:
        x = PositionEmbedding(spec.positions, dtype=dtype, name="position_embedding")(x)
    if spec.dropout:
        x = keras.layers.Dropout(spec.dropout, dtype=dtype, name="embedding_dropout")(x)
    for i, block in enumerate(spec.blocks):
        x = TransformerDecoder(**block, dtype=dtype, name=f"transformer_layer_{i}")(x)
    x = _final_norm(spec)(x)
    return keras.Model(token_ids, embedding(x, reverse=True), name=name)


def _final_norm(spec):
    if spec.normalization == "rms_norm":
        return keras.layers.RMSNormalization(
            epsilon=spec.layer_norm_epsilon, dtype=spec.dtype, name="final_norm"
        )
    return keras.layers.LayerNormalization(
        epsilon=spec.layer_norm_epsilon,
        center=spec.use_bias,
        dtype=spec.dtype,
        name="final_norm",
    )


# Layers `decoder_lm` builds besides the blocks, by name.
_PARTS = (
    "token_ids",
    "token_embedding",
    "embedding_scale",
    "position_embedding",
    "embedding_dropout",
    "final_norm",
)


def spec_of(model):
    """The `DecoderLMSpec` a model built by `decoder_lm` was built from, read
    from its layers; a `ValueError` for a model of another shape."""
    names = [layer.name for layer in model.layers]
    blocks = [n for n in names if n.startswith("transformer_layer_")]
    others = [n for n in names if n not in _PARTS and n not in blocks]
    if others or "token_embedding" not in names or "final_norm" not in names:
        raise ValueError(
            "`model` must be a language model `keras_attn.models.decoder_lm` "
            "builds (`from_hugging_face` and `from_keras_hub` return one). "
            f"Received a model with the layers {names}."
        )
    embedding, norm = model.get_layer("token_embedding"), model.get_layer("final_norm")
    optional = {n: model.get_layer(n) for n in _PARTS[2:5] if n in names}
    rms = isinstance(norm, keras.layers.RMSNormalization)
    return DecoderLMSpec(
        vocabulary_size=embedding.input_dim,
        hidden_dim=embedding.output_dim,
        blocks=tuple(_block_arguments(model.get_layer(n)) for n in blocks),
        normalization="rms_norm" if rms else "layer_norm",
        layer_norm_epsilon=norm.epsilon,
        use_bias=False if rms else norm.center,
        tie_weights=embedding.tie_weights,
        positions=_get(optional, "position_embedding", "sequence_length"),
        embedding_scale=_get(optional, "embedding_scale", "scale"),
        final_logit_soft_cap=embedding.logit_soft_cap,
        dropout=_get(optional, "embedding_dropout", "rate") or 0.0,
        dtype=embedding.dtype_policy.name,  # the layers' (a Model keeps the global)
    )


def _block_arguments(block):
    """A block's arguments as `decoder_lm` takes them (its config without
    the base layer's entries)."""
    config = block.get_config()
    for key in ("name", "trainable", "dtype"):
        config.pop(key, None)
    return config


def _get(layers, name, attribute):
    return getattr(layers[name], attribute) if name in layers else None
