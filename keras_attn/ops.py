"""Pure `keras.ops` functions behind the layers: attention, masks, positions.

Every function here is stateless and backend-agnostic. Shapes use `B` batch,
`T`/`S` query/key length, `H` heads, `K` key/value heads, `D` per-head width.
"""

import math

import keras
import numpy as np
from keras import ops

__all__ = [
    "alibi_bias",
    "causal_mask",
    "dot_product_attention",
    "merge_attention_masks",
    "rotary_embedding",
    "sinusoidal_position_encoding",
    "sliding_window_mask",
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
    inverse_frequency = _inverse_frequencies(
        max_wavelength, [2 * (channel // 2) / dim for channel in range(dim)]
    )  # (dim,)
    start = ops.cast(start_index, "float32")
    positions = ops.arange(0, length, dtype="float32")  # (T,)
    if len(start.shape) == 1:
        positions = ops.expand_dims(positions, 0) + ops.expand_dims(start, 1)  # (B, T)
    else:
        positions = positions + start
    angles = ops.expand_dims(positions, -1) * inverse_frequency
    even = ops.convert_to_tensor([c % 2 == 0 for c in range(dim)], dtype="bool")
    return ops.cast(ops.where(even, ops.sin(angles), ops.cos(angles)), dtype)


def rotary_embedding(x, positions, max_wavelength=10000.0, scaling_factor=1.0):
    """Rotary position embedding (Su et al. 2021), LLaMA's "rotate half" form.

    Channel `i` of the first half and channel `i` of the second half of each
    head form a pair, rotated by the angle `position / scaling_factor *
    max_wavelength**(-2i / D)`: `x1 cos - x2 sin`, `x2 cos + x1 sin`. This is
    the convention of LLaMA and keras-hub's `RotaryEmbedding`. The inverse
    frequencies are rounded once from float64 and the angles are computed in
    float32 (as `sinusoidal_position_encoding` does), so every backend rotates
    by the same float32 angles; the result has the dtype of `x`.

    Args:
        x: float tensor `(B, T, H, D)` with an even `D`.
        positions: int or float tensor `(T,)` (every row) or `(B, T)` (per
            row, e.g. left-padded prompts).
        max_wavelength: float > 0. Base of the wavelengths. Defaults to
            `10000.0`.
        scaling_factor: float > 0. Positions are divided by it (linear
            position interpolation, for contexts longer than trained on).
            Defaults to `1.0`.

    Returns:
        Tensor of the shape and dtype of `x`.

    Example:
    >>> x = np.ones((1, 3, 2, 4), "float32")
    >>> y = keras_attn.ops.rotary_embedding(x, np.arange(3))
    >>> tuple(y.shape)
    (1, 3, 2, 4)
    >>> bool(np.allclose(keras.ops.convert_to_numpy(y)[0, 0], 1.0))  # position 0
    True
    """
    positions = ops.cast(ops.convert_to_tensor(positions), "float32")
    _check_rotary(x, positions, max_wavelength, scaling_factor)
    dim = x.shape[-1]
    inverse_frequency = _inverse_frequencies(
        max_wavelength, [i / dim for i in range(0, dim, 2)], scaling_factor
    )  # (D/2,)
    if len(positions.shape) == 1:
        positions = ops.expand_dims(positions, 0)  # (1, T)
    angles = ops.expand_dims(positions, -1) * inverse_frequency  # (B|1, T, D/2)
    angles = ops.expand_dims(ops.concatenate([angles, angles], axis=-1), 2)
    cos, sin = ops.cos(angles), ops.sin(angles)  # (B|1, T, 1, D)
    x1, x2 = ops.split(x, 2, axis=-1)
    rotated = ops.concatenate([-x2, x1], axis=-1)
    wide = _at_least_float32(x.dtype)
    cos, sin = ops.cast(cos, wide), ops.cast(sin, wide)
    output = ops.cast(x, wide) * cos + ops.cast(rotated, wide) * sin
    return ops.cast(output, x.dtype)


def _inverse_frequencies(max_wavelength, exponents, scaling_factor=1.0):
    """Float32 tensor of `max_wavelength**(-e) / scaling_factor` for each
    exponent `e`, computed in float64 (Python floats) and rounded once.

    Python floats rather than numpy: a constant that `torch.compile` folds,
    where a numpy array breaks the graph (Keras' `convert_to_tensor` of an
    ndarray is not traceable).
    """
    base, scaling_factor = float(max_wavelength), float(scaling_factor)
    values = [base**-exponent / scaling_factor for exponent in exponents]
    return ops.convert_to_tensor(values, dtype="float32")


def _check_rotary(x, positions, max_wavelength, scaling_factor):
    dim = x.shape[-1]
    if len(x.shape) != 4 or dim is None or dim % 2:
        raise ValueError(
            "`rotary_embedding` needs `x` of shape (batch, length, heads, dim) "
            "with an even, known `dim` (channels rotate in pairs). "
            f"Received: x.shape={tuple(x.shape)}."
        )
    shape = tuple(positions.shape)
    expected = {1: (x.shape[1],), 2: (x.shape[0], x.shape[1])}.get(len(shape))
    if len(shape) == 2 and shape[0] == 1:  # (1, length): every row
        expected = (1, x.shape[1])
    if expected is None or any(
        isinstance(a, int) and isinstance(b, int) and a != b
        for a, b in zip(shape, expected, strict=True)
    ):
        raise ValueError(
            "`positions` must be (length,) or (batch, length), or (1, length), "
            f"for x.shape={tuple(x.shape)}. Received: positions.shape={shape}."
        )
    # Imported here: `keras_attn.layers` imports this module at load time.
    from keras_attn.layers._utils import check_positive_float

    check_positive_float("max_wavelength", max_wavelength)
    check_positive_float("scaling_factor", scaling_factor)


def _offsets(query_length, key_length, query_offset):
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
    return _offsets(query_length, key_length, query_offset) <= 0


def sliding_window_mask(query_length, key_length, window, query_offset=0):
    """Boolean band: query `i` may attend to keys within `window - 1` positions.

    Key `j` is allowed where `|i + query_offset - j| < window`, the symmetric
    band of Keras' `MultiHeadAttention(sliding_window=...)`. ANDed with
    `causal_mask`, it is the causal sliding window of Mistral (each query sees
    itself and the `window - 1` keys before it).

    Args:
        query_length: int or scalar tensor. Number of query positions.
        key_length: int or scalar tensor. Number of key positions.
        window: int >= 1. Width of the band on each side, the query included.
        query_offset: int or scalar tensor. Absolute position of the first
            query. Defaults to `0`.

    Returns:
        Bool tensor `(query_length, key_length)`, True where attention is allowed.

    Example:
    >>> mask = keras_attn.ops.sliding_window_mask(4, 4, window=2)
    >>> keras.ops.convert_to_numpy(mask).astype(int)
    array([[1, 1, 0, 0],
           [1, 1, 1, 0],
           [0, 1, 1, 1],
           [0, 0, 1, 1]])
    """
    return ops.abs(_offsets(query_length, key_length, query_offset)) < window


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
        query_length: int or scalar tensor. Number of query positions.
        key_length: int or scalar tensor. Number of key positions.
        query_offset: int or scalar tensor. Absolute position of the first
            query, e.g. the cache index in step-by-step decoding. Defaults
            to `0`.
        max_bias: float. The slopes are `2**(-max_bias * k / num_heads)`.
            Defaults to `8.0`, the paper's value.

    Returns:
        Float32 tensor `(1, num_heads, query_length, key_length)`.

    Example:
    >>> bias = keras_attn.ops.alibi_bias(num_heads=2, query_length=3, key_length=3)
    >>> keras.ops.convert_to_numpy(bias)[0, 0].tolist()
    [[0.0, -0.0625, -0.125], [-0.0625, 0.0, -0.0625], [-0.125, -0.0625, 0.0]]
    """
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1:
        raise ValueError(
            f"`num_heads` must be a positive int. Received: {num_heads!r}."
        )
    # Python floats, not numpy: a constant under `torch.compile`.
    slopes = ops.convert_to_tensor(_alibi_slopes(num_heads, max_bias), "float32")
    offsets = _offsets(query_length, key_length, query_offset)
    minus_distance = ops.cast(
        -ops.abs(offsets), "float32"
    )  # 0, not -0, on the diagonal
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
    merged = None
    for mask in masks:
        if mask is None:
            continue
        mask = ops.cast(mask, "bool")
        rank = len(mask.shape)
        if rank not in (2, 3, 4):
            raise ValueError(
                "Attention masks must have rank 2 `(T, S)`, 3 `(B, T, S)` or 4 "
                f"`(B, H, T, S)`. Received: mask.shape={tuple(mask.shape)}."
            )
        mask = ops.expand_dims(mask, (0, 1) if rank == 2 else 1) if rank < 4 else mask
        merged = mask if merged is None else ops.logical_and(merged, mask)
    return merged


def _attends_to_something(mask):
    """`(mask with empty rows opened, rows_with_any_key)` for a rank-4 mask."""
    has_key = ops.any(mask, axis=-1, keepdims=True)  # (B, 1|H, T, 1)
    return ops.logical_or(mask, ops.logical_not(has_key)), has_key


def _zero_empty_rows(output, probs, has_key):
    """Zero the output `(B, T, H, D)` and weights of rows with no allowed key."""
    if has_key is None:
        return output, probs
    keep = ops.transpose(has_key, (0, 2, 1, 3))  # (B, T, 1|H, 1)
    output = ops.where(keep, output, ops.zeros_like(output))
    if probs is not None:
        probs = ops.where(has_key, probs, ops.zeros_like(probs))
    return output, probs


# The explicit path goes in chunks of query rows from `_CHUNKED_FROM` logits
# per batch row (`H * T * S`: usually two chunks or more; 2,897 tokens for 8 heads),
# each chunk of about `_CHUNK_LOGITS` logits (at least `_MIN_CHUNK_ROWS`
# rows), recomputed in the backward pass (`benchmarks/long_sequence.py`).
# 2**25 float32 logits are 128 MiB per batch row. Chunks of 2**23 took about
# twice as long on a CPU (skinny matmuls), and under 32 MiB (glibc's largest
# threshold for memory it maps itself) they left each chunk's freed memory
# resident on TensorFlow and PyTorch.
_CHUNKED_FROM = 2**26
_CHUNK_LOGITS = 2**25
_MIN_CHUNK_ROWS = 16


def _choose_kernel(query, key, value, mask, bias, options):
    """The dispatcher: `"fused"` (`keras.ops.dot_product_attention`), or the
    explicit path, `"materialized"` or `"chunked"`.

    The rules, in order. Correctness limits first: where `flash_attention=True`
    asks for what they rule out, it raises rather than falling back.

    1. `flash_attention=False`: explicit.
    2. Dropout on the weights (training), returning the weights, values of
       another width than the keys, soft-capped logits, or float64 (Keras'
       fused op returns float32 for it on JAX and PyTorch): explicit; with
       `flash_attention=True`, a `ValueError`.
    3. `flash_attention=True`: fused (the backend raises where it has no
       flash kernel, e.g. on a CPU or under TensorFlow).
    4. TensorFlow: explicit. Keras has no fused TensorFlow kernel, and its op
       fails for one key/value head and forms half-precision logits (which
       overflow float16 to NaN).
    5. JAX on a CPU, with at least `_CHUNKED_FROM` logits per batch row:
       explicit, in chunks. XLA's CPU attention materializes the logits and
       keeps them for the gradient (memory rule: `benchmarks/long_sequence.py`).
    6. Otherwise: fused, heads-major caches too. On PyTorch that is torch's
       own `scaled_dot_product_attention` with torch's kernel choice (no
       kernel pinned), grouped key/value heads unrepeated, and causal
       attention without padding as `is_causal=True` and no mask; elsewhere
       `keras.ops.dot_product_attention`.

    The explicit path materializes the weights, unless it may go in chunks:
    no dropout, no returned weights, static lengths, and at least
    `_CHUNKED_FROM` logits per batch row (`H * T * S`).

    No speed rule: none measured wins by 10%. Reading a heads-major cache in
    place in a decoding step was one; `benchmarks/dispatch.py` finds it level
    with the fused kernel on JAX and slower on PyTorch.
    """
    flash_attention = options["flash_attention"]
    reasons = {
        "dropout on the attention weights": options["dropout"] is not None,
        "returning the attention weights": options["return_scores"],
        "values of another width than the keys": _differ(
            value.shape[-1], query.shape[-1]
        ),
        "soft-capped logits": options["logit_soft_cap"] is not None,
        "float64 inputs": keras.backend.standardize_dtype(query.dtype) == "float64",
    }
    needs_explicit = [reason for reason, applies in reasons.items() if applies]
    if needs_explicit and flash_attention:
        raise ValueError(
            "`flash_attention=True` needs the fused flash kernel, which cannot "
            f"compute attention with {' or '.join(needs_explicit)}. Pass "
            "`flash_attention=None` (fused where possible) or `False`."
        )
    if flash_attention:
        return "fused"
    chunks = _rows_per_chunk(query, key, mask, bias, options)
    backend = keras.config.backend()
    explicit = (
        flash_attention is False
        or needs_explicit
        or backend == "tensorflow"
        or (backend == "jax" and chunks and _on_cpu())
    )
    if not explicit:
        return "fused"
    return "chunked" if chunks else "materialized"


def _rows_per_chunk(query, key, mask, bias, options):
    """Query rows per chunk of the explicit path, or `None` to materialize."""
    if options["dropout"] is not None or options["return_scores"]:
        return None
    length, heads = query.shape[1], query.shape[2]
    key_length = key.shape[_key_axis(options)]
    broadcast = [x.shape[2:] for x in (mask, bias) if x is not None]
    if not all(isinstance(n, int) for n in (length, heads, key_length)) or any(
        None in shape for shape in broadcast
    ):
        return None
    if heads * length * key_length < _CHUNKED_FROM:
        return None
    return min(length, max(_MIN_CHUNK_ROWS, _CHUNK_LOGITS // (heads * key_length)))


_PLATFORM = {}


def _on_cpu():
    """Whether Keras runs on a CPU (asked once: the backend is fixed per process)."""
    if "cpu" not in _PLATFORM:
        device = keras.distribution.list_devices()[0]
        _PLATFORM["cpu"] = device.split(":")[0].lower() == "cpu"
    return _PLATFORM["cpu"]


def _differ(a, b):
    return isinstance(a, int) and isinstance(b, int) and a != b


def _grouped_einsums(num_heads, num_key_value_heads, heads_major):
    """The explicit path's two einsums, for either key/value layout.

    Query heads `h = k * G + g` share key/value head `k` (`G` = heads per
    key/value head), matched by a reshape rather than a repeat.
    """
    keys = "bksd" if heads_major else "bskd"
    if num_heads == num_key_value_heads:
        keys = keys.replace("k", "h")
        return f"bthd,{keys}->bhts", f"bhts,{keys}->bthd"
    return f"btkgd,{keys}->bkgts", f"bkgts,{keys}->btkgd"


def _at_least_float32(dtype):
    """The dtype of logits and softmax: float32, or float64 for float64."""
    return (
        "float64" if keras.backend.standardize_dtype(dtype) == "float64" else "float32"
    )


def _masked_softmax(logits, mask, dtype):
    """Softmax of `logits` over the keys `mask` allows, cast to `dtype`."""
    if mask is not None:
        lowest = np.finfo(keras.backend.standardize_dtype(logits.dtype)).min
        logits = ops.where(mask, logits, lowest)
    return ops.cast(ops.softmax(logits, axis=-1), dtype)


def _explicit_attention(query, key, value, mask, bias, dropout, heads_major, soft_cap):
    """Materialized softmax(cap(QK^T) + bias) V, logits and softmax in float32
    (float64 for float64 inputs).

    `query` `(B, T, H, D)` (already scaled); `key`, `value` `(B, S, K, D)`, or
    `(B, K, S, D)` with `heads_major`. Returns `(output (B, T, H, Dv),
    weights (B, H, T, S))`.
    """
    batch, query_length, num_heads, head_dim = ops.shape(query)
    num_key_value_heads = key.shape[1 if heads_major else 2]
    key_length = ops.shape(key)[2 if heads_major else 1]
    groups = num_heads // num_key_value_heads
    scores_equation, combine_equation = _grouped_einsums(
        num_heads, num_key_value_heads, heads_major
    )
    wide = _at_least_float32(query.dtype)
    query = ops.cast(query, wide)
    if groups > 1:
        query = ops.reshape(
            query, (batch, query_length, num_key_value_heads, groups, head_dim)
        )
    logits = ops.einsum(scores_equation, query, ops.cast(key, wide))
    logits = ops.reshape(logits, (batch, num_heads, query_length, key_length))
    if soft_cap is not None:  # Gemma 2: cap * tanh(logits / cap)
        logits = ops.tanh(logits / soft_cap) * soft_cap
    if bias is not None:
        logits = logits + ops.cast(bias, wide)
    probs = _masked_softmax(logits, mask, value.dtype)
    weights = probs if dropout is None else dropout(probs)
    if groups > 1:
        weights = ops.reshape(
            weights, (batch, num_key_value_heads, groups, query_length, key_length)
        )
    output = ops.einsum(combine_equation, weights, value)
    return ops.reshape(output, (batch, query_length, num_heads, -1)), probs


def _explicit_rows(query, key, value, mask, bias, causal_offset, options):
    """The explicit path for query rows at `causal_offset` (`None`: not causal).

    Returns `(output (B, T, H, Dv), weights (B, H, T, S))`; rows whose mask
    allows no key give zeros.
    """
    if causal_offset is not None:  # folded in, so that empty rows are found
        length, key_length = ops.shape(query)[1], ops.shape(key)[_key_axis(options)]
        mask = merge_attention_masks(
            mask, causal_mask(length, key_length, query_offset=causal_offset)
        )
    has_key = None
    if mask is not None:
        mask, has_key = _attends_to_something(mask)
    output, probs = _explicit_attention(
        query,
        key,
        value,
        mask,
        bias,
        options["dropout"],
        options["heads_major"],
        options["logit_soft_cap"],
    )
    return _zero_empty_rows(output, probs, has_key)


def _key_axis(options):
    return 2 if options["heads_major"] else 1


def _chunked_attention(query, key, value, mask, bias, is_causal, options):
    """The explicit path in chunks of query rows, one chunk at a time
    (`ops.scan`), each recomputed in the backward pass (`keras.remat`): memory
    linear in the length.

    Every chunk sees all its keys, so its softmax is the materialized one, row
    for row. The rows are padded to whole chunks, and the padding cut off.
    """
    length = query.shape[1]
    rows = _rows_per_chunk(query, key, mask, bias, options)
    count = -(-length // rows)
    rows = -(-length // count)  # the fewest padded rows for `count` chunks
    chunked = {"query": _in_chunks(query, 1, count, rows)}  # (N, B, C, H, D)
    for name, x in (("mask", mask), ("bias", bias)):
        if x is not None and x.shape[2] != 1:  # per query row: chunked too
            chunked[name] = _in_chunks(x, 2, count, rows)  # (N, B, H|1, C, S)
    if is_causal:  # each chunk's first row
        chunked["offset"] = ops.arange(0, count * rows, rows, dtype="int32")

    def one_chunk(chunk):
        given = {"mask": mask, "bias": bias, "offset": None, **chunk}

        def attend(query, key, value, *bias):
            # What may need a gradient is an argument (TF's `recompute_grad`
            # differentiates those only); boolean and integer inputs are not
            # (it cannot).
            bias = bias[0] if bias else None
            return _explicit_rows(
                query, key, value, given["mask"], bias, given["offset"], options
            )[0]

        extra = [] if given["bias"] is None else [given["bias"]]
        return keras.remat(attend)(given["query"], key, value, *extra)

    def step(previous, chunk):
        output = one_chunk(chunk)
        return output, output

    # `ops.scan`, not `ops.map`: TensorFlow's map runs 10 chunks at once. Its
    # scan wants outputs shaped like the carry, which is the previous chunk's
    # output (unused).
    batch, heads, width = ops.shape(query)[0], query.shape[2], value.shape[-1]
    first = ops.zeros((batch, rows, heads, width), dtype=value.dtype)
    _, output = ops.scan(step, first, chunked)  # (N, B, C, H, Dv)
    output = ops.reshape(
        ops.moveaxis(output, 0, 1), (-1, count * rows, *output.shape[3:])
    )
    return output[:, :length]


def _in_chunks(x, axis, count, rows):
    """`x` with `axis` padded to `count * rows` and split: `(count, ..., rows, ...)`."""
    padding = [(0, 0)] * len(x.shape)
    padding[axis] = (0, count * rows - x.shape[axis])
    x = ops.pad(
        x, padding, constant_values=keras.backend.standardize_dtype(x.dtype) == "bool"
    )
    shape = list(ops.shape(x))
    x = ops.reshape(x, shape[:axis] + [count, rows] + shape[axis + 1 :])
    return ops.moveaxis(x, axis, 0)


def _fused_path(query, key, value, mask, bias, is_causal, options):
    """The fused kernel, with a causal mask folded into a padding mask (so
    that rows left empty by both are found, and give zeros)."""
    if is_causal and mask is not None:
        length, key_length = ops.shape(query)[1], ops.shape(key)[_key_axis(options)]
        mask = merge_attention_masks(mask, causal_mask(length, key_length))
        is_causal = False
    has_key = None
    if mask is not None:
        mask, has_key = _attends_to_something(mask)
    if bias is not None:
        bias, mask = _bias_with_mask(bias, mask, query.dtype), None
    output = _fused_attention(query, key, value, mask, bias, is_causal, options)
    return _zero_empty_rows(output, None, has_key)[0]


def _bias_with_mask(bias, mask, dtype):
    """One float bias in `dtype`: the fused kernels take a mask or a bias, not
    both, so a mask goes in as the lowest value where it forbids attention
    (in float32: bfloat16 has no numpy finfo)."""
    if mask is not None:
        lowest = np.finfo("float32").min
        bias = ops.where(mask, ops.cast(bias, "float32"), lowest)
    return ops.cast(bias, dtype)


def _fused_attention(query, key, value, mask, bias, is_causal, options):
    """The backend's fused kernel, given a mask or a bias (or neither).

    On PyTorch, torch's own `scaled_dot_product_attention` with torch's kernel
    choice, grouped heads unrepeated and the cache read in place
    (`keras_attn/_torch_sdpa.py` says why not Keras' op). Elsewhere
    `keras.ops.dot_product_attention` on `(B, S, K, D)` keys and values.
    """
    heads_major, flash_attention = options["heads_major"], options["flash_attention"]
    if keras.config.backend() == "torch":
        from keras_attn import _torch_sdpa

        query, key, value = (ops.convert_to_tensor(x) for x in (query, key, value))
        return _torch_sdpa.attention(
            query, key, value, bias if mask is None else mask, is_causal,
            options["scale"], heads_major, require_fused=bool(flash_attention),
        )  # fmt: skip
    if heads_major:  # Keras' kernels take `(B, S, K, D)`
        key, value = (ops.transpose(x, (0, 2, 1, 3)) for x in (key, value))
    return ops.dot_product_attention(
        query,
        key,
        value,
        bias=bias,
        mask=mask,
        scale=options["scale"],
        is_causal=is_causal,
        flash_attention=flash_attention,
    )


def dot_product_attention(
    query,
    key,
    value,
    mask=None,
    bias=None,
    is_causal=False,
    scale=None,
    flash_attention=None,
    dropout=None,
    return_scores=False,
    heads_major=False,
    logit_soft_cap=None,
):
    """Scaled dot-product attention, softmax(QK^T * scale + bias) V, safely masked.

    One function chooses the kernel (see the table in `_choose_kernel`):
    a fused one (on PyTorch torch's own `scaled_dot_product_attention`, with
    torch's kernel choice; elsewhere `keras.ops.dot_product_attention`, with
    cuDNN/flash kernels where the backend has them) or an explicit path that
    materializes the weights
    with float32 logits and softmax, can apply `dropout` to them and return
    them. For long sequences where no fused kernel runs, the explicit path
    goes in chunks of query rows, each recomputed in the backward pass, so
    that memory grows linearly in the length. All give the same numbers.
    Grouped-query keys and values (`K` heads for `H` query heads) reach
    every kernel unrepeated. A query row
    whose mask allows no key at all attends to nothing: its output and its
    weights are zeros, never NaN.

    Args:
        query: `(B, T, H, D)`.
        key: `(B, S, K, D)`, or `(B, K, S, D)` with `heads_major`; `K` divides
            `H` (grouped-query attention).
        value: `(B, S, K, Dv)`, or `(B, K, S, Dv)` with `heads_major`.
        mask: optional bool of rank 2 `(T, S)`, 3 `(B, T, S)` or 4
            `(B, H, T, S)`, broadcastable; True = may attend.
        bias: optional float, broadcastable to `(B, H, T, S)` as numpy
            broadcasts (so a rank-3 bias is `(H, T, S)`, unlike a rank-3
            mask), added to the scaled logits (e.g. `alibi_bias`). Keep it
            finite; mask with `mask`.
        is_causal: bool. Also apply a lower-triangular mask (query `i` sees
            keys `j <= i`). Defaults to `False`.
        scale: float. Logit scale; defaults to `1 / sqrt(D)`.
        flash_attention: `None` (fused where it computes the same), `True`
            (require a fused kernel; raises where the backend has none for
            the inputs) or `False` (always the explicit path, in chunks for long
            sequences). Defaults to `None`.
        dropout: optional callable applied to the weights; it forces the
            explicit path, so pass it only when dropout is active.
        return_scores: bool. Also return the weights `(B, H, T, S)` (before
            dropout). Defaults to `False`.
        heads_major: bool. Keys and values are `(B, K, S, D)`, the layout of
            the key/value caches. Defaults to `False`.
        logit_soft_cap: optional float > 0. Soft-caps the scaled logits to
            `cap * tanh(logits / cap)` before the bias and the softmax (Gemma
            2); it needs the explicit path. Defaults to `None`.

    Returns:
        `(B, T, H, Dv)`, or `(output, weights)` with `return_scores=True`.

    Example:
    >>> q = np.random.rand(2, 3, 4, 8).astype("float32")
    >>> kv = np.random.rand(2, 5, 2, 8).astype("float32")  # 2 key/value heads
    >>> out = keras_attn.ops.dot_product_attention(q, kv, kv, mask=np.ones((3, 5)))
    >>> tuple(out.shape)
    (2, 3, 4, 8)
    """
    if logit_soft_cap is not None and not logit_soft_cap > 0:
        raise ValueError(
            f"`logit_soft_cap` must be > 0. Received: logit_soft_cap={logit_soft_cap}."
        )
    options = {
        "flash_attention": flash_attention,
        "dropout": dropout,
        "return_scores": return_scores,
        "heads_major": heads_major,
        "logit_soft_cap": logit_soft_cap,
        "scale": 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale,
    }
    mask = merge_attention_masks(mask)
    if bias is not None:  # rank 4, which every backend's fused kernel takes
        bias = ops.reshape(bias, (1,) * (4 - len(bias.shape)) + tuple(ops.shape(bias)))
    kernel = _choose_kernel(query, key, value, mask, bias, options)
    if kernel == "fused":  # the kernel scales the logits
        return _fused_path(query, key, value, mask, bias, is_causal, options)
    # The explicit path scales the query: T x D products rather than T x S.
    dtype = keras.backend.standardize_dtype(query.dtype)
    query = ops.multiply(query, ops.convert_to_tensor(options["scale"], dtype=dtype))
    if kernel == "chunked":
        return _chunked_attention(query, key, value, mask, bias, is_causal, options)
    causal_offset = 0 if is_causal else None
    output, probs = _explicit_rows(
        query, key, value, mask, bias, causal_offset, options
    )
    return (output, probs) if return_scores else output
