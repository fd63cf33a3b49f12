"""Masks and biases over (query, key) positions: causal, sliding window (with
attention sinks), ALiBi, and the merge of any of them into one rank-4 boolean
mask. True means "may attend"."""

import math

from keras import ops

from keras_attn._checks import (
    check_count,
    check_positive_float,
    check_positive_int,
    check_segment_ids,
    check_size,
)
from keras_attn.ops.constants import constant
from keras_attn.ops.dtypes import cast_to
from keras_attn.ops.positions import segment_runs

__all__ = [
    "alibi_bias",
    "causal_mask",
    "merge_attention_masks",
    "segment_mask",
    "sliding_window_mask",
]


def offsets(query_length, key_length, query_offset):
    """`(T, S)` int32 `key position - query position`; query `i` sits at
    `i + query_offset`, key `j` at `j`.

    (`arange(0, n)`, `expand_dims` rather than `arange(n)`, `[None]`: the
    forms that jax2onnx and TensorFlow Lite's builtin ops export.)
    """
    query_positions = ops.arange(0, query_length, dtype="int32") + ops.cast(
        query_offset, "int32"
    )
    key_positions = ops.arange(0, key_length, dtype="int32")
    return ops.expand_dims(key_positions, 0) - ops.expand_dims(query_positions, 1)


def causal_mask(query_length, key_length, query_offset=0):
    """Boolean lower-triangular mask: query `i` may attend to key `j <= i + offset`.

    Args:
        query_length: int >= 0 or scalar int tensor. Number of query positions.
        key_length: int >= 0 or scalar int tensor. Number of key positions.
        query_offset: int >= 0 or scalar int tensor. Absolute position of the
            first query, e.g. the cache index during step-by-step decoding.
            Defaults to `0`.

    Returns:
        Bool tensor `(query_length, key_length)`, True where attention is allowed.

    Example:
    >>> keras.ops.convert_to_numpy(keras_attn.ops.causal_mask(3, 3)).astype(int)
    array([[1, 0, 0],
           [1, 1, 0],
           [1, 1, 1]])
    """
    _check_positions(query_length, key_length, query_offset)
    return causal(query_length, key_length, query_offset)


def causal(query_length, key_length, query_offset=0):
    """`causal_mask` without its checks, for callers that checked (the
    kernels and the layers, once per call)."""
    return offsets(query_length, key_length, query_offset) <= 0


def sliding_window_mask(
    query_length, key_length, window, query_offset=0, attention_sinks=0
):
    """Boolean band: query `i` may attend to keys within `window - 1` positions
    (and to the first `attention_sinks` keys).

    Key `j` is allowed where `|i + query_offset - j| < window`, the symmetric
    band of Keras' `MultiHeadAttention(sliding_window=...)`, or where
    `j < attention_sinks`. ANDed with `causal_mask`, it is the causal sliding
    window of Mistral (each query sees itself and the `window - 1` keys before
    it), and with sinks StreamingLLM's mask (Xiao et al. 2023): the first
    `attention_sinks` positions and the last `window`.

    Args:
        query_length: int >= 0 or scalar int tensor. Number of query positions.
        key_length: int >= 0 or scalar int tensor. Number of key positions.
        window: int >= 1. Width of the band on each side, the query included.
        query_offset: int >= 0 or scalar int tensor. Absolute position of the first
            query. Defaults to `0`.
        attention_sinks: int >= 0 or `None` (none, as a layer's
            `attention_sinks=None`). Number of leading keys every query may
            attend to, however far. Defaults to `0`.

    Returns:
        Bool tensor `(query_length, key_length)`, True where attention is allowed.

    Example:
    >>> mask = keras_attn.ops.sliding_window_mask(4, 4, window=2)
    >>> keras.ops.convert_to_numpy(mask).astype(int)
    array([[1, 1, 0, 0],
           [1, 1, 1, 0],
           [0, 1, 1, 1],
           [0, 0, 1, 1]])
    >>> causal = keras_attn.ops.causal_mask(5, 5)
    >>> sinks = keras_attn.ops.sliding_window_mask(5, 5, 2, attention_sinks=1)
    >>> keras.ops.convert_to_numpy(keras.ops.logical_and(causal, sinks)).astype(int)
    array([[1, 0, 0, 0, 0],
           [1, 1, 0, 0, 0],
           [1, 1, 1, 0, 0],
           [1, 0, 1, 1, 0],
           [1, 0, 0, 1, 1]])
    """
    _check_positions(query_length, key_length, query_offset)
    check_positive_int("window", window)
    sinks = check_count("attention_sinks", attention_sinks, allow_none=True) or 0
    return window_band(query_length, key_length, window, query_offset, sinks)


