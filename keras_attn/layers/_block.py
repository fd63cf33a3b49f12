"""What the encoder and decoder blocks share: arguments, sublayers, residual wiring."""

import keras
from keras import ops

from keras_attn.layers._utils import (
    ConfigCheck,
    check_bool,
    check_positive_float,
    check_positive_int,
    check_rank,
    check_rate,
    check_width,
    clone_initializer,
    get_keras_object,
)
from keras_attn.layers.multi_head_attention import MultiHeadAttention


class TransformerBlock(ConfigCheck, keras.layers.Layer):
    """Base of `TransformerEncoder` and `TransformerDecoder` (not public).

    Holds the shared arguments and builds the pieces every block has: attention
    sublayers with their layer norms, and the position-wise feed-forward network
    `W_2 activation(W_1 x + b_1) + b_2`. Subclasses write `call` as a flat script
    of `_residual(x, sublayer)` steps.
    """

    def __init__(
        self,
        intermediate_dim,
        num_heads,
        dropout=0.0,
        activation="relu",
        layer_norm_epsilon=1e-5,
        normalize_first=False,
        key_dim=None,
        num_key_value_heads=None,
        kernel_initializer="glorot_uniform",
        bias_initializer="zeros",
        flash_attention=None,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.intermediate_dim = check_positive_int("intermediate_dim", intermediate_dim)
        self.num_heads = check_positive_int("num_heads", num_heads)
        self.dropout = check_rate("dropout", dropout)
        self.activation = get_keras_object(
            "activation", keras.activations.get, activation
        )
        self.layer_norm_epsilon = check_positive_float(
            "layer_norm_epsilon", layer_norm_epsilon
        )
        self.normalize_first = check_bool("normalize_first", normalize_first)
        self.key_dim = check_positive_int("key_dim", key_dim, allow_none=True)
        self.num_key_value_heads = check_positive_int(
            "num_key_value_heads", num_key_value_heads, allow_none=True
        )
        if self.num_key_value_heads and num_heads % self.num_key_value_heads:
            raise ValueError(
                "`num_key_value_heads` must divide `num_heads`. Received: "
                f"num_heads={num_heads}, num_key_value_heads={num_key_value_heads}."
            )
        self.kernel_initializer = get_keras_object(
            "kernel_initializer", keras.initializers.get, kernel_initializer
        )
        self.bias_initializer = get_keras_object(
            "bias_initializer", keras.initializers.get, bias_initializer
        )
        self.flash_attention = check_bool(
            "flash_attention", flash_attention, allow_none=True
        )
        self.supports_masking = True

    def _check_width(self, name, shape):
        check_rank(name, shape, 3, "(batch, length, width)")
        if self.built:
            check_width(name, shape, self.feedforward_output_dense.units)
        width = shape[-1]
        if self.key_dim is None and (width is None or width % self.num_heads):
            raise ValueError(
                "`num_heads` must divide the input width when `key_dim` is not "
                f"given. Received: num_heads={self.num_heads}, input width={width}. "
                "Pass `key_dim` explicitly or choose a divisor of the width."
            )
        return width

    def _build_attention(self, name, query_shape, value_shape=None):
        """An attention sublayer and the layer norm of its residual branch."""
        width = query_shape[-1]
        attention = MultiHeadAttention(
            num_heads=self.num_heads,
            key_dim=self.key_dim or width // self.num_heads,
            num_key_value_heads=self.num_key_value_heads,
            dropout=self.dropout,
            flash_attention=self.flash_attention,
            kernel_initializer=clone_initializer(self.kernel_initializer),
            bias_initializer=clone_initializer(self.bias_initializer),
            dtype=self.dtype_policy,
            name=name,
        )
        attention.build(query_shape, value_shape)
        return attention, self._build_norm(f"{name}_layer_norm", query_shape)

    def _build_norm(self, name, shape):
        norm = keras.layers.LayerNormalization(
            epsilon=self.layer_norm_epsilon, dtype=self.dtype_policy, name=name
        )
        norm.build(shape)
        return norm

    def _build_feedforward(self, shape):
        width = shape[-1]
        self.feedforward_intermediate_dense = self._dense(
            "feedforward_intermediate_dense", self.intermediate_dim, shape
        )
        self.feedforward_output_dense = self._dense(
            "feedforward_output_dense", width, (*shape[:-1], self.intermediate_dim)
        )
        self.feedforward_layer_norm = self._build_norm("feedforward_layer_norm", shape)
        self._dropout_layer = keras.layers.Dropout(
            self.dropout, dtype=self.dtype_policy, name="dropout"
        )

    def _dense(self, name, units, input_shape):
        dense = keras.layers.Dense(
            units,
            kernel_initializer=clone_initializer(self.kernel_initializer),
            bias_initializer=clone_initializer(self.bias_initializer),
            dtype=self.dtype_policy,
            name=name,
        )
        dense.build(input_shape)
        return dense

    def _attention_residual(self, x, attention, norm, training, return_scores, **kw):
        """One attention sublayer with its residual: `(x, scores, cache)`.

        `scores` is `None` unless `return_scores`; `cache` is `None` unless a
        `cache` was passed to the attention.
        """
        hidden = norm(x) if self.normalize_first else x
        outputs = attention(
            hidden, training=training, return_attention_scores=return_scores, **kw
        )
        outputs = tuple(outputs) if isinstance(outputs, tuple | list) else (outputs,)
        scores = outputs[1] if return_scores else None
        cache = outputs[-1] if kw.get("cache") is not None else None
        return self._add_residual(x, outputs[0], norm, training), scores, cache

    def _feedforward_residual(self, x, training):
        """`W_2 activation(W_1 x + b_1) + b_2` with its residual."""
        norm = self.feedforward_layer_norm
        hidden = norm(x) if self.normalize_first else x
        hidden = self.activation(self.feedforward_intermediate_dense(hidden))
        hidden = self._dropout_layer(hidden, training=training)
        output = self.feedforward_output_dense(hidden)
        return self._add_residual(x, output, norm, training)

    def _add_residual(self, x, branch, norm, training):
        """Post-norm `norm(x + drop(branch))` or pre-norm `x + drop(branch)`."""
        x = x + self._dropout_layer(branch, training=training)
        return x if self.normalize_first else norm(x)

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "intermediate_dim": self.intermediate_dim,
                "num_heads": self.num_heads,
                "dropout": self.dropout,
                "activation": keras.activations.serialize(self.activation),
                "layer_norm_epsilon": self.layer_norm_epsilon,
                "normalize_first": self.normalize_first,
                "key_dim": self.key_dim,
                "num_key_value_heads": self.num_key_value_heads,
                "kernel_initializer": keras.initializers.serialize(
                    self.kernel_initializer
                ),
                "bias_initializer": keras.initializers.serialize(self.bias_initializer),
                "flash_attention": self.flash_attention,
            }
        )
        return config


def first_mask(*masks):
    """The first of `masks` that is not `None` (explicit masks come first)."""
    return next((m for m in masks if m is not None), None)


def to_bool(mask):
    return None if mask is None else ops.cast(mask, "bool")
