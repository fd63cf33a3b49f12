"""Positions: the sinusoidal table of Vaswani et al. and rotary embeddings.

Angles are computed in float32 from inverse frequencies rounded once from
float64 (Python floats), so every backend evaluates the same numbers.
"""

from keras import ops

from keras_attn._checks import check_positive_float, check_positive_int, check_size
from keras_attn.ops.dtypes import at_least_float32

__all__ = ["rotary_embedding", "sinusoidal_position_encoding"]


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
        length: int >= 0 or scalar int tensor. Number of positions.
        dim: int > 0. Width of the encoding.
        max_wavelength: float > 0. The base of the geometric wavelength progression.
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
    check_size("length", length)
    check_positive_int("dim", dim)
    check_positive_float("max_wavelength", max_wavelength)
    check_size("start_index", start_index, ranks=(0, 1), minimum=None)
    return sinusoids(length, dim, max_wavelength, start_index, dtype)


def sinusoids(length, dim, max_wavelength=10000.0, start_index=0, dtype="float32"):
    """`sinusoidal_position_encoding` without its checks, for callers that
    checked (`SinusoidalEmbedding`, once per call)."""
    inverse_frequency = inverse_frequencies(
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
    inverse_frequency = inverse_frequencies(
        max_wavelength, [i / dim for i in range(0, dim, 2)], scaling_factor
    )  # (D/2,)
    if len(positions.shape) == 1:
        positions = ops.expand_dims(positions, 0)  # (1, T)
    angles = ops.expand_dims(positions, -1) * inverse_frequency  # (B|1, T, D/2)
    angles = ops.expand_dims(ops.concatenate([angles, angles], axis=-1), 2)
    cos, sin = ops.cos(angles), ops.sin(angles)  # (B|1, T, 1, D)
    x1, x2 = ops.split(x, 2, axis=-1)
    rotated = ops.concatenate([-x2, x1], axis=-1)
    wide = at_least_float32(x.dtype)
    cos, sin = ops.cast(cos, wide), ops.cast(sin, wide)
    output = ops.cast(x, wide) * cos + ops.cast(rotated, wide) * sin
    return ops.cast(output, x.dtype)


def inverse_frequencies(max_wavelength, exponents, scaling_factor=1.0):
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
    check_positive_float("max_wavelength", max_wavelength)
    check_positive_float("scaling_factor", scaling_factor)
