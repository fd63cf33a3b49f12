"""Pure `keras.ops` functions behind the layers: attention, masks, positions.

Every function here is stateless and backend-agnostic. Shapes use `B` batch,
`T`/`S` query/key length, `H` heads, `K` key/value heads, `D` per-head width.
"""

import math

import keras
import numpy as np
from keras import ops

__all__ = [
    "causal_mask",
    "dot_product_attention",
    "merge_attention_masks",
    "sinusoidal_position_encoding",
]


def sinusoidal_position_encoding(
    length, dim, max_wavelength=10000.0, start_index=0, dtype="float32"
):
    """The sinusoidal position table of Vaswani et al. (2017), interleaved.

    `PE[pos, 2i] = sin(pos / max_wavelength**(2i / dim))` and
    `PE[pos, 2i + 1] = cos(pos / max_wavelength**(2i / dim))`, computed in
    float32 for positions `start_index, ..., start_index + length - 1`. The
    inverse frequencies are rounded once from float64, so every backend
    evaluates the same float32 angles. Any length and any (odd too) `dim`.

    Args:
        length: int or scalar int tensor. Number of positions.
        dim: int. Width of the encoding.
        max_wavelength: float. The base of the geometric wavelength progression.
            Defaults to `10000.0`.
        start_index: int, scalar int tensor, or int tensor `(batch,)` of one
            start per sequence. Position of the first row. Defaults to `0`.
        dtype: dtype of the returned table. Defaults to `"float32"`.

    Returns:
        Tensor `(length, dim)`, or `(batch, length, dim)` for per-sequence
        starts.

    Example:
    >>> table = keras_attn.ops.sinusoidal_position_encoding(4, 6)
    >>> tuple(table.shape)
    (4, 6)
    >>> [round(float(v), 4) for v in keras.ops.convert_to_numpy(table)[1, :2]]
    [0.8415, 0.5403]
    """
    channels = np.arange(dim)
    inverse_frequency = np.power(
        float(max_wavelength), -(2 * (channels // 2)) / dim, dtype=np.float64
    ).astype("float32")  # (dim,)
    start = ops.cast(start_index, "float32")
    positions = ops.cast(ops.arange(length), "float32")  # (T,)
    if len(start.shape) == 1:
        positions = positions[None, :] + start[:, None]  # (B, T)
    else:
        positions = positions + start
    angles = positions[..., None] * ops.convert_to_tensor(inverse_frequency)
    even = ops.convert_to_tensor(channels % 2 == 0)
    return ops.cast(ops.where(even, ops.sin(angles), ops.cos(angles)), dtype)


def causal_mask(query_length, key_length, query_offset=0):
    """Boolean lower-triangular mask: query `i` may attend to key `j <= i + offset`.

    Args:
        query_length: int or scalar tensor. Number of query positions.
        key_length: int or scalar tensor. Number of key positions.
        query_offset: int or scalar tensor. Absolute position of the first query,
            e.g. the cache index during step-by-step decoding. Defaults to `0`.

    Returns:
        Bool tensor `(query_length, key_length)`, True where attention is allowed.

    Example:
    >>> keras.ops.convert_to_numpy(keras_attn.ops.causal_mask(3, 3)).astype(int)
    array([[1, 0, 0],
           [1, 1, 0],
           [1, 1, 1]])
    """
    query_positions = ops.arange(query_length) + query_offset  # (T,)
    key_positions = ops.arange(key_length)  # (S,)
    return ops.greater_equal(query_positions[:, None], key_positions[None, :])


def merge_attention_masks(key_padding_mask=None, attention_mask=None):
    """Combine a key padding mask and an attention mask into one `(B, 1|H, T, S)`.

    Args:
        key_padding_mask: optional bool `(B, S)`, True for keys that may be
            attended to.
        attention_mask: optional bool `(T, S)`, `(B, T, S)` or `(B, 1|H, T, S)`,
            True where attention is allowed.

    Returns:
        Bool tensor of rank 4 broadcastable to `(B, H, T, S)`, or `None` when
        both masks are `None`.

    Example:
    >>> padding = np.array([[True, True, False]])
    >>> mask = keras_attn.ops.merge_attention_masks(padding, np.tril(np.ones((3, 3))))
    >>> keras.ops.convert_to_numpy(mask)[0, 0].astype(int)
    array([[1, 0, 0],
           [1, 1, 0],
           [1, 1, 0]])
    """
    mask = None
    if attention_mask is not None:
        mask = ops.cast(attention_mask, "bool")
        while len(mask.shape) < 4:
            mask = ops.expand_dims(mask, 0 if len(mask.shape) == 2 else 1)
    if key_padding_mask is not None:
        padding = ops.cast(key_padding_mask, "bool")[:, None, None, :]  # (B,1,1,S)
        mask = padding if mask is None else ops.logical_and(mask, padding)
    return mask


def _attends_to_something(mask):
    """`(mask with empty rows opened, rows_with_any_key)` for a rank-4 mask."""
    has_key = ops.any(mask, axis=-1, keepdims=True)  # (B, 1|H, T, 1)
    return ops.logical_or(mask, ops.logical_not(has_key)), has_key


def _repeat_key_value_heads(tensor, num_heads):
    """`(B, S, K, D)` -> `(B, S, num_heads, D)`: each K/V head serves a group."""
    num_key_value_heads = tensor.shape[2]
    if num_key_value_heads == num_heads:
        return tensor
    return ops.repeat(tensor, num_heads // num_key_value_heads, axis=2)


def _fused_kernel_fits(query, value):
    """Whether `keras.ops.dot_product_attention` computes what the explicit path does.

    Its kernels need keys and values of one width, and TensorFlow's forms
    half-precision logits in half precision (they overflow float16 and lose
    bfloat16 digits); JAX's and PyTorch's accumulate them in float32. With
    `flash_attention=True` the fused op is called regardless, and raises where
    it cannot do what was asked.
    """
    if value.shape[-1] != query.shape[-1]:
        return False
    half = keras.backend.standardize_dtype(query.dtype) in ("float16", "bfloat16")
    return not (half and keras.config.backend() == "tensorflow")


def _masked_softmax(logits, mask, dtype):
    """Float32 softmax of `logits` over the keys `mask` allows, cast to `dtype`."""
    if mask is not None:
        logits = ops.where(mask, logits, np.finfo("float32").min)
    return ops.cast(ops.softmax(logits, axis=-1), dtype)


def _zero_empty_rows(output, probs, has_key):
    """Zero the output `(B, T, H, D)` and weights of rows with no allowed key."""
    if has_key is None:
        return output, probs
    keep = ops.transpose(has_key, (0, 2, 1, 3))  # (B, T, 1|H, 1)
    output = ops.where(keep, output, ops.zeros_like(output))
    if probs is not None:
        probs = ops.where(has_key, probs, ops.zeros_like(probs))
    return output, probs


def _explicit_attention(query, key, value, mask, is_causal, dropout):
    """Materialized softmax(QK^T)V with a float32 softmax; returns (out, probs)."""
    logits = ops.einsum(
        "bthd,bshd->bhts", ops.cast(query, "float32"), ops.cast(key, "float32")
    )  # (B, H, T, S)
    if is_causal:
        mask = causal_mask(ops.shape(query)[1], ops.shape(key)[1])
    probs = _masked_softmax(logits, mask, query.dtype)
    weights = probs if dropout is None else dropout(probs)
    return ops.einsum("bhts,bshd->bthd", weights, value), probs


def _heads_major_attention(
    query, key, value, mask=None, is_causal=False, dropout=None, return_scores=False
):
    """`dot_product_attention`'s explicit path for heads-major keys and values.

    `query` `(B, T, H, D)`; `key` and `value` `(B, K, S, D)`, the layout of the
    key/value caches, where each head's keys are contiguous: one step of cached
    decoding reads them without the transposed copy a `(B, S, K, D)` layout
    costs. Grouped-query heads are matched by a reshape, not repeated. Same
    numbers, masks and empty-row zeros as the explicit path; returns
    `(B, T, H, D)`, or `(output, weights (B, H, T, S))` with `return_scores`.
    """
    batch, query_length = ops.shape(query)[0], ops.shape(query)[1]
    num_heads, head_dim = query.shape[2], query.shape[3]
    num_key_value_heads, key_length = key.shape[1], ops.shape(key)[2]
    groups = num_heads // num_key_value_heads
    query = ops.multiply(query, ops.cast(1.0 / math.sqrt(head_dim), query.dtype))
    grouped = ops.reshape(
        ops.cast(query, "float32"),
        (batch, query_length, num_key_value_heads, groups, head_dim),
    )
    logits = ops.einsum("btkgd,bksd->bkgts", grouped, ops.cast(key, "float32"))
    logits = ops.reshape(logits, (batch, num_heads, query_length, key_length))
    if is_causal:
        causal = causal_mask(query_length, key_length)[None, None]
        mask = causal if mask is None else ops.logical_and(mask, causal)
    has_key = None
    if mask is not None:
        mask, has_key = _attends_to_something(mask)
    probs = _masked_softmax(logits, mask, query.dtype)
    weights = probs if dropout is None else dropout(probs)
    weights = ops.reshape(
        weights, (batch, num_key_value_heads, groups, query_length, key_length)
    )
    output = ops.einsum("bkgts,bksd->btkgd", weights, value)
    output = ops.reshape(output, (batch, query_length, num_heads, value.shape[-1]))
    output, probs = _zero_empty_rows(output, probs, has_key)
    return (output, probs) if return_scores else output


def dot_product_attention(
    query,
    key,
    value,
    mask=None,
    is_causal=False,
    scale=None,
    fused=True,
    flash_attention=None,
    dropout=None,
    return_scores=False,
):
    """Scaled dot-product attention, softmax(QK^T * scale) V, with safe masking.

    With `fused=True` it calls `keras.ops.dot_product_attention` (cuDNN/flash
    kernels where the backend has them); with `fused=False` it materializes the
    attention weights with a float32 softmax, applies `dropout` to them and can
    return them. Both give the same numbers. A query row whose mask allows no key
    at all attends to nothing: its output and its weights are zeros, never NaN.

    Args:
        query: `(B, T, H, D)`.
        key: `(B, S, K, D)`; `K` divides `H` (grouped-query attention).
        value: `(B, S, K, Dv)`.
        mask: optional bool, broadcastable to `(B, H, T, S)`, True = may attend.
        is_causal: bool. Also apply a lower-triangular mask (query `i` sees keys
            `j <= i`). Defaults to `False`.
        scale: float. Logit scale; defaults to `1 / sqrt(D)`.
        fused: bool. Use the fused backend kernel. Defaults to `True`.
        flash_attention: `None`, `True` or `False`, passed to
            `keras.ops.dot_product_attention` on the fused path.
        dropout: optional callable applied to the weights (explicit path only).
        return_scores: bool. Also return the weights `(B, H, T, S)` (explicit
            path only). Defaults to `False`.

    Returns:
        `(B, T, H, Dv)`, or `(output, weights)` with `return_scores=True`.

    Example:
    >>> q = np.random.rand(2, 3, 4, 8).astype("float32")
    >>> out = keras_attn.ops.dot_product_attention(q, q, q, is_causal=True)
    >>> tuple(out.shape)
    (2, 3, 4, 8)
    """
    if fused and (dropout is not None or return_scores):
        raise ValueError(
            "`dropout` and `return_scores` need the explicit path. "
            f"Received: fused={fused}, dropout={dropout}, "
            f"return_scores={return_scores}. Pass `fused=False`."
        )
    num_heads = query.shape[2]
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    # Scaled once, before either path: both then see the same scaled query.
    query = ops.multiply(query, ops.cast(scale, query.dtype))
    key = _repeat_key_value_heads(key, num_heads)
    value = _repeat_key_value_heads(value, num_heads)
    has_key = None
    if mask is not None:
        if is_causal:  # Fold it in, so rows left empty by both masks are found.
            causal = causal_mask(ops.shape(query)[1], ops.shape(key)[1])
            mask, is_causal = ops.logical_and(mask, causal), False
        mask, has_key = _attends_to_something(mask)
    fused = fused and (flash_attention or _fused_kernel_fits(query, value))
    if fused:
        output = ops.dot_product_attention(
            query,
            key,
            value,
            mask=mask,
            scale=1.0,
            is_causal=is_causal,
            flash_attention=flash_attention,
        )
        probs = None
    else:
        output, probs = _explicit_attention(query, key, value, mask, is_causal, dropout)
    output, probs = _zero_empty_rows(output, probs, has_key)
    return (output, probs) if return_scores else output
