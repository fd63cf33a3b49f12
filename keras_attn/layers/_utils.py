"""Helpers shared by the layers: argument checks (one message style, raised
before any state changes) and initializer cloning."""

import numbers

import keras
from keras import ops


def clone_initializer(initializer):
    """A fresh copy of a Keras initializer, so sublayers never share a seed."""
    if isinstance(initializer, keras.initializers.Initializer):
        return initializer.__class__.from_config(initializer.get_config())
    return initializer


def check_seed(seed):
    """Raise unless `seed` is `None` or an int >= 0."""
    if seed is None:
        return None
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0:
        raise ValueError(
            f"`seed` must be None or an int >= 0. Received: seed={seed!r}."
        )
    return int(seed)


def check_positive_int(name, value, allow_none=False):
    """Raise unless `value` is a positive int (or `None` when allowed)."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        expected = "a positive int or None" if allow_none else "a positive int"
        raise TypeError(
            f"`{name}` must be {expected}. "
            f"Received: {name}={value!r} of type {type(value).__name__}."
        )
    if value <= 0:
        raise ValueError(f"`{name}` must be a positive int. Received: {name}={value}.")
    return int(value)


def check_rate(name, value):
    """Raise unless `value` is a float in [0, 1)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"`{name}` must be a float in [0, 1). "
            f"Received: {name}={value!r} of type {type(value).__name__}."
        )
    if not 0.0 <= value < 1.0:
        raise ValueError(f"`{name}` must be in [0, 1). Received: {name}={value}.")
    return float(value)


def check_positive_float(name, value):
    """Raise unless `value` is a real number > 0."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"`{name}` must be a positive float. "
            f"Received: {name}={value!r} of type {type(value).__name__}."
        )
    if not value > 0:
        raise ValueError(f"`{name}` must be positive. Received: {name}={value}.")
    return float(value)


def check_bool(name, value, allow_none=False):
    """Raise unless `value` is a bool (or `None` when allowed)."""
    if value is None and allow_none:
        return None
    if not isinstance(value, bool):
        expected = "a bool or None" if allow_none else "a bool"
        raise TypeError(
            f"`{name}` must be {expected}. "
            f"Received: {name}={value!r} of type {type(value).__name__}."
        )
    return value


def check_rank(name, shape, rank, description):
    """Raise unless `shape` has `rank` dimensions."""
    if len(shape) != rank:
        raise ValueError(
            f"`{name}` must have rank {rank}, {description}. "
            f"Received: {name}.shape={tuple(shape)}."
        )


def check_mask(name, mask, expected_shape, broadcast=False):
    """Raise unless `mask` fits `expected_shape`, dims compared where both are known.

    `expected_shape` is a shape, or a dict `rank -> shape` for masks that may
    come in several ranks. With `broadcast`, dims of size 1 are accepted.
    """
    if mask is None:
        return
    if not hasattr(mask, "shape"):
        mask = ops.convert_to_tensor(mask)
    shape = tuple(mask.shape)
    shapes = (
        expected_shape
        if isinstance(expected_shape, dict)
        else {len(expected_shape): expected_shape}
    )
    if len(shape) not in shapes:
        options = " or ".join(_describe(s) for s in shapes.values())
        raise ValueError(
            f"`{name}` must have rank {' or '.join(map(str, shapes))}: {options}. "
            f"Received: {name}.shape={shape}."
        )
    expected = shapes[len(shape)]
    for got, want in zip(shape, expected, strict=True):
        if (
            _known(got)
            and _known(want)
            and got != want
            and not (broadcast and got == 1)
        ):
            raise ValueError(
                f"`{name}` does not match the inputs: expected shape "
                f"{_describe(expected)}. Received: {name}.shape={shape}."
            )


def _known(dim):
    return isinstance(dim, int)


def _describe(shape):
    return "(" + ", ".join(str(d) if _known(d) else "None" for d in shape) + ")"
