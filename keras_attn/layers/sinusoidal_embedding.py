"""Token embedding plus the fixed sinusoidal position encoding."""

import numbers

import keras
import numpy as np
from keras import ops

from keras_attn._checks import (
    check_bool,
    check_float,
    check_positive_float,
    check_positive_int,
    check_width,
    compiled_by_torch,
    concrete_value,
    get_keras_object,
)
from keras_attn.layers._docs import shared_docs
from keras_attn.layers._lean_call import call_sublayer
from keras_attn.layers._machinery import (
    ConfigCheck,
    clone_initializer,
    dtype_config,
    enable_lora,
    leaf_dtype,
)
from keras_attn.ops.positions import position_ids, sinusoids


@keras.saving.register_keras_serializable(package="keras_attn")
class SinusoidalEmbedding(ConfigCheck, keras.layers.Layer):
    """Adds the sinusoidal position encoding of Vaswani et al. (2017).

    `PE(pos, 2i) = sin(pos / max_wavelength**(2i / D))`,
    `PE(pos, 2i + 1) = cos(pos / max_wavelength**(2i / D))`, computed in float32
    and cast to the compute dtype, for any sequence length and any width.

    With `vocabulary_size`, the layer embeds integer token ids with a
    `keras.layers.Embedding` sublayer, `token_embedding` (so `quantize`,
    `enable_lora` and `DTypePolicyMap` reach it), optionally scales them by
    `sqrt(embedding_dim)` as in the paper, and adds the encoding;
    `mask_zero=True` makes id 0 padding and emits the Keras mask. Float ids
    holding whole numbers are cast to int32, as `keras.layers.Embedding`
    does; a NaN or a fraction is no id (below). Without a
    vocabulary, the layer adds the encoding to float inputs (patches, audio
    frames, precomputed embeddings) and passes any incoming Keras mask
    through; unlike keras-hub's `SinePositionEncoding`, which returns the
    encoding alone, it returns the sum.

    Positions run along the last axis of the ids (`(batch, ..., length)`) or
    the second-to-last axis of float inputs (`(batch, ..., length, width)`).

    All arguments are keyword only, so that `vocabulary_size` and
    `embedding_dim` (both ints) cannot be swapped silently.

    An odd width is the same formula: its last channel is a sine (as
    keras-hub's `SinePositionEncoding`), so no width is refused.

    Token ids outside `[0, vocabulary_size)`, and float ids that are not
    whole numbers (NaN included), raise a `ValueError` in eager calls.
    Where their values cannot be read (compiled graphs: `fit`, `predict`,
    `jit_compile`; and every step of JAX's `fit`, `predict` and `evaluate`,
    where an error would cost the model its weights), the output at such an
    id is a row of NaN, on every backend.

    Args:
        vocabulary_size: int. Number of token ids. `None` for float inputs.
        embedding_dim: int. Output width. Required with `vocabulary_size`;
            without it, defaults to (and must equal) the input width.
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
        inputs: token ids `(batch, length)` with `vocabulary_size` (any rank
            >= 2), float tensor `(batch, length, width)` without (any rank
            >= 3).
        start_index: int, scalar int tensor, or int tensor `(batch,)` with one
            start per sequence. Position of the first input, for step-by-step
            decoding (and for left-padded batches, where each sequence's first
            real token should sit at position 0). Defaults to `0`.

    Returns:
        Float tensor `(batch, ..., length, embedding_dim)` in the compute dtype.

    Example:
    >>> embedding = keras_attn.SinusoidalEmbedding(vocabulary_size=20,
    ...                                            embedding_dim=8,
    ...                                            mask_zero=True)
    >>> ids = np.array([[5, 7, 0]])
    >>> tuple(embedding(ids).shape)
    (1, 3, 8)
    >>> keras.ops.convert_to_numpy(embedding.compute_mask(ids)).tolist()
    [[True, True, False]]
    """

    def __init__(
        self,
        *args,
        vocabulary_size=None,
        embedding_dim=None,
        max_wavelength=10000,
        mask_zero=False,
        scale_embeddings=True,
        embeddings_initializer=None,
        **kwargs,
    ):
        if args:
            raise TypeError(
                "SinusoidalEmbedding takes keyword arguments only, so that "
                "`vocabulary_size` and `embedding_dim` cannot be swapped: "
                "SinusoidalEmbedding(vocabulary_size=..., embedding_dim=...). "
                f"Received positional arguments {args}."
            )
        super().__init__(**kwargs)
        self.vocabulary_size = check_positive_int(
            "vocabulary_size", vocabulary_size, allow_none=True
        )
        self.embedding_dim = check_positive_int(
            "embedding_dim", embedding_dim, allow_none=True
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

    @property
    def embeddings(self):
        """The token table `(vocabulary_size, embedding_dim)` (its int8/int4
        values once quantized)."""
        return self.token_embedding.embeddings

    def build(self, inputs_shape, start_index_shape=None):
        self._width = self._check_shape(inputs_shape)
        if self.vocabulary_size is not None:
            # Exactly `keras.layers.Embedding`: Keras quantizes no subclass.
            self.token_embedding = keras.layers.Embedding(
                self.vocabulary_size,
                self.embedding_dim,
                embeddings_initializer=clone_initializer(self.embeddings_initializer),
                dtype=leaf_dtype(self, "token_embedding"),
                name="token_embedding",
            )
            self.token_embedding.build(inputs_shape)
        self.built = True

    def _check_shape(self, shape):
        """Raise unless `shape` is ids or floats as configured; return the width."""
        if self.vocabulary_size is not None:
            if len(shape) < 2:
                raise ValueError(
                    "`inputs` must have rank 2 or more, (batch, length) token "
                    f"ids. Received: inputs.shape={tuple(shape)}."
                )
            return self.embedding_dim
        if len(shape) < 3:
            raise ValueError(
                "`inputs` must have rank 3 or more, (batch, length, width) floats. "
                f"Received: inputs.shape={tuple(shape)}."
            )
        if self.embedding_dim is not None and shape[-1] != self.embedding_dim:
            raise ValueError(
                "`embedding_dim` must equal the input width for float inputs. "
                f"Received: embedding_dim={self.embedding_dim}, "
                f"input width={shape[-1]}."
            )
        return shape[-1]

    def call(self, inputs, start_index=0):
        self._check_call(inputs, start_index)
        if self.vocabulary_size is None:
            return self.call_unchecked(inputs, start_index)
        ids, valid = _valid_ids(inputs, self.vocabulary_size)
        self._check_token_ids(inputs, valid)
        x = self.call_unchecked(ids, start_index)  # (B, ..., T, D)
        # Where the ids could not be checked (compiled graphs), a bad id's
        # row is NaN on every backend, not whatever its gather returns.
        nan = ops.convert_to_tensor(np.nan, x.dtype)
        return ops.where(ops.expand_dims(valid, -1), x, nan)

    def call_unchecked(self, inputs, start_index=0, table=None, calls=None):
        """`call` without its checks, for a caller that checked its
        arguments (`keras_attn.generation.generate`: the prompt once, its
        own tokens after).

        `table`: the positions' encodings `position_table(length)`, made
        once for a decoding's steps, whose rows are gathered rather than
        computed again (the same numbers); `calls`: how the token table is
        called (a decoding's `SublayerCalls`; by default `call_sublayer`).
        """
        if self.vocabulary_size is None:
            x = inputs
        else:
            x = (calls or call_sublayer)(self.token_embedding, inputs)  # (B, ..., T, D)
            if self.scale_embeddings:
                x = x * ops.convert_to_tensor(self.embedding_dim**0.5, x.dtype)
        length = ops.shape(x)[-2]
        if table is None:
            positions = sinusoids(
                length,
                self._width,
                max_wavelength=self.max_wavelength,
                start_index=start_index,
                dtype=self.compute_dtype,
            )  # (T, D), or (B, T, D) with one start per sequence
        elif length == 1 and len(ops.shape(start_index)) == 1:  # a step: (B, 1, D)
            positions = ops.take(table, start_index, axis=0)[:, None]
        else:
            positions = ops.take(table, position_ids(length, start_index), axis=0)
        if len(positions.shape) == 3:  # (B, 1, ..., T, D) for inputs of rank > 3
            positions = ops.reshape(
                positions, (-1, *[1] * (len(x.shape) - 3), *ops.shape(positions)[1:])
            )
        return x + positions

    def position_table(self, length):
        """The encodings of positions `0, ..., length - 1`, `(length,
        width)` in the compute dtype: `call_unchecked`'s `table`."""
        return sinusoids(
            length, self._width, max_wavelength=self.max_wavelength,
            dtype=self.compute_dtype,
        )  # fmt: skip

    def _check_call(self, inputs, start_index):
        self._check_shape(inputs.shape)
        if self.vocabulary_size is None:
            check_float("inputs", inputs)
            check_width("inputs", inputs.shape, self._width)
        self._check_start_index(start_index, inputs.shape[0])

    def _check_token_ids(self, inputs, valid):
        """Ids in `[0, vocabulary_size)`, float ids whole numbers, checked
        where that is cheap: in eager calls (`valid`: where they are). Traced
        tensors (compiled graphs) have no values to check."""
        if any(dim == 0 for dim in inputs.shape) or compiled_by_torch():
            return
        all_valid = concrete_value(ops.all(valid))
        if all_valid is None or all_valid:
            return
        ids = np.asarray(concrete_value(inputs))
        whole = ids == np.floor(ids)  # NaN is no id, nor is 1.5
        if not np.all(whole):
            raise ValueError(
                "Float token ids must be whole numbers (they are cast to int32, "
                "as `keras.layers.Embedding` casts them). Received: an id of "
                f"{ids[~whole].flat[0]}. Pass int ids."
            )
        raise ValueError(
            "Token ids must be in [0, vocabulary_size) = "
            f"[0, {self.vocabulary_size}). Received ids from "
            f"{_number(ids.min())} to {_number(ids.max())}."
        )

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

    def compute_output_spec(self, inputs, start_index=0):
        self._check_call(inputs, start_index)
        shape = self.compute_output_shape(inputs.shape)
        return keras.KerasTensor(shape, dtype=self.compute_dtype)

    @shared_docs
    def enable_lora(
        self, rank, lora_alpha=None, a_initializer="he_uniform", b_initializer="zeros"
    ):
        """Low-rank adapters (Hu et al. 2021) on the token embeddings.

        Calls `enable_lora` of the `token_embedding` sublayer, whose table is
        then frozen: only the adapters train. Saving merges the adapters into
        the table (Keras' behaviour).

        Args:
            {lora_arguments}

        Example:
        >>> embedding = keras_attn.SinusoidalEmbedding(vocabulary_size=10,
        ...                                            embedding_dim=4)
        >>> _ = embedding(np.array([[1, 2]]))
        >>> embedding.enable_lora(2)
        >>> [w.path.split("/")[-1] for w in embedding.trainable_weights]
        ['lora_embeddings_a', 'lora_embeddings_b']
        """
        if self.vocabulary_size is None:
            raise ValueError(
                f"{self.name} has no weights to adapt: it adds positions to "
                "float inputs. LoRA needs `vocabulary_size` (a token table)."
            )
        targets = [self.token_embedding] if self.built else []
        enable_lora(self, targets, rank, lora_alpha, a_initializer, b_initializer)

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "vocabulary_size": self.vocabulary_size,
                "embedding_dim": self.embedding_dim,
                "max_wavelength": self.max_wavelength,
                "mask_zero": self.mask_zero,
                "scale_embeddings": self.scale_embeddings,
                "embeddings_initializer": keras.initializers.serialize(
                    self.embeddings_initializer
                ),
                "dtype": dtype_config(self),
            }
        )
        return config


def _valid_ids(ids, vocabulary_size):
    """`(int32 ids, valid)`: `valid` where an id is in `[0,
    vocabulary_size)` (a float id also a whole number, so not NaN); the
    others are replaced by 0, which every backend's gather takes."""
    valid = ops.logical_and(ids >= 0, ids < vocabulary_size)
    if "float" in keras.backend.standardize_dtype(ids.dtype):
        valid = ops.logical_and(valid, ops.equal(ids, ops.floor(ids)))
    return ops.cast(ops.where(valid, ids, 0), "int32"), valid


def _number(value):
    value = np.asarray(value).item()
    return int(value) if float(value).is_integer() else value
