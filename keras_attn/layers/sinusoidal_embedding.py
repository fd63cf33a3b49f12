"""Token embedding plus the fixed sinusoidal position encoding."""

import numbers

import keras
from keras import ops

from keras_attn import ops as attn_ops
from keras_attn.layers._utils import (
    ConfigCheck,
    check_bool,
    check_float,
    check_positive_float,
    check_positive_int,
    check_rank,
    check_width,
    get_keras_object,
)


@keras.saving.register_keras_serializable(package="keras_attn")
class SinusoidalEmbedding(ConfigCheck, keras.layers.Layer):
    """Adds the sinusoidal position encoding of Vaswani et al. (2017).

    `PE(pos, 2i) = sin(pos / max_wavelength**(2i / D))`,
    `PE(pos, 2i + 1) = cos(pos / max_wavelength**(2i / D))`, computed in float32
    and cast to the compute dtype, for any sequence length and any width.

    With `vocabulary_size`, the layer embeds integer token ids (optionally
    scaled by `sqrt(embedding_dim)`, as in the paper) and adds the encoding;
    `mask_zero=True` makes id 0 padding and emits the Keras mask. Without it, the
    layer adds the encoding to float inputs (patches, audio frames, precomputed
    embeddings) and passes any incoming Keras mask through.

    Weights: `embeddings (vocabulary_size, embedding_dim)` with a vocabulary;
    none without.

    Args:
        embedding_dim: int. Output width. Required with `vocabulary_size`;
            without it, defaults to (and must equal) the input width.
        vocabulary_size: int. Number of token ids. `None` for float inputs.
        max_wavelength: float > 0. Longest wavelength of the encoding.
            Defaults to `10000`.
        mask_zero: bool. Treat id 0 as padding and emit a mask. Needs
            `vocabulary_size`. Defaults to `False`.
        scale_embeddings: bool. Multiply token embeddings by
            `sqrt(embedding_dim)` before adding positions. Defaults to `True`.
        embeddings_initializer: initializer of the token embeddings. Defaults to
            a normal distribution with standard deviation `embedding_dim**-0.5`,
            so scaled embeddings have unit variance.
        **kwargs: Base layer arguments (`name`, `dtype`, ...).

    Call arguments:
        inputs: int tensor `(batch, length)` of token ids with `vocabulary_size`,
            float tensor `(batch, length, width)` without.
        start_index: int, scalar int tensor, or int tensor `(batch,)` with one
            start per sequence. Position of the first input, for step-by-step
            decoding (and for left-padded batches, where each sequence's first
            real token should sit at position 0). Defaults to `0`.

    Returns:
        Float tensor `(batch, length, embedding_dim)` in the compute dtype.

    Example:
    >>> embedding = keras_attn.SinusoidalEmbedding(embedding_dim=8,
    ...                                            vocabulary_size=20,
    ...                                            mask_zero=True)
    >>> ids = np.array([[5, 7, 0]])
    >>> tuple(embedding(ids).shape)
    (1, 3, 8)
    >>> keras.ops.convert_to_numpy(embedding.compute_mask(ids)).tolist()
    [[True, True, False]]
    """

    def __init__(
        self,
        embedding_dim=None,
        vocabulary_size=None,
        max_wavelength=10000,
        mask_zero=False,
        scale_embeddings=True,
        embeddings_initializer=None,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.embedding_dim = check_positive_int(
            "embedding_dim", embedding_dim, allow_none=True
        )
        self.vocabulary_size = check_positive_int(
            "vocabulary_size", vocabulary_size, allow_none=True
        )
        self.max_wavelength = check_positive_float("max_wavelength", max_wavelength)
        self.mask_zero = check_bool("mask_zero", mask_zero)
        self.scale_embeddings = check_bool("scale_embeddings", scale_embeddings)
        if self.vocabulary_size is not None and self.embedding_dim is None:
            raise ValueError(
                "`embedding_dim` is required with `vocabulary_size`. Received: "
                f"vocabulary_size={vocabulary_size}, embedding_dim=None."
            )
        if self.vocabulary_size is None and self.mask_zero:
            raise ValueError(
                "`mask_zero=True` needs `vocabulary_size` (token ids); float "
                "inputs keep their incoming Keras mask. "
                f"Received: mask_zero={mask_zero}, vocabulary_size=None."
            )
        if embeddings_initializer is None and self.embedding_dim is not None:
            embeddings_initializer = keras.initializers.RandomNormal(
                stddev=self.embedding_dim**-0.5
            )
        self.embeddings_initializer = get_keras_object(
            "embeddings_initializer",
            keras.initializers.get,
            embeddings_initializer or "uniform",
        )
        self.supports_masking = True

    def build(self, inputs_shape, start_index_shape=None):
        if self.vocabulary_size is None:
            check_rank("inputs", inputs_shape, 3, "(batch, length, width) floats")
            width = inputs_shape[-1]
            if self.embedding_dim is not None and width != self.embedding_dim:
                raise ValueError(
                    "`embedding_dim` must equal the input width for float inputs. "
                    f"Received: embedding_dim={self.embedding_dim}, "
                    f"input width={width}."
                )
            self._width = width
        else:
            check_rank("inputs", inputs_shape, 2, "(batch, length) token ids")
            self._width = self.embedding_dim
            self.embeddings = self.add_weight(
                name="embeddings",
                shape=(self.vocabulary_size, self.embedding_dim),
                initializer=self.embeddings_initializer,
            )
        self.built = True

    def call(self, inputs, start_index=0):
        self._check_inputs(inputs)
        self._check_start_index(start_index, inputs.shape[0])
        length = ops.shape(inputs)[1]
        positions = attn_ops.sinusoidal_position_encoding(
            length,
            self._width,
            max_wavelength=self.max_wavelength,
            start_index=start_index,
            dtype=self.compute_dtype,
        )  # (T, D), or (B, T, D) with one start per sequence
        if self.vocabulary_size is None:
            return inputs + positions
        tokens = ops.take(self.embeddings, inputs, axis=0)  # (B, T, D)
        if self.scale_embeddings:
            tokens = tokens * ops.cast(self.embedding_dim**0.5, tokens.dtype)
        return tokens + positions

    def _check_inputs(self, inputs):
        dtype = keras.backend.standardize_dtype(inputs.dtype)
        if self.vocabulary_size is not None and "int" not in dtype:
            raise TypeError(
                "With `vocabulary_size`, `inputs` must be integer token ids. "
                f"Received: inputs.dtype={dtype}. Cast the ids to int32."
            )
        if self.vocabulary_size is None:
            check_rank("inputs", inputs.shape, 3, "(batch, length, width) floats")
            check_float("inputs", inputs)
            check_width("inputs", inputs.shape, self._width)
        else:
            check_rank("inputs", inputs.shape, 2, "(batch, length) token ids")

    def _check_start_index(self, start_index, batch):
        """An int, or an int tensor: a scalar or one start per sequence."""
        if isinstance(start_index, bool) or not (
            isinstance(start_index, numbers.Integral) or hasattr(start_index, "dtype")
        ):
            raise TypeError(
                "`start_index` must be an int or an int tensor. Received: "
                f"start_index={start_index!r} of type {type(start_index).__name__}."
            )
        if isinstance(start_index, numbers.Integral):
            return
        dtype = keras.backend.standardize_dtype(start_index.dtype)
        if "int" not in dtype:
            raise TypeError(
                "`start_index` must be an int or an int tensor. "
                f"Received: start_index.dtype={dtype}."
            )
        shape = tuple(start_index.shape)
        if len(shape) > 1 or (
            len(shape) == 1 and None not in (shape[0], batch) and shape[0] != batch
        ):
            raise ValueError(
                "`start_index` must be an int, a scalar or a `(batch,)` tensor. "
                f"Received: start_index.shape={shape}, batch={batch}."
            )

    def compute_mask(self, inputs, mask=None):
        if self.vocabulary_size is not None and self.mask_zero:
            return ops.not_equal(inputs, 0)
        return mask

    def compute_output_shape(self, inputs_shape, start_index_shape=None):
        if self.vocabulary_size is None:
            return tuple(inputs_shape)
        return (*inputs_shape, self.embedding_dim)

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "embedding_dim": self.embedding_dim,
                "vocabulary_size": self.vocabulary_size,
                "max_wavelength": self.max_wavelength,
                "mask_zero": self.mask_zero,
                "scale_embeddings": self.scale_embeddings,
                "embeddings_initializer": keras.initializers.serialize(
                    self.embeddings_initializer
                ),
            }
        )
        return config
