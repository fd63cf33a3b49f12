"""The Transformer encoder block: self-attention and a feed-forward network."""

import keras

from keras_attn._checks import (
    check_broadcastable,
    check_mask,
    check_segment_ids_call,
)
from keras_attn.layers._block import TransformerBlock, first_mask, to_bool
from keras_attn.layers._docs import shared_docs
from keras_attn.layers._machinery import call_arguments


@keras.saving.register_keras_serializable(package="keras_attn")
@shared_docs
class TransformerEncoder(TransformerBlock):
    """One Transformer encoder block: self-attention and a feed-forward network.

    Post-norm as in Vaswani et al. (2017) by default,
    `x = LayerNorm(x + Dropout(SelfAttention(x)))` then
    `x = LayerNorm(x + Dropout(FFN(x)))`; `normalize_first=True` gives pre-norm,
    `x = x + Dropout(SelfAttention(LayerNorm(x)))` and likewise for the FFN (the
    arrangement of `torch.nn.TransformerEncoderLayer(norm_first=True)`).
    Padding masks arrive as a Keras mask (e.g. from `mask_zero=True`) or as
    `padding_mask`; the output carries the input's Keras mask.

    Sublayers: `self_attention` (`keras_attn.MultiHeadAttention`),
    `self_attention_layer_norm`, `feedforward_layer_norm`,
    `feedforward_intermediate_dense`, (`feedforward_gate_dense` with
    `gated_feedforward`), `feedforward_output_dense`, then with
    `normalize_sublayer_outputs` the norms of the sublayers' outputs,
    `self_attention_output_norm` (after `self_attention_layer_norm`) and
    `feedforward_output_norm` (last). The norms are `RMSNormalization`s with
    `normalization="rms_norm"`; the attention has `query_norm` and
    `key_norm` with `normalize_qk`.

    Args:
        {block_arguments}
        use_gate: bool, keyword only. A sigmoid gate on the attention output;
            see `keras_attn.MultiHeadAttention`. Defaults to `False`.
        sliding_window: int, keyword only. Each position attends only to
            positions less than `sliding_window` away. Defaults to `None`.
        {attention_sinks}
        {block_options}

    Call arguments:
        inputs: float tensor `(batch, length, width)`.
        padding_mask: optional bool `(batch, length)`, True for real tokens.
            Takes precedence over the input's Keras mask.
        attention_mask: optional bool `(batch, length, length)`, True where
            attention is allowed; combined with the padding mask.
        training: bool. Whether dropout is active.
        return_attention_scores: bool. Also return the self-attention weights
            `(batch, num_heads, length, length)`. Defaults to `False`.
        attention_bias: optional float tensor broadcastable to
            `(batch, num_heads, length, length)`, added to the attention
            logits (e.g. `keras_attn.ops.alibi_bias`).
        segment_ids: optional int `(batch, length)`: packed sequences, a
            segment a contiguous run of equal ids. A token attends only to
            tokens of its own segment, and rotary positions restart at each
            segment's start; see `keras_attn.MultiHeadAttention` (and its
            remark on `flash_attention=True`). Padding is not special-cased.
        mask, inputs_mask: filled in by Keras with the input's Keras mask; not
            passed by hand.

    Returns:
        Tensor of the input's shape, carrying the input's mask; with
        `return_attention_scores=True`, a tuple `(outputs, scores)`.

    Example:
    >>> encoder = keras_attn.TransformerEncoder(intermediate_dim=64, num_heads=2)
    >>> tuple(encoder(np.zeros((2, 5, 16))).shape)
    (2, 5, 16)
    """

    def build(self, inputs_shape):
        self._check_width("inputs", inputs_shape)
        (
            self.self_attention,
            self.self_attention_layer_norm,
            self.self_attention_output_norm,
        ) = self._build_attention(
            "self_attention",
            inputs_shape,
            window=self.sliding_window,
            sinks=self.attention_sinks,
        )
        self._build_feedforward(inputs_shape, norm_first=True)
        self.built = True

    def call(
        self,
        inputs,
        padding_mask=None,
        attention_mask=None,
        training=None,
        return_attention_scores=False,
        attention_bias=None,
        segment_ids=None,
        mask=None,
        inputs_mask=None,
    ):
        self._check_call(
            inputs,
            padding_mask=padding_mask,
            attention_mask=attention_mask,
            attention_bias=attention_bias,
            return_attention_scores=return_attention_scores,
            segment_ids=segment_ids,
        )
        padding_mask = to_bool(first_mask(padding_mask, inputs_mask, mask))
        x, scores, _ = self._attention_residual(
            inputs,
            self.self_attention,
            (self.self_attention_layer_norm, self.self_attention_output_norm),
            training,
            return_attention_scores,
            value_mask=padding_mask,
            attention_mask=attention_mask,
            attention_bias=attention_bias,
            segment_ids=segment_ids,
        )
        x = self._feedforward_residual(x, training, padding=padding_mask)
        return (x, scores) if return_attention_scores else x

    def _check_call(
        self,
        inputs,
        padding_mask=None,
        attention_mask=None,
        attention_bias=None,
        return_attention_scores=False,
        segment_ids=None,
        **unchecked,
    ):
        """The call's arguments, by name (`unchecked`: those with nothing to
        check, e.g. `training`)."""
        self._check_sequence("inputs", inputs, return_attention_scores)
        batch, length = inputs.shape[0], inputs.shape[1]
        check_mask("padding_mask", padding_mask, (batch, length))
        check_mask("attention_mask", attention_mask, (batch, length, length))
        check_broadcastable(
            "attention_bias",
            attention_bias,
            (batch, self.num_heads, length, length),
            "(batch, num_heads, length, length)",
        )
        check_segment_ids_call(segment_ids, (batch, length))

    def _attention_layers(self):
        return [self.self_attention]

    def compute_output_shape(self, inputs_shape):
        return tuple(inputs_shape)

    def compute_output_spec(self, *args, **kwargs):
        arguments = call_arguments(self, args, kwargs)
        self._check_call(**arguments)
        inputs = arguments["inputs"]
        return_attention_scores = arguments["return_attention_scores"]
        output = keras.KerasTensor(inputs.shape, dtype=self.compute_dtype)
        if not return_attention_scores:
            return output
        batch, length = inputs.shape[0], inputs.shape[1]
        scores = (batch, self.num_heads, length, length)
        return output, keras.KerasTensor(scores, dtype=self.compute_dtype)
