"""The explicit path: softmax(cap(QK^T) + bias) V with the weights
materialized, logits and softmax in float32 (float64 for float64 inputs).

It computes everything the fused kernels cannot: dropout on the weights,
returned weights, soft-capped logits, sink logits, values of another width.
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


def attention(
    query, key, value, mask, bias, causal_offset, options, rows_have_keys=False,
    keep_weights=True,
):  # fmt: skip
    """The explicit path for query rows at `causal_offset` (`None`: not causal).

    `query` `(B, T, H, D)` is already scaled; `key`, `value` `(B, S, K, D)`,
    or `(B, K, S, D)` with `options.heads_major`. Returns `(output (B, T, H,
    Dv), weights (B, H, T, S))`; rows whose mask allows no key give zeros.
    `rows_have_keys`: as `visible` takes it. `keep_weights=False`: the
    weights are not wanted (`None`), so not zeroed in empty rows either.
    """
    mask, has_key = visible(mask, causal_offset, query, key, options, rows_have_keys)
    output, probs = _weights_and_output(query, key, value, mask, bias, options)
    return zero_empty_rows(output, probs if keep_weights else None, has_key)


def visible(mask, causal_offset, query, key, options, rows_have_keys=False):
    """`(mask, rows_with_any_key)`: the causal mask for rows at
    `causal_offset` (`None`: not causal) folded into `mask`, so that empty rows
    are found, and those rows opened (`open_empty_rows`); `(None, None)`
    where nothing masks. `rows_have_keys=True`: the caller knows the mask
    leaves every row a key, so none is opened (`(mask, None)`)."""
    if causal_offset is not None:
        length = ops.shape(query)[1]
        key_length = ops.shape(key)[2 if options.heads_major else 1]
        mask = merge_attention_masks(
            mask, causal(length, key_length, query_offset=causal_offset)
        )
    if mask is None:
        return None, None
    return (mask, None) if rows_have_keys else open_empty_rows(mask)


def _weights_and_output(query, key, value, mask, bias, options):
    """`(output (B, T, H, Dv), weights (B, H, T, S))`, the weights before
    dropout."""
    probs = _softmax_to(
        masked_logits(query, key, bias, mask, options),
        value.dtype,
        options.sink_logits,
    )
    weights = probs if options.dropout is None else options.dropout(probs)
    return combine(weights, value, options), probs


def masked_logits(query, key, bias, mask, options):
    """`masked(logits(query, key, bias, options), mask)`. On PyTorch without
    a soft cap (which comes between the product and the additions), the bias
    and the mask are added by the product itself (`torch_logits`)."""
    if (
        keras.config.backend() != "torch"
        or options.logit_soft_cap is not None
        or (mask is None and bias is None)
    ):
        return masked(logits(query, key, bias, options), mask)
    from keras_attn.ops.kernels import torch_logits

    wide = at_least_float32(query.dtype)
    added = None if mask is None else mask_bias(mask, wide)
    if bias is not None:
        bias = ops.cast(bias, wide)
        added = bias if added is None else bias + added
    query, key = ops.cast(query, wide), ops.cast(key, wide)
    return torch_logits.masked_logits(query, key, added, options.heads_major)


def logits(query, key, bias, options):
    """The logits `(B, H, T, S)`, soft-capped and biased, before the mask, in
    float32 (float64 for float64 inputs)."""
    logits = soft_cap(scores(query, key, options), options)
    if bias is not None:
        logits = logits + ops.cast(bias, logits.dtype)
    return logits


def soft_cap(logits, options):
    """Gemma 2's `cap * tanh(logits / cap)`, where `options` caps."""
    if options.logit_soft_cap is None:
        return logits
    cap = options.logit_soft_cap
    return ops.tanh(logits / cap) * cap


def scores(query, key, options):
    """`query` `(B, T, H, D)` times `key` `(B, S, K, D)` (or `(B, K, S, D)`
    with `options.heads_major`) over `D`: `(B, H, T, S)`, at least in float32."""
    batch, query_length, num_heads, _ = ops.shape(query)
    num_key_value_heads = key.shape[1 if options.heads_major else 2]
    key_length = ops.shape(key)[2 if options.heads_major else 1]
    equation = _equations(num_heads, num_key_value_heads, options)["scores"]
    wide = at_least_float32(query.dtype)
    query = _grouped(ops.cast(query, wide), num_key_value_heads, axis=2)
    scores = ops.einsum(equation, query, ops.cast(key, wide))
    return ops.reshape(scores, (batch, num_heads, query_length, key_length))


def combine(weights, value, options):
    """`weights` `(B, H, T, S)` times `value` `(B, S, K, Dv)` (or heads-major)
    over `S`: `(B, T, H, Dv)`."""
    batch, num_heads, query_length, _ = ops.shape(weights)
    num_key_value_heads = value.shape[1 if options.heads_major else 2]
    equation = _equations(num_heads, num_key_value_heads, options)["combine"]
    weights = _grouped(weights, num_key_value_heads, axis=1)
    output = ops.einsum(equation, weights, value)
    return ops.reshape(output, (batch, query_length, num_heads, -1))


