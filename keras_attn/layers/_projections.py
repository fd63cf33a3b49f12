"""The attention projections on Keras' `EinsumDense` (W_Q, W_K, W_V, the gate
and W_O; int8 contractions padded for XLA, `_int8`), the per-head QK-norms and
the sink logits, built for a `MultiHeadAttention`; the heads they make,
rotated by RoPE."""

import keras

from keras_attn.layers import _int8
from keras_attn.layers._initializers import MatrixInitializer
from keras_attn.layers._lean_call import call_sublayer
from keras_attn.layers._machinery import clone_initializer, leaf_dtype
from keras_attn.layers._options import bias_switch
from keras_attn.ops.positions import rotate


def head_norm(layer, name):
    """RMSNorm over each head's channels (QK-norm, as in Gemma 3)."""
    norm = keras.layers.RMSNormalization(
        epsilon=layer.qk_norm_epsilon, dtype=leaf_dtype(layer, name), name=name
    )
    norm.supports_masking = True  # per position, as the projections
    norm.build((None, None, None, layer._head_dim))
    return norm


def build_sublayers(layer, query_width, key_width, value_width):
    """`layer`'s projections, QK-norms and attention dropout, built, in
    Keras' order (query, key, gate, value, output: the same weight list)."""
    heads, kv_heads = layer.num_heads, layer._kv_heads
    layer.query_dense = projection(layer, "query", query_width, heads, layer._head_dim)
    layer.key_dense = projection(layer, "key", key_width, kv_heads, layer._head_dim)
    layer.gate_dense = None
    if layer.use_gate:
        layer.gate_dense = projection(
            layer, "gate", query_width, heads, layer._value_head_dim, "sigmoid"
        )
    layer.value_dense = projection(
        layer, "value", value_width, kv_heads, layer._value_head_dim
    )
    layer.output_dense = output_projection(layer, query_width)
    layer.query_norm = layer.key_norm = None
    if layer.normalize_qk:  # after Keras' sublayers: the same weights first
        layer.query_norm = head_norm(layer, "query_norm")
        layer.key_norm = head_norm(layer, "key_norm")
    layer._attention_dropout = keras.layers.Dropout(
        layer.dropout,
        seed=layer.seed,
        dtype=leaf_dtype(layer, "dropout"),
        name="dropout",
    )
    layer.sink_logits = sink_weight(layer) if layer.use_sink_logits else None


def sink_weight(layer):
    """gpt-oss's learned sink logit per query head, `sink_logits`
    `(num_heads,)`, zeros (each sink starts as one more key of logit 0), in
    the layer's variable dtype; converters map gpt-oss's `self_attn.sinks`
    to it by that name. Not a projection: quantization and LoRA leave it as
    it is (LoRA freezes it with the other weights)."""
    return layer.add_weight(
        name="sink_logits",
        shape=(layer.num_heads,),
        initializer="zeros",
        dtype=layer.variable_dtype,
    )


def _sublayer_kwargs(layer, name):
    return dict(
        kernel_initializer=MatrixInitializer(
            clone_initializer(layer.kernel_initializer),
            fan_in_axes=2 if name == "attention_output" else 1,
        ),
        bias_initializer=clone_initializer(layer.bias_initializer),
        kernel_regularizer=layer.kernel_regularizer,
        bias_regularizer=layer.bias_regularizer,
        kernel_constraint=layer.kernel_constraint,
        bias_constraint=layer.bias_constraint,
        dtype=leaf_dtype(layer, name),
        name=name,
    )


def projection(layer, name, width, heads, dim, activation=None):
    """`EinsumDense` `(B, T, width)` -> `(B, T, heads, dim)`.

    (The letters sort the contracted axes in memory order: `jnp.einsum`
    orders them alphabetically, and any other order makes XLA transpose
    the kernels and their gradients.)
    """
    dense = _int8.EinsumDense(
        "abc,cde->abde",
        output_shape=(None, heads, dim),
        bias_axes="de" if layer.use_bias else None,
        activation=activation,
        **_sublayer_kwargs(layer, name),
    )
    # Position-wise: a padding mask holds for the outputs as for the inputs
    # (and Keras warns that a masked input would lose its mask otherwise).
    dense.supports_masking = True
    dense.build((None, None, width))
    return dense


def output_projection(layer, query_width):
    """`EinsumDense` W_O: `(B, T, H, Dv)` -> `(B, T, *output_shape)`, with a
    bias by `use_output_bias` (`None`: by `use_bias`)."""
    output_shape = layer._output_shape or (query_width,)
    letters = "efghijklmnopqrstuvwxyz"[: len(output_shape)]
    use_bias = bias_switch(layer.use_output_bias, layer.use_bias)
    dense = _int8.EinsumDense(
        f"abcd,cd{letters}->ab{letters}",
        output_shape=(None, *output_shape),
        bias_axes=letters if use_bias else None,
        **_sublayer_kwargs(layer, "attention_output"),
    )
    dense.supports_masking = True  # position-wise, as the projections
    dense.build((None, None, layer.num_heads, layer._value_head_dim))
    return dense


def heads(layer, kind, x, positions, calls=call_sublayer):
    """`layer`'s queries or keys (`kind`: `"query"` or `"key"`) of `x`,
    `(B, T, heads, D)`: projected, RMS-normalized per head with
    `normalize_qk`, then rotated to `positions` with RoPE (none: `None`)."""
    x = project(getattr(layer, f"{kind}_dense"), x, calls)
    norm = getattr(layer, f"{kind}_norm")
    if norm is not None:
        x = calls(norm, x)
    if positions is None:
        return x
    return rotate(
        x,
        positions,
        layer.rope_max_wavelength,
        layer.rope_scaling_factor,
        layer.rope_scaling,
    )


def project(dense, x, calls=call_sublayer):
    """`dense(x)`, `(B, T, width)` -> `(B, T, heads, dim)` (through `calls`:
    `call_sublayer`, or a decoding's `SublayerCalls`).

    Raises where Keras would add the bias on the wrong axis: on TensorFlow,
    `keras.ops.add` adds a bias of shape `(heads, 1)` along axis 1 (the
    positions) when there are as many positions as heads.
    """
    if keras.backend.backend() == "tensorflow":
        _check_bias_axis(dense, x)
    return calls(dense, x)


def _check_bias_axis(dense, x):
    bias_shape = () if dense.bias is None else tuple(dense.bias.shape)
    if len(bias_shape) == 2 and bias_shape[1] == 1 and 1 < bias_shape[0] == x.shape[1]:
        raise ValueError(
            f"On TensorFlow, Keras adds the bias of `{dense.name}` (heads of "
            "width 1) along the wrong axis when the length equals the number "
            f"of heads. Received: length={x.shape[1]}, "
            f"heads={bias_shape[0]}, head width=1. Use heads of width > 1 "
            "(key_dim/value_dim), use_bias=False, or another backend."
        )
