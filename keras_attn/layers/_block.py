"""What the encoder and decoder blocks share: arguments, sublayers, residual wiring."""

import keras
from keras import ops

from keras_attn._checks import (
    check_bool,
    check_float,
    check_heads_divide,
    check_one_of,
    check_positive_float,
    check_positive_int,
    check_rank,
    check_rate,
    check_width,
    get_keras_object,
)
from keras_attn.layers import _feedforward, _int8, _lean_call
from keras_attn.layers._attention_call import check_scores_allowed
from keras_attn.layers._docs import shared_docs
from keras_attn.layers._lean_call import activate, call_sublayer
from keras_attn.layers._machinery import (
    ConfigCheck,
    clone_initializer,
    dtype_config,
    enable_lora,
    leaf_dtype,
)
from keras_attn.layers._options import AttentionOptions, bias_switch
from keras_attn.layers.multi_head_attention import MultiHeadAttention


class TransformerBlock(ConfigCheck, keras.layers.Layer):
    """Base of `TransformerEncoder` and `TransformerDecoder` (not public).

    Holds the shared arguments and builds the pieces every block has: attention
    sublayers with their norms, and the position-wise feed-forward network
    `W_2 activation(W_1 x + b_1) + b_2` (or gated, `W_2 (activation(W_g x) *
    W_1 x)`), and with `normalize_sublayer_outputs` a norm of each sublayer's
    output. Subclasses write `call` as a flat script of `_residual(x,
    sublayer)` steps. The arguments keras-hub's blocks have come first, in
    keras-hub's order; keras_attn's own are keyword only.
    """

    # The attention options, keyword only, taken through `**kwargs` (their
    # defaults: `AttentionOptions`).
    keyword_arguments = AttentionOptions.names()

    def __init__(
        self,
        intermediate_dim,
        num_heads,
        dropout=0.0,
        activation="relu",
        layer_norm_epsilon=1e-5,
        kernel_initializer="glorot_uniform",
        bias_initializer="zeros",
        normalize_first=False,
        *,
        normalization="layer_norm",
        gated_feedforward=False,
        normalize_sublayer_outputs=False,
        qk_norm_epsilon=None,
        use_feedforward_bias=None,
        feedforward=None,
        **kwargs,
    ):
        num_heads = check_positive_int("num_heads", num_heads)
        dropout = check_rate("dropout", dropout)
        options = AttentionOptions.take(kwargs, num_heads, dropout)
        super().__init__(**kwargs)
        self.intermediate_dim = check_positive_int(
            "intermediate_dim", intermediate_dim, allow_none=True
        )
        self.num_heads, self.dropout = num_heads, dropout
        self.activation = get_keras_object(
            "activation", keras.activations.get, activation
        )
        self.layer_norm_epsilon = check_positive_float(
            "layer_norm_epsilon", layer_norm_epsilon
        )
        self.kernel_initializer = get_keras_object(
            "kernel_initializer", keras.initializers.get, kernel_initializer
        )
        self.bias_initializer = get_keras_object(
            "bias_initializer", keras.initializers.get, bias_initializer
        )
        self.normalize_first = check_bool("normalize_first", normalize_first)
        self.normalization = check_one_of(
            "normalization", normalization, ("layer_norm", "rms_norm")
        )
        self.gated_feedforward = check_bool("gated_feedforward", gated_feedforward)
        self.normalize_sublayer_outputs = check_bool(
            "normalize_sublayer_outputs", normalize_sublayer_outputs
        )
        self.qk_norm_epsilon = check_positive_float(
            "qk_norm_epsilon", qk_norm_epsilon, allow_none=True
        )
        self.use_feedforward_bias = check_bool(
            "use_feedforward_bias", use_feedforward_bias, allow_none=True
        )
        options.apply(self)
        self._feedforward = _feedforward.resolve(
            self,
            feedforward,
            self.intermediate_dim,
            self.gated_feedforward,
            self.use_feedforward_bias,
        )
        self.supports_masking = True

    def _check_width(self, name, shape):
        check_rank(name, shape, 3, "(batch, length, width)")
        if self.built:
            check_width(name, shape, self._built_width())
        width = shape[-1]
        check_heads_divide(self.num_heads, self.key_dim, width, "input")
        return width

    def _built_width(self):
        """The input width the block was built for."""
        if self.feedforward is not None:
            return self.feedforward.intermediate_kernel.shape[1]
        return self.feedforward_output_dense.units

    def _check_sequence(self, name, tensor, return_attention_scores):
        """The block's input: a float `(batch, length, width)` of the built width."""
        self._check_width(name, tensor.shape)
        check_float(name, tensor)
        check_bool("return_attention_scores", return_attention_scores)
        check_scores_allowed(self.flash_attention, return_attention_scores, "block")

    def _build_attention(
        self, name, query_shape, value_shape=None, window=None, sinks=None
    ):
        """An attention sublayer, the norm of its residual branch and the norm
        of its output (`None` without `normalize_sublayer_outputs`).

        Self-attention (no `value_shape`) gets the rotary positions; both
        kinds get QK-norm and soft-capping. The block checks the tensors it
        passes on, and calls the sublayer's `call_unchecked`.
        """
        width = query_shape[-1]
        options = AttentionOptions.config_of(self)
        options.update(key_dim=self.key_dim or width // self.num_heads)
        options.update(sliding_window=window, attention_sinks=sinks)
        if value_shape is not None:  # keys of another sequence: no positions
            options.update(
                rope_max_wavelength=None, rope_scaling_factor=1.0, rope_scaling=None
            )
            options.update(use_sink_logits=False)  # gpt-oss's, self-attention's
        attention = MultiHeadAttention(
            num_heads=self.num_heads,
            dropout=self.dropout,
            kernel_initializer=clone_initializer(self.kernel_initializer),
            bias_initializer=clone_initializer(self.bias_initializer),
            qk_norm_epsilon=self.qk_norm_epsilon or self.layer_norm_epsilon,
            dtype=self.dtype_policy,
            name=name,
            **options,
        )
        attention.build(query_shape, value_shape)
        norm = self._build_norm(f"{name}_layer_norm", query_shape)
        return attention, norm, self._build_output_norm(name, query_shape)

    def _build_output_norm(self, sublayer, shape):
        """The norm of `sublayer`'s output, `{sublayer}_output_norm`, with
        `normalize_sublayer_outputs`; `None` without."""
        if not self.normalize_sublayer_outputs:
            return None
        return self._build_norm(f"{sublayer}_output_norm", shape)

    def _build_norm(self, name, shape):
        """Keras' `LayerNormalization` (without its offset when `use_bias` is
        False) or `RMSNormalization`, by `normalization`."""
        kwargs = dict(
            epsilon=self.layer_norm_epsilon, dtype=leaf_dtype(self, name), name=name
        )
        if self.normalization == "rms_norm":
            norm = keras.layers.RMSNormalization(**kwargs)
        else:
            norm = keras.layers.LayerNormalization(center=self.use_bias, **kwargs)
        norm.supports_masking = True  # position-wise: the mask holds after it
        norm.build(shape)
        return norm

    def _build_feedforward(self, shape, norm_first):
        """The feed-forward sublayers and the blocks' dropout.

        `norm_first`: whether the layer norm is built (so its weights listed)
        before the matrices: keras-hub's encoder does, its decoder does not.
        In keras-hub's order (the gate between the two matrices, as in
        keras-hub's Llama), `set_weights` moves weights between keras-hub's
        blocks and these; the output norm, if any, comes last.
        """
        if norm_first:
            self.feedforward_layer_norm = self._build_norm(
                "feedforward_layer_norm", shape
            )
        self._build_feedforward_network(shape)
        if not norm_first:
            self.feedforward_layer_norm = self._build_norm(
                "feedforward_layer_norm", shape
            )
        self.feedforward_output_norm = self._build_output_norm("feedforward", shape)
        self._dropout_layer = keras.layers.Dropout(
            self.dropout, dtype=leaf_dtype(self, "dropout"), name="dropout"
        )

    def _build_feedforward_network(self, shape):
        """The feed-forward matrices, or (with `feedforward`) a clone of the
        block's own layer named `feedforward` and no matrices."""
        self.feedforward = None
        if self._feedforward is not None:
            self.feedforward = _feedforward.build(self, self._feedforward, shape)
            self.feedforward_intermediate_dense = None
            self.feedforward_gate_dense = self.feedforward_output_dense = None
            return
        self.feedforward_intermediate_dense = self._dense(
            "feedforward_intermediate_dense", self.intermediate_dim, shape
        )
        self.feedforward_gate_dense = None
        if self.gated_feedforward:
            self.feedforward_gate_dense = self._dense(
                "feedforward_gate_dense", self.intermediate_dim, shape
            )
        self.feedforward_output_dense = self._dense(
            "feedforward_output_dense", shape[-1], (*shape[:-1], self.intermediate_dim)
        )

    def _dense(self, name, units, input_shape):
        """A feed-forward matrix, with a bias by `use_feedforward_bias`
        (`None`: by `use_bias`)."""
        dense = _int8.Dense(
            units,
            use_bias=bias_switch(self.use_feedforward_bias, self.use_bias),
            kernel_initializer=clone_initializer(self.kernel_initializer),
            bias_initializer=clone_initializer(self.bias_initializer),
            dtype=leaf_dtype(self, name),
            name=name,
        )
        dense.build(input_shape)
        return dense

    def _attention_residual(self, x, attention, norms, training, return_scores, **kw):
        """One attention sublayer with its residual: `(x, scores, cache)`.

        `norms`: the sublayer's `(layer_norm, output_norm)` (the output norm
        `None` without `normalize_sublayer_outputs`).

        `scores` is `None` unless `return_scores`; `cache` is `None` unless a
        `cache` was passed to the attention.
        """
        norm, output_norm = norms
        hidden = call_sublayer(norm, x) if self.normalize_first else x
        kw.update(training=training, return_attention_scores=return_scores)
        if _lean_call.lean(attention, hidden, *kw.values()):  # checked by this block
            outputs = attention.call_unchecked(hidden, **kw)
        else:
            outputs = attention(hidden, **kw)
        outputs = tuple(outputs) if isinstance(outputs, tuple | list) else (outputs,)
        scores = outputs[1] if return_scores else None
        cache = outputs[-1] if kw.get("cache") is not None else None
        x = self._add_residual(x, outputs[0], norms, training)
        return x, scores, cache

    def _feedforward_residual(self, x, training, calls=call_sublayer, padding=None):
        """`W_2 activation(W_1 x + b_1) + b_2`, or gated `W_2 (activation(W_g x)
        * W_1 x)` (SwiGLU with silu, GeGLU with gelu), with its residual.
        `calls`: how sublayers are called (`call_sublayer`, or a decoding's
        `SublayerCalls`). With `feedforward`, that layer instead of the
        matrices (in training with the training flag, so that it adds its
        losses, and `padding`, bool `(batch, length)`, so that they and its
        load count real tokens only)."""
        norm = self.feedforward_layer_norm
        hidden = calls(norm, x) if self.normalize_first else x
        if self.feedforward is not None:
            if training:
                output = call_sublayer(
                    self.feedforward, hidden, training=True, mask=padding
                )
            else:
                output = calls(self.feedforward, hidden)
            return self._add_residual(
                x, output, (norm, self.feedforward_output_norm), training, calls
            )
        intermediate = calls(self.feedforward_intermediate_dense, hidden)
        if self.gated_feedforward:
            gate = activate(self.activation, calls(self.feedforward_gate_dense, hidden))
            hidden = gate * intermediate
        else:
            hidden = activate(self.activation, intermediate)
        hidden = self._drop(hidden, training)
        output = calls(self.feedforward_output_dense, hidden)
        return self._add_residual(
            x, output, (norm, self.feedforward_output_norm), training, calls
        )

    def _add_residual(self, x, branch, norms, training, calls=call_sublayer):
        """Post-norm `norm(x + drop(branch))` or pre-norm `x + drop(branch)`,
        `branch` through the output norm first where there is one (Gemma 2's
        post-sublayer norms, before the dropout as in keras-hub's Gemma);
        `norms`: the sublayer's `(norm, output_norm)`."""
        norm, output_norm = norms
        if output_norm is not None:
            branch = calls(output_norm, branch)
        x = x + self._drop(branch, training)
        return x if self.normalize_first else calls(norm, x)

    def _drop(self, x, training):
        """Dropout where it drops something: in training with a rate > 0.

        Elsewhere `Dropout` returns its input, and its call is still a Keras
        layer call, Python that bounds a small block's eager step on
        PyTorch.
        """
        if self.dropout and training:
            return call_sublayer(self._dropout_layer, x, training=training)
        return x

    def _attention_layers(self):
        raise NotImplementedError

    @shared_docs
    def enable_lora(
        self, rank, lora_alpha=None, a_initializer="he_uniform", b_initializer="zeros"
    ):
        """Low-rank adapters (Hu et al. 2021) on every projection; the rest frozen.

        Adapters on the query, key, value, output (and gate) projections of
        every attention sublayer and on both feed-forward matrices; every other
        weight (kernels, biases, layer norms) is frozen, so only the adapters
        train. With a `feedforward` layer (`MixtureOfExperts`, whose experts
        Keras' LoRA does not reach), the adapters are on the attention
        projections only, and the whole feed-forward layer is frozen. Saving
        merges the adapters into the kernels (Keras' behaviour): a reloaded
        model has the same outputs and no adapters.

        Args:
            {lora_arguments}

        Example:
        >>> encoder = keras_attn.TransformerEncoder(intermediate_dim=16, num_heads=2)
        >>> _ = encoder(np.zeros((1, 3, 8)))
        >>> encoder.enable_lora(4)
        >>> len(encoder.trainable_weights)  # an A and a B for 6 kernels
        12
        """
        targets = [t for a in self._attention_layers() for t in a._lora_targets()]
        if self.feedforward is None:
            targets += [
                self.feedforward_intermediate_dense,
                self.feedforward_output_dense,
            ]
            targets += [self.feedforward_gate_dense] if self.gated_feedforward else []
        enable_lora(self, targets, rank, lora_alpha, a_initializer, b_initializer)

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "intermediate_dim": self.intermediate_dim,
                "num_heads": self.num_heads,
                "dropout": self.dropout,
                "activation": keras.activations.serialize(self.activation),
                "layer_norm_epsilon": self.layer_norm_epsilon,
                "kernel_initializer": keras.initializers.serialize(
                    self.kernel_initializer
                ),
                "bias_initializer": keras.initializers.serialize(self.bias_initializer),
                "normalize_first": self.normalize_first,
                "normalization": self.normalization,
                "gated_feedforward": self.gated_feedforward,
                "normalize_sublayer_outputs": self.normalize_sublayer_outputs,
                "qk_norm_epsilon": self.qk_norm_epsilon,
                "use_feedforward_bias": self.use_feedforward_bias,
                "feedforward": _feedforward.config_of(self._feedforward),
                **AttentionOptions.config_of(self),
                "dtype": dtype_config(self),
            }
        )
        return config


def first_mask(*masks):
    """The first of `masks` that is not `None` (explicit masks come first)."""
    return next((m for m in masks if m is not None), None)


def to_bool(mask):
    return None if mask is None else ops.cast(mask, "bool")
