"""Positions: the sinusoidal table of Vaswani et al. and rotary embeddings.

Angles are computed in float32 from inverse frequencies rounded once from
float64 (Python floats), so every backend evaluates the same numbers.
"""

import math

from keras import ops

from keras_attn import _jax_eager
from keras_attn._checks import (
    check_bool,
    check_positive_float,
    check_positive_int,
    check_segment_ids,
    check_size,
)
from keras_attn.ops.constants import constant
from keras_attn.ops.dtypes import at_least_float32

__all__ = ["rotary_embedding", "segment_positions", "sinusoidal_position_encoding"]

# The keys of a rotary `scaling` dict by its `rope_type` (Hugging Face's
# `rope_scaling` names) and their defaults (keras-hub's `RotaryEmbedding`'s);
# `None`: required.
ROPE_SCALING_KEYS = {
    "linear": {"factor": None},
    "dynamic": {"factor": None},
    "yarn": {
        "factor": None,
        "original_max_position_embeddings": None,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": True,
    },
    "llama3": {
        "factor": None,
        "low_freq_factor": None,
        "high_freq_factor": None,
        "original_max_position_embeddings": None,
    },
}
# Keys a `scaling` dict may give that have no fixed default: when absent, the
# scaling computes them (YaRN's factor of cos and sin: `0.1 ln(factor) + 1`).
ROPE_SCALING_COMPUTED_KEYS = {"yarn": ("attention_factor",)}


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
    positions = position_ids(length, start_index, "float32")  # (T,) or (B, T)
    exponents = [2 * (channel // 2) / dim for channel in range(dim)]
    inverse_frequency = constant(
        inverse_frequencies(max_wavelength, exponents), "float32", positions
    )  # (dim,)
    angles = ops.expand_dims(positions, -1) * inverse_frequency
    even = constant([c % 2 == 0 for c in range(dim)], "bool", positions)
    return ops.cast(ops.where(even, ops.sin(angles), ops.cos(angles)), dtype)


def position_ids(length, start_index=0, dtype="int32"):
    """Positions `start_index, ..., start_index + length - 1` in `dtype`:
    `(length,)` for a scalar start, `(batch, length)` for one start per row
    (`start_index` of shape `(batch,)`). Unchecked, for callers that
    checked `start_index` (`check_size`)."""
    start = ops.cast(start_index, dtype)
    positions = ops.arange(0, length, dtype=dtype)  # (T,)
    if len(start.shape) == 1:  # (B, 1) + (T,): they broadcast
        return ops.expand_dims(start, 1) + positions  # (B, T)
    return positions + start


def segment_positions(segment_ids):
    """Positions that restart at each segment of a packed row: `i` minus the
    index of the first token of its run of equal ids.

    A segment is a contiguous run of equal ids (the packed documents); the
    positions of each start at 0. Linear in the length (no `(T, T)` matrix):
    each run's start is found by sorting the starts, so it traces under
    `jit` on every backend.

    Args:
        segment_ids: int tensor `(batch, length)`.

    Returns:
        Int32 tensor `(batch, length)`.

    Example:
    >>> ids = np.array([[7, 7, 7, 2, 2, 5]])
    >>> keras.ops.convert_to_numpy(keras_attn.ops.segment_positions(ids))
    array([[0, 1, 2, 0, 1, 0]], dtype=int32)
    """
    check_segment_ids("segment_ids", segment_ids)
    return positions_in_runs(segment_runs(segment_ids))


def positions_in_runs(runs):
    """Each token's position in its run `(B, T)`, from the run numbers
    `segment_runs` gives (for callers that have them already)."""
    length = ops.shape(runs)[1]
    index = ops.arange(0, length, dtype="int32")  # (T,)
    # The starts in order, then `length` for every other token: (B, T)
    is_start = _run_starts(runs)  # runs change where the ids do
    starts = ops.sort(ops.where(is_start, ops.expand_dims(index, 0), length), axis=1)
    # `ops.subtract`: a JAX array's `-` refuses a `KerasTensor` (`keras.Input`).
    return ops.subtract(index, ops.take_along_axis(starts, runs - 1, axis=1))


def segment_runs(segment_ids):
    """Each token's segment, numbered by its run of equal ids in the row
    `(B, T)` int32, from 1: `[5, 5, 2, 2, 5]` gives `[1, 1, 2, 2, 3]`. An id
    that comes back later starts a new segment, as it does for the
    positions and the sinks; the segment mask compares these numbers."""
    is_start = _run_starts(ops.convert_to_tensor(segment_ids))
    return ops.cumsum(ops.cast(is_start, "int32"), axis=1)


def _run_starts(ids):
    """Whether each token `(B, T)` starts a run of equal ids."""
    changed = ops.not_equal(ids[:, 1:], ids[:, :-1])  # (B, T - 1)
    return ops.concatenate([ops.ones_like(changed[:, :1]), changed], axis=1)


def rotary_embedding(
    x, positions, max_wavelength=10000.0, scaling_factor=1.0, scaling=None
):
    """Rotary position embedding (Su et al. 2021), LLaMA's "rotate half" form.

    Channel `i` of the first half and channel `i` of the second half of each
    head form a pair, rotated by the angle `position / scaling_factor *
    max_wavelength**(-2i / D)`: `x1 cos - x2 sin`, `x2 cos + x1 sin`. This is
    the convention of LLaMA and keras-hub's `RotaryEmbedding`. The inverse
    frequencies (and YaRN's attention factor) are computed in float64 and
    rounded once, and the angles are computed in float32 (as
    `sinusoidal_position_encoding` does), so every backend rotates by the
    same float32 angles; the result has the dtype of `x`.

    `scaling` takes Hugging Face's `rope_scaling` dicts, computed as
    keras-hub computes them:

    - `{"rope_type": "linear", "factor": f}`: positions divided by `f` (as
      `scaling_factor=f`).
    - `{"rope_type": "dynamic", "factor": f}`: NTK-aware scaling as
      keras-hub's `RotaryEmbedding(rope_type="dynamic")`, inverse frequencies
      divided by `f**(D / (D - 2))`. Static: unlike Hugging Face's dynamic
      NTK, it does not change with the sequence length.
    - `{"rope_type": "yarn", "factor": f, "original_max_position_embeddings":
      n, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": True,
      "attention_factor": a}` (the last four optional, with these defaults):
      YaRN (Peng et al. 2023) as keras-hub's `RotaryEmbedding(rope_type=
      "yarn")` and transformers' `"yarn"`, the frequencies ramped between
      interpolated and original over the channels between the corrections
      of `beta_fast` and `beta_slow` rotations, and cos and sin multiplied
      by `a`, by default `0.1 * ln(f) + 1` (DeepSeek-V3's `mscale` ratio
      gives another: transformers' `attention_factor`).
    - `{"rope_type": "llama3", "factor": f, "low_freq_factor": l,
      "high_freq_factor": h, "original_max_position_embeddings": n}`: Llama
      3.1's adjustment as keras-hub's `LlamaRotaryEmbedding`: wavelengths
      over `n / l` divided by `f`, under `n / h` kept, smoothly between.

    Args:
        x: float tensor `(B, T, H, D)` with an even `D`.
        positions: int or float tensor `(T,)` (every row) or `(B, T)` (per
            row, e.g. left-padded prompts).
        max_wavelength: float > 0. Base of the wavelengths. Defaults to
            `10000.0`.
        scaling_factor: float > 0. Positions are divided by it (linear
            position interpolation, for contexts longer than trained on).
            Defaults to `1.0`.
        scaling: optional dict, one of the above (not with a
            `scaling_factor` other than `1.0`). Defaults to `None`.

    Returns:
        Tensor of the shape and dtype of `x`.

    Example:
    >>> x = np.ones((1, 3, 2, 4), "float32")
    >>> y = keras_attn.ops.rotary_embedding(x, np.arange(3))
    >>> tuple(y.shape)
    (1, 3, 2, 4)
    >>> bool(np.allclose(keras.ops.convert_to_numpy(y)[0, 0], 1.0))  # position 0
    True
    >>> yarn = {"rope_type": "yarn", "factor": 4.0,
    ...         "original_max_position_embeddings": 64}
    >>> y = keras_attn.ops.rotary_embedding(x, np.arange(3), scaling=yarn)
    >>> round(float(keras.ops.convert_to_numpy(y)[0, 0, 0, 0]), 4)  # 0.1 ln 4 + 1
    1.1386
    """
    positions = ops.cast(ops.convert_to_tensor(positions), "float32")
    _check_rotary(x, positions, max_wavelength, scaling_factor)
    scaling = check_rope_scaling(scaling, "scaling", scaling_factor, "scaling_factor")
    return rotate(x, positions, max_wavelength, scaling_factor, scaling)


def rotate(x, positions, max_wavelength, scaling_factor=1.0, scaling=None):
    """`rotary_embedding` without its checks, for callers that checked its
    arguments (`MultiHeadAttention`: its options when created, its positions
    per call); `scaling` as `check_rope_scaling` returns it. An eager call on
    JAX is one XLA program (`_jax_eager`)."""
    if _jax_eager.eager((x, positions)):
        frozen = None if scaling is None else tuple(sorted(scaling.items()))
        static = (max_wavelength, scaling_factor, frozen)
        return _jax_eager.run(_rotate_frozen, (x, positions), static)
    return _rotate(x, positions, max_wavelength, scaling_factor, scaling)


def _rotate_frozen(x, positions, max_wavelength, scaling_factor, frozen):
    """`_rotate` with `scaling` as a hashable tuple of its items, a static
    argument of `_jax_eager.run`."""
    scaling = None if frozen is None else dict(frozen)
    return _rotate(x, positions, max_wavelength, scaling_factor, scaling)


def _rotate(x, positions, max_wavelength, scaling_factor, scaling):
    positions = ops.cast(ops.convert_to_tensor(positions), "float32")
    inverse_frequency, attention_factor = rotary_frequencies(
        max_wavelength, x.shape[-1], scaling_factor, scaling
    )
    inverse_frequency = constant(inverse_frequency, "float32", positions)  # (D/2,)
    if len(positions.shape) == 1:
        positions = ops.expand_dims(positions, 0)  # (1, T)
    angles = ops.expand_dims(positions, -1) * inverse_frequency  # (B|1, T, D/2)
    angles = ops.expand_dims(ops.concatenate([angles, angles], axis=-1), 2)
    cos, sin = ops.cos(angles), ops.sin(angles)  # (B|1, T, 1, D)
    x1, x2 = ops.split(x, 2, axis=-1)
    rotated = ops.concatenate([-x2, x1], axis=-1)
    wide = at_least_float32(x.dtype)
    cos, sin = ops.cast(cos, wide), ops.cast(sin, wide)
    if attention_factor != 1.0:  # YaRN's, rounded once like the frequencies
        cos, sin = cos * attention_factor, sin * attention_factor
    output = ops.cast(x, wide) * cos + ops.cast(rotated, wide) * sin
    return ops.cast(output, x.dtype)


def inverse_frequencies(max_wavelength, exponents, scaling_factor=1.0):
    """`max_wavelength**(-e) / scaling_factor` for each exponent `e`, as
    Python floats (float64), to be rounded once to float32 (`constant`)."""
    base, scaling_factor = float(max_wavelength), float(scaling_factor)
    return [base**-exponent / scaling_factor for exponent in exponents]


def rotary_frequencies(max_wavelength, dim, scaling_factor=1.0, scaling=None):
    """`(inverse frequencies, attention factor)` of a rotation of `dim`
    channels: `dim / 2` Python floats and a Python float (the factor of cos
    and sin: YaRN's, else `1.0`), computed in float64, each to be rounded
    once to float32.

    `scaling`: a dict checked by `check_rope_scaling`, or `None` for linear
    scaling by `scaling_factor`.
    """
    base = float(max_wavelength)
    values = [base ** -(i / dim) for i in range(0, dim, 2)]
    if scaling is None:
        values, factor = [v / float(scaling_factor) for v in values], 1.0
    else:
        values, factor = _SCALED[scaling["rope_type"]](values, base, dim, scaling)
    return values, factor


def yarn_mscale(factor, mscale=1.0):
    """YaRN's magnitude factor `0.1 * mscale * ln(factor) + 1`, `1.0` for a
    `factor` of at most 1 (transformers' and DeepSeek-V3's `get_mscale`).

    YaRN multiplies cos and sin by `yarn_mscale(factor)`; DeepSeek-V3 by
    `yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)` (the
    rotary scaling's `attention_factor`), and multiplies its softmax scale
    by `yarn_mscale(factor, mscale_all_dim) ** 2` (the attention's
    `attention_scale`: `head_dim ** -0.5` times that).

    Example:
    >>> round(keras_attn.ops.yarn_mscale(40.0, 1.0), 6)
    1.368888
    >>> keras_attn.ops.yarn_mscale(0.5, 1.0)
    1.0
    """
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


def _linear(values, base, dim, scaling):
    return [v / scaling["factor"] for v in values], 1.0


def _dynamic(values, base, dim, scaling):
    """keras-hub's static NTK-aware scaling: `f**(D / (D - 2))` (the
    exponent's denominator at least 1)."""
    divisor = scaling["factor"] ** (dim / max(1, dim - 2))
    return [v / divisor for v in values], 1.0


def _yarn(values, base, dim, scaling):
    """YaRN as keras-hub's `RotaryEmbedding`: channel pair `i` takes
    `ramp * v / f + (1 - ramp) * v`, the ramp rising from 0 to 1 between the
    channels where `beta_fast` and `beta_slow` rotations fit the original
    context; cos and sin scaled by `attention_factor`, by default
    `0.1 ln f + 1`."""
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]

    def correction(rotations):  # the channel of `rotations` turns in the context
        return (
            dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))
        )

    low, high = correction(scaling["beta_fast"]), correction(scaling["beta_slow"])
    if scaling["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0.0), min(high, dim - 1.0)
    span = max(high - low, 0.001)  # keras-hub's guard against a zero span
    ramps = [min(max((i - low) / span, 0.0), 1.0) for i in range(dim // 2)]
    values = [r * v / factor + (1 - r) * v for v, r in zip(values, ramps, strict=True)]
    return values, scaling.get("attention_factor", yarn_mscale(factor))


def _llama3(values, base, dim, scaling):
    """Llama 3.1's adjustment as keras-hub's `LlamaRotaryEmbedding`:
    wavelengths over `n / low_freq_factor` divided by `f`, under
    `n / high_freq_factor` kept, smoothly interpolated between."""
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    adjusted = []
    for v in values:
        wavelength = 2 * math.pi / v
        if wavelength > original / low:  # low frequencies: interpolated
            adjusted.append(v / factor)
        elif wavelength >= original / high:  # between: smoothly
            smooth = (original / wavelength - low) / (high - low)
            adjusted.append((1 - smooth) * v / factor + smooth * v)
        else:  # high frequencies: kept
            adjusted.append(v)
    return adjusted, 1.0


_SCALED = {"linear": _linear, "dynamic": _dynamic, "yarn": _yarn, "llama3": _llama3}


def check_rope_scaling(scaling, name, scaling_factor=1.0, factor_name=None):
    """Raise unless `scaling` is `None` or a rotary scaling dict (the keys
    `ROPE_SCALING_KEYS` lists for its `rope_type`, positive numbers), and
    unless a `scaling_factor` other than `1.0` comes without it; return it as
    a plain dict with its defaults filled in. `name`: the argument's name,
    `factor_name` that of the linear factor."""
    if scaling is None:
        return None
    if scaling_factor != 1.0:
        raise ValueError(
            f"`{name}` and `{factor_name}` both scale rotary positions: pass one. "
            f"Received: {name}={scaling!r}, {factor_name}={scaling_factor}. For "
            f"linear scaling alone, {name}={{'rope_type': 'linear', 'factor': f}}."
        )
    expected = " or ".join(repr(t) for t in ROPE_SCALING_KEYS)
    if not isinstance(scaling, dict):
        raise TypeError(
            f"`{name}` must be None or a dict with a 'rope_type' ({expected}). "
            f"Received: {name}={scaling!r} of type {type(scaling).__name__}."
        )
    rope_type = scaling.get("rope_type")
    if rope_type not in ROPE_SCALING_KEYS:
        raise ValueError(
            f"`{name}['rope_type']` must be {expected}. Received: {name}={scaling!r}."
        )
    _check_keys(scaling, name, ROPE_SCALING_KEYS[rope_type], ROPE_SCALING_COMPUTED_KEYS)
    return _checked_values(
        {"rope_type": rope_type, **ROPE_SCALING_KEYS[rope_type], **scaling}, name
    )


def _check_keys(scaling, name, keys, computed):
    """Raise unless `scaling` has every key its `rope_type` requires (the
    `None`s of `keys`), and no key that neither `keys` nor `computed` (keys
    by `rope_type`) has."""
    required = [key for key, default in keys.items() if default is None]
    keys = [*keys, *computed.get(scaling["rope_type"], ())]
    unknown = [key for key in scaling if key != "rope_type" and key not in keys]
    missing = [key for key in required if key not in scaling]
    if not (unknown or missing):
        return
    found = {"unknown keys": unknown, "missing keys": missing}
    found = " and ".join(f"{what} {names}" for what, names in found.items() if names)
    optional = [key for key in keys if key not in required]
    optional = f", optionally {optional}" if optional else ""
    raise ValueError(
        f"`{name}` of rope_type {scaling['rope_type']!r} takes the keys "
        f"{['rope_type', *required]}{optional}. Received: {name}={scaling!r}, "
        f"with {found}."
    )


def _checked_values(scaling, name):
    """`scaling` with each value checked and of its Python type."""
    for key, value in scaling.items():
        given = f"{name}[{key!r}]"
        if key == "original_max_position_embeddings":
            scaling[key] = check_positive_int(given, value)
        elif key == "truncate":
            scaling[key] = check_bool(given, value)
        elif key != "rope_type":
            scaling[key] = check_positive_float(given, value)
    if scaling["rope_type"] == "llama3" and not (
        scaling["high_freq_factor"] > scaling["low_freq_factor"]
    ):
        raise ValueError(
            f"`{name}['high_freq_factor']` must exceed `{name}['low_freq_factor']`"
            f" (it bounds the shorter wavelengths). Received: {name}={scaling!r}."
        )
    return scaling


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