def window_band(query_length, key_length, window, query_offset=0, sinks=0):
    """`sliding_window_mask` without its checks, for callers that checked."""
    band = ops.abs(offsets(query_length, key_length, query_offset)) < window
    return ops.logical_or(band, sink_keys(key_length, sinks)) if sinks else band


def sink_keys(key_length, sinks, padding=None):
    """The attention sinks, `(1, S)`: the first `sinks` keys; with a key
    `padding` mask `(B, S)` (True for real keys), `(B, 1, S)`: the first
    `sinks` keys of each row counted from its first real key, so that left
    padding moves a row's sinks with its tokens, as it moves nothing else of
    the mask. A row without real keys gets every key (all masked anyway).
    """
    keys = ops.arange(0, key_length, dtype="int32")
    if padding is None:
        return ops.expand_dims(keys < sinks, 0)
    first = ops.min(ops.where(padding, keys, key_length), axis=-1)  # (B,)
    return ops.expand_dims(keys[None, :] < ops.expand_dims(first + sinks, 1), 1)


def segment_mask(query_segment_ids, key_segment_ids=None):
    """Boolean mask of packed sequences: query `i` may attend to key `j` only
    where both belong to the same segment (document).

    Self-attention (no `key_segment_ids`): a segment is a contiguous run of
    equal ids, as for `segment_positions` and the attention sinks; an id
    that comes back later starts a new document (`[5, 5, 2, 5]` is three).
    With `key_segment_ids` (the keys of another sequence, whose runs cannot
    be matched to the queries' by position) the ids are compared by value:
    an id then names one document on each side. Padding is not
    special-cased (mask it with a padding mask). The mask is quadratic in
    the length; the attention op and the layers take `segment_ids`
    themselves and build it only where the plan materializes the weights
    (in chunks for long sequences).

    Args:
        query_segment_ids: int tensor `(batch, query_length)`.
        key_segment_ids: int tensor `(batch, key_length)`. Defaults to
            `query_segment_ids` (self-attention, by runs).

    Returns:
        Bool tensor `(batch, 1, query_length, key_length)`, True where
        attention is allowed.

    Example:
    >>> ids = np.array([[1, 1, 2, 1]])  # three documents: the 1s are two
    >>> keras.ops.convert_to_numpy(keras_attn.ops.segment_mask(ids))[0, 0].astype(int)
    array([[1, 1, 0, 0],
           [1, 1, 0, 0],
           [0, 0, 1, 0],
           [0, 0, 0, 1]])
    """
    check_segment_ids("query_segment_ids", query_segment_ids)
    if key_segment_ids is None:
        runs = segment_runs(query_segment_ids)  # (B, T)
        return same_segment(runs, runs)
    check_segment_ids(
        "key_segment_ids",
        key_segment_ids,
        (query_segment_ids.shape[0], None),
        "(batch, key_length)",
    )
    return same_segment(query_segment_ids, key_segment_ids)


def same_segment(query_segments, key_segments):
    """`segment_mask` without its checks, on the segments to compare (run
    numbers `segment_runs` in self-attention): `(B, 1, T, S)` from `(B, T)`
    and `(B, S)` (or `(B, N)` rows of one chunk)."""
    query_ids = ops.expand_dims(ops.convert_to_tensor(query_segments), (1, 3))
    key_ids = ops.expand_dims(ops.convert_to_tensor(key_segments), (1, 2))
    return ops.equal(query_ids, key_ids)  # (B, 1, T, S)


def _check_positions(query_length, key_length, query_offset):
    """Raise unless the lengths and the offset are ints >= 0 or scalar int
    tensors (not read: they may be traced)."""
    check_size("query_length", query_length)
    check_size("key_length", key_length)
    check_size("query_offset", query_offset)


def _alibi_slopes(num_heads, max_bias):
    """The per-head slopes of Press et al. (2022), `H` Python floats.

    For a power of two `n`, the geometric sequence starting at and with ratio
    `2**(-max_bias / n)`; otherwise the slopes of the closest smaller power of
    two, then every other slope of the next power of two (the paper's code).
    """
    closest = 2 ** math.floor(math.log2(num_heads))

    def geometric(n):
        start = 2.0 ** (-max_bias / n)
        return [start ** (i + 1) for i in range(n)]

    extra = geometric(2 * closest)[0::2][: num_heads - closest]
    return geometric(closest) + extra