def combine_rows(weights, rows, num_key_value_heads, options):
    """`weights` `(B, H, T, S)` times `rows` `(B, T, H, D)` over `T` and the
    query heads of each key/value head: `(B, S, K, D)` (or heads-major), the
    keys' layout. The transpose of `combine`, for the gradients of the keys
    and values."""
    num_heads = weights.shape[1]
    equation = _equations(num_heads, num_key_value_heads, options)["to_keys"]
    weights = _grouped(weights, num_key_value_heads, axis=1)
    rows = _grouped(rows, num_key_value_heads, axis=2)
    # `(B, K, D, S)`: the weights enter as they are. Asked for `S` before
    # `D`, XLA's CPU compiler writes them transposed first.
    output = ops.einsum(equation, rows, weights)
    return ops.transpose(output, (0, 1, 3, 2) if options.heads_major else (0, 3, 1, 2))


def _grouped(x, num_key_value_heads, axis):
    """`x` with its heads axis split into `(K, G)` where heads are grouped."""
    num_heads = x.shape[axis]
    if num_heads == num_key_value_heads:
        return x
    shape = list(ops.shape(x))
    groups = [num_key_value_heads, num_heads // num_key_value_heads]
    return ops.reshape(x, shape[:axis] + groups + shape[axis + 1 :])


def _equations(num_heads, num_key_value_heads, options):
    """The einsums for either key/value layout: `scores` (query, key ->
    logits), `combine` (weights, value -> output) and `to_keys` (query rows,
    weights -> `(B, K, D, S)`)."""
    scores, combine = _grouped_einsums(
        num_heads, num_key_value_heads, options.heads_major
    )
    operands, weights = scores.split("->")
    queries, keys = operands.split(",")
    heads = "h" if "h" in keys else "k"
    return {
        "scores": scores,
        "combine": combine,
        "to_keys": f"{queries},{weights}->b{heads}ds",
    }


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


def _softmax_to(logits, dtype, sink_logits=None):
    """Softmax of the masked `logits` over the keys, cast to `dtype`; with
    `sink_logits` `(H,)`, each head's sink joins the denominator."""
    if sink_logits is None:
        return ops.cast(_softmax(logits), dtype)
    return ops.cast(_softmax(with_sinks(logits, sink_logits))[..., :-1], dtype)


def with_sinks(logits, sink_logits):
    """`logits` `(B, H, T, S)` with each head's sink logit appended as a last
    key `(B, H, T, S + 1)`, in the logits' dtype: the softmax over it, its
    column dropped, gives gpt-oss's weights."""
    sinks = ops.reshape(ops.cast(sink_logits, logits.dtype), (1, -1, 1, 1))
    sinks = ops.broadcast_to(sinks, (*ops.shape(logits)[:-1], 1))
    return ops.concatenate([logits, sinks], axis=-1)


def masked(logits, mask):
    """`logits` with the dtype's lowest number added where `mask` is False.

    A masked logit is then that number (or minus infinity below it), whose
    weight is 0 either way. Added, not put with a `where` over the logits:
    the bias is built on the mask, which is smaller where it broadcasts, and
    the sum's gradient costs nothing, where a `where` costs a pass over the
    logits forward, again in a recomputed chunk and in its gradient (on eager
    PyTorch, 26% of a causal call in chunks; `benchmarks/block_skipping.py`).
    As in Keras' `Softmax` and PyTorch's SDPA, which add their masks too, a
    NaN or infinite logit where it is masked (a key of NaNs) now makes its
    whole row NaN, where the `where` dropped it.
    """
    if mask is None:
        return logits
    return logits + mask_bias(mask, logits.dtype)


def mask_bias(mask, dtype):
    """`mask` as the logits' addend in `dtype`: 0 where it shows a key, the
    dtype's lowest number where it hides one."""
    lowest = np.finfo(keras.backend.standardize_dtype(dtype)).min
    # Built in the logits' dtype: `ops.where(mask, 0.0, lowest)` is float32 on
    # PyTorch, where float64's lowest number becomes minus infinity.
    return ops.cast(ops.logical_not(mask), dtype) * lowest


def _softmax(logits):
    """Keras' softmax over the keys. Over a single key (a one-token call)
    it is `exp(x - x)`: the same numbers, NaN and infinities included,
    without Keras' warning about "a softmax over an axis of size 1" (meant
    for classifier heads, where a size-1 softmax is a mistake)."""
    if logits.shape[-1] == 1:
        return ops.exp(ops.subtract(logits, logits))
    return ops.softmax(logits, axis=-1)
