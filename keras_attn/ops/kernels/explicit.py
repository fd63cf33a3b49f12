"""The explicit path: softmax(cap(QK^T) + bias) V with the weights
materialized, logits and softmax in float32 (float64 for float64 inputs).

It computes everything the fused kernels cannot: dropout on the weights,
returned weights, soft-capped logits, values of another width.
"""

import keras
import numpy as np
from keras import ops

from keras_attn.ops.dtypes import at_least_float32
from keras_attn.ops.masks import (
    causal,
    merge_attention_masks,
    open_empty_rows,
    zero_empty_rows,
)


def attention(query, key, value, mask, bias, causal_offset, options):
    """The explicit path for query rows at `causal_offset` (`None`: not causal).

    `query` `(B, T, H, D)` is already scaled; `key`, `value` `(B, S, K, D)`,
    or `(B, K, S, D)` with `options.heads_major`. Returns `(output (B, T, H,
    Dv), weights (B, H, T, S))`; rows whose mask allows no key give zeros.
    """
    if causal_offset is not None:  # folded in, so that empty rows are found
        length = ops.shape(query)[1]
        key_length = ops.shape(key)[2 if options.heads_major else 1]
        mask = merge_attention_masks(
            mask, causal(length, key_length, query_offset=causal_offset)
        )
    has_key = None
    if mask is not None:
        mask, has_key = open_empty_rows(mask)
    output, probs = _weights_and_output(query, key, value, mask, bias, options)
    return zero_empty_rows(output, probs, has_key)


def _weights_and_output(query, key, value, mask, bias, options):
    """`(output (B, T, H, Dv), weights (B, H, T, S))`, the weights before
    dropout."""
    batch, query_length, num_heads, head_dim = ops.shape(query)
    num_key_value_heads = key.shape[1 if options.heads_major else 2]
    key_length = ops.shape(key)[2 if options.heads_major else 1]
    groups = num_heads // num_key_value_heads
    scores_equation, combine_equation = _grouped_einsums(
        num_heads, num_key_value_heads, options.heads_major
    )
    wide = at_least_float32(query.dtype)
    query = ops.cast(query, wide)
    if groups > 1:
        query = ops.reshape(
            query, (batch, query_length, num_key_value_heads, groups, head_dim)
        )
    logits = ops.einsum(scores_equation, query, ops.cast(key, wide))
    logits = ops.reshape(logits, (batch, num_heads, query_length, key_length))
    if options.logit_soft_cap is not None:  # Gemma 2: cap * tanh(logits / cap)
        cap = options.logit_soft_cap
        logits = ops.tanh(logits / cap) * cap
    if bias is not None:
        logits = logits + ops.cast(bias, wide)
    probs = _masked_softmax(logits, mask, value.dtype)
    weights = probs if options.dropout is None else options.dropout(probs)
    if groups > 1:
        weights = ops.reshape(
            weights, (batch, num_key_value_heads, groups, query_length, key_length)
        )
    output = ops.einsum(combine_equation, weights, value)
    return ops.reshape(output, (batch, query_length, num_heads, -1)), probs


def _grouped_einsums(num_heads, num_key_value_heads, heads_major):
    """The two einsums, for either key/value layout.

    Query heads `h = k * G + g` share key/value head `k` (`G` = heads per
    key/value head), matched by a reshape rather than a repeat.
    """
    keys = "bksd" if heads_major else "bskd"
    if num_heads == num_key_value_heads:
        keys = keys.replace("k", "h")
        return f"bthd,{keys}->bhts", f"bhts,{keys}->bthd"
    return f"btkgd,{keys}->bkgts", f"bkgts,{keys}->btkgd"


def _masked_softmax(logits, mask, dtype):
    """Softmax of `logits` over the keys `mask` allows, cast to `dtype`."""
    if mask is not None:
        lowest = np.finfo(keras.backend.standardize_dtype(logits.dtype)).min
        logits = ops.where(mask, logits, lowest)
    return ops.cast(_softmax(logits), dtype)


def _softmax(logits):
    """Keras' softmax over the keys. Over a single key (a one-token call)
    it is `exp(x - x)`: the same numbers, NaN and infinities included,
    without Keras' warning about "a softmax over an axis of size 1" (meant
    for classifier heads, where a size-1 softmax is a mistake)."""
    if logits.shape[-1] == 1:
        return ops.exp(ops.subtract(logits, logits))
    return ops.softmax(logits, axis=-1)
