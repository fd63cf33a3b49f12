"""The backend's fused kernel, in the form the plan gives.

On PyTorch, torch's own `scaled_dot_product_attention` (`torch_sdpa`, which
says why not Keras' op); elsewhere `keras.ops.dot_product_attention`, on
`(B, S, K, D)` keys and values.
"""

import keras
import numpy as np
from keras import ops

from keras_attn.ops.masks import (
    causal,
    merge_attention_masks,
    open_empty_rows,
    zero_empty_rows,
)


def attention(query, key, value, mask, bias, is_causal, plan, options):
    """Attention of `query` `(B, T, H, D)` over `key` and `value` with the
    fused kernel; returns `(B, T, H, Dv)`.

    A causal mask the plan does not leave to the kernel is folded into the
    mask, and the mask into the bias where there is one (the kernels take one
    of them); rows that the mask leaves empty give zeros (on PyTorch, for a
    mask, the bridge's own torch calls do it: `torch_sdpa`).
    """
    key_axis, head_axis = (2, 1) if options.heads_major else (1, 2)
    if is_causal and not plan.is_causal:
        length, key_length = ops.shape(query)[1], ops.shape(key)[key_axis]
        mask = merge_attention_masks(mask, causal(length, key_length))
    has_key = None
    torch_mask = keras.config.backend() == "torch" and bias is None
    if mask is not None and not torch_mask:
        mask, has_key = open_empty_rows(mask)
    if bias is not None:
        bias, mask = _bias_with_mask(bias, mask, query.dtype), None
    if plan.repeat_key_value_heads:
        groups = query.shape[2] // key.shape[head_axis]
        key, value = (ops.repeat(x, groups, axis=head_axis) for x in (key, value))
    output = _kernel(query, key, value, mask, bias, plan, options)
    return zero_empty_rows(output, None, has_key)[0]


def _bias_with_mask(bias, mask, dtype):
    """One float bias in `dtype`: the fused kernels take a mask or a bias, not
    both, so a mask goes in as the lowest value where it forbids attention
    (in float32: bfloat16 has no numpy finfo)."""
    if mask is not None:
        lowest = np.finfo("float32").min
        bias = ops.where(mask, ops.cast(bias, "float32"), lowest)
    return ops.cast(bias, dtype)


def _kernel(query, key, value, mask, bias, plan, options):
    """The backend's fused kernel, given a mask or a bias (or neither)."""
    if keras.config.backend() == "torch":
        from keras_attn.ops.kernels import torch_sdpa

        query, key, value = (  # each conversion costs an op, even of a tensor
            x if ops.is_tensor(x) else ops.convert_to_tensor(x)
            for x in (query, key, value)
        )
        return torch_sdpa.attention(
            query,
            key,
            value,
            bias if mask is None else mask,
            plan.is_causal,
            options.scale,
            options.heads_major,
            require_fused=plan.require_fused,
            composite=plan.composite,
        )
    if options.heads_major:  # Keras' kernels take `(B, S, K, D)`
        key, value = (ops.transpose(x, (0, 2, 1, 3)) for x in (key, value))
    return ops.dot_product_attention(
        query,
        key,
        value,
        bias=bias,
        mask=mask,
        scale=options.scale,
        is_causal=plan.is_causal,
        flash_attention=True if plan.require_fused else None,
    )
