"""Learned absolute positions (GPT-2's), added to the inputs."""

import keras
import numpy as np
from keras import ops

from keras_attn._checks import (
    check_float,
    check_positive_int,
    check_rank,
    check_size,
    concrete_value,
    get_keras_object,
)
from keras_attn.layers._machinery import ConfigCheck
from keras_attn.ops.positions import position_ids


@keras.saving.register_keras_serializable(package="keras_attn")
class PositionEmbedding(ConfigCheck, keras.layers.Layer):
    """Adds a learned vector per position: `inputs[:, t] + embeddings[start + t]`.

    The position table of GPT-2 and BERT, `(sequence_length, width)`. Unlike
    keras-hub's `PositionEmbedding`, which returns the position vectors alone
    (to be added by the model), this layer returns the sum, as
    `SinusoidalEmbedding` does, so that `keras_attn.generation.generate` can
    run it one token at a time with `start_index`. The input's Keras mask
    passes through.

    Args:
        sequence_length: int > 0. Number of positions the table holds.
        initializer: initializer of the table. Defaults to `"glorot_uniform"`.
        **kwargs: Base layer arguments (`name`, `dtype`, ...).

    Call arguments:
        inputs: float tensor `(batch, length, width)`.
        start_index: int, scalar int tensor, or int tensor `(batch,)` with one
            start per row. Position of the first row. Defaults to `0`.
            Positions below 0 (the left padding of a row whose first real
            token is at position 0, in `generate`) take row 0 of the table.

    A call whose positions run past the table raises a `ValueError` where the
    length and start are known (an int, or an eager tensor); inside compiled
    graphs it is not checked (`generate` checks its `max_length` against the
    table), and the backend's gather decides, as for token ids out of range.

    Example:
    >>> layer = keras_attn.models.PositionEmbedding(sequence_length=8)
    >>> tuple(layer(np.zeros((2, 5, 4), "float32"), start_index=3).shape)
    (2, 5, 4)
    """

    def __init__(self, sequence_length, initializer="glorot_uniform", **kwargs):
        super().__init__(**kwargs)
        self.sequence_length = check_positive_int("sequence_length", sequence_length)
        self.initializer = get_keras_object(
            "initializer", keras.initializers.get, initializer
        )
        self.supports_masking = True

    def build(self, inputs_shape, start_index_shape=None):
        check_rank("inputs", inputs_shape, 3, "(batch, length, width)")
        self.embeddings = self.add_weight(
            name="embeddings",
            shape=(self.sequence_length, inputs_shape[-1]),
            initializer=self.initializer,
        )

    def call(self, inputs, start_index=0):
        self._check_call(inputs, start_index)
        return self.call_unchecked(inputs, start_index)

    def call_unchecked(self, inputs, start_index=0):
        """`call` without its checks, for a caller that checked its arguments
        (`keras_attn.generation.generate`, whose steps read no value back to
        the host)."""
        positions = position_ids(ops.shape(inputs)[1], start_index)  # (T,)|(B, T)
        positions = ops.maximum(positions, 0)
        table = ops.cast(self.embeddings, inputs.dtype)
        return inputs + ops.take(table, positions, axis=0)

    def _check_call(self, inputs, start_index):
        check_rank("inputs", inputs.shape, 3, "(batch, length, width)")
        check_float("inputs", inputs)
        check_size("start_index", start_index, ranks=(0, 1), minimum=None)
        length = inputs.shape[1]
        if isinstance(length, int) and length > self.sequence_length:
            raise ValueError(
                f"`PositionEmbedding` holds {self.sequence_length} positions; "
                f"the inputs have {length}."
            )
        start = concrete_value(start_index)
        if start is None or not isinstance(length, int):  # traced: unchecked
            return
        last = int(np.max(start)) + length - 1
        if last >= self.sequence_length:
            raise ValueError(
                f"`PositionEmbedding` holds {self.sequence_length} positions; "
                f"the call asks for position {last} (start_index={start_index!r}, "
                f"length {length})."
            )

    def compute_output_shape(self, inputs_shape, start_index_shape=None):
        return inputs_shape

    def get_config(self):
        return {
            **super().get_config(),
            "sequence_length": self.sequence_length,
            "initializer": keras.initializers.serialize(self.initializer),
        }