def alibi_bias(num_heads, query_length, key_length, query_offset=0, max_bias=8.0):
    """ALiBi's linear attention bias (Press et al., 2022), to add to the logits.

    `bias[h, i, j] = -slope_h * |i + query_offset - j|`, with the paper's
    head slopes (`1/2, 1/4, ..., 1/256` for 8 heads). Under a causal mask this
    is the paper's `-slope_h * (i - j)`; without one it penalizes distance in
    both directions. Pass it as `attention_bias` to
    `keras_attn.MultiHeadAttention` or as `bias` to `dot_product_attention`.

    Args:
        num_heads: int. Number of query heads.
        query_length: int >= 0 or scalar int tensor. Number of query positions.
        key_length: int >= 0 or scalar int tensor. Number of key positions.
        query_offset: int >= 0 or scalar int tensor. Absolute position of the first
            query, e.g. the cache index in step-by-step decoding. Defaults
            to `0`.
        max_bias: float > 0. The slopes are `2**(-max_bias * k / num_heads)`.
            Defaults to `8.0`, the paper's value.

    Returns:
        Float32 tensor `(1, num_heads, query_length, key_length)`.

    Example:
    >>> bias = keras_attn.ops.alibi_bias(num_heads=2, query_length=3, key_length=3)
    >>> keras.ops.convert_to_numpy(bias)[0, 0].tolist()
    [[0.0, -0.0625, -0.125], [-0.0625, 0.0, -0.0625], [-0.125, -0.0625, 0.0]]
    """
    check_positive_int("num_heads", num_heads)
    _check_positions(query_length, key_length, query_offset)
    check_positive_float("max_bias", max_bias)
    distance = ops.abs(offsets(query_length, key_length, query_offset))
    slopes = constant(_alibi_slopes(num_heads, max_bias), "float32", distance)
    minus_distance = ops.cast(-distance, "float32")  # 0, not -0, on the diagonal
    return ops.reshape(slopes, (1, -1, 1, 1)) * ops.expand_dims(minus_distance, (0, 1))


def merge_attention_masks(*masks):
    """AND any number of boolean attention masks into one `(B|1, H|1, T, S)` mask.

    Each mask is `None` (skipped) or a bool tensor of rank 2 `(T, S)`, rank 3
    `(B, T, S)` or rank 4 `(B, H, T, S)`, where any axis may be 1 to
    broadcast. True means "may attend". A key padding mask `(B, S)` enters as
    `padding[:, None, :]`.

    Args:
        *masks: bool tensors of rank 2 to 4, or `None`.

    Returns:
        Bool tensor of rank 4, or `None` when every mask is `None`.

    Example:
    >>> padding = np.array([[True, True, False]])
    >>> causal = np.tril(np.ones((3, 3), bool))
    >>> mask = keras_attn.ops.merge_attention_masks(padding[:, None, :], causal)
    >>> keras.ops.convert_to_numpy(mask)[0, 0].astype(int)
    array([[1, 0, 0],
           [1, 1, 0],
           [1, 1, 0]])
    """
    masks = [cast_to(mask, "bool") for mask in masks if mask is not None]
    for mask in masks:
        if len(mask.shape) not in (2, 3, 4):
            raise ValueError(
                "Attention masks must have rank 2 `(T, S)`, 3 `(B, T, S)` or 4 "
                f"`(B, H, T, S)`. Received: mask.shape={tuple(mask.shape)}."
            )
    # Those of rank 2 and 3 broadcast together as they are (`(T, S)` as
    # `(1, T, S)`); their AND gets its head axis once, not each of them.
    low = _and([mask for mask in masks if len(mask.shape) < 4])
    if low is not None:
        low = ops.expand_dims(low, (0, 1) if len(low.shape) == 2 else 1)
    return _and([low, *(mask for mask in masks if len(mask.shape) == 4)])


def _and(masks):
    """The AND of the masks that are not `None` (broadcast), or `None`."""
    merged = None
    for mask in masks:
        if mask is not None:
            merged = mask if merged is None else merged & mask  # as `|` below
    return merged


def open_empty_rows(mask):
    """`(mask with its empty rows opened, rows_with_any_key)` for a rank-4 mask.

    A query row whose mask allows no key would softmax over nothing (NaN);
    opened, it computes something finite, which `zero_empty_rows` then zeros.
    """
    has_key = ops.any(mask, axis=-1, keepdims=True)  # (B, 1|H, T, 1)
    # Operators, not `ops.logical_or`: the same op on every backend, without
    # the no-op conversions of each argument that Keras' op costs on PyTorch.
    return mask | ~has_key, has_key


def zero_empty_rows(output, probs, has_key):
    """Zero the output `(B, T, H, D)` and weights of rows with no allowed key."""
    if has_key is None:
        return output, probs
    keep = ops.transpose(has_key, (0, 2, 1, 3))  # (B, T, 1|H, 1)
    output = ops.where(keep, output, 0.0)  # a weak scalar: the output's dtype
    if probs is not None:
        probs = ops.where(has_key, probs, 0.0)
    return output, probs
