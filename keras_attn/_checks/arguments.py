"""Checks of arguments that are Python values (ints, floats, bools, names,
Keras objects), one message style."""

import numbers

import keras


def check_seed(seed):
    """Raise unless `seed` is `None` or an int >= 0."""
    return None if seed is None else check_count("seed", seed, allow_none=True)


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


def check_count(name, value, allow_none=False):
    """Raise unless `value` is an int >= 0 (not a bool, not a float), or
    `None` where allowed."""
    if value is None and allow_none:
        return None
    expected = "None or an int >= 0" if allow_none else "an int >= 0"
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(
            f"`{name}` must be {expected}. "
            f"Received: {name}={value!r} of type {type(value).__name__}."
        )
    if value < 0:
        raise ValueError(f"`{name}` must be {expected}. Received: {name}={value}.")
    return int(value)


def check_positive_float(name, value, allow_none=False):
    """Raise unless `value` is a real number > 0 (or `None` when allowed)."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"`{name}` must be a positive float. "
            f"Received: {name}={value!r} of type {type(value).__name__}."
        )
    if not value > 0:
        raise ValueError(f"`{name}` must be positive. Received: {name}={value}.")
    return float(value)


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


def check_one_of(name, value, options):
    """Raise unless `value` is one of the strings `options`."""
    if not isinstance(value, str):
        raise TypeError(
            f"`{name}` must be one of {list(options)}. "
            f"Received: {name}={value!r} of type {type(value).__name__}."
        )
    if value not in options:
        raise ValueError(
            f"`{name}` must be one of {list(options)}. Received: {name}={value!r}."
        )
    return value


def check_shape_argument(name, value):
    """`None`, or a tuple of positive ints from a positive int or a list/tuple."""
    if value is None:
        return None
    dims = (value,) if isinstance(value, numbers.Integral) else value
    if (
        isinstance(value, bool)
        or not isinstance(dims, list | tuple)
        or not dims
        or not all(
            isinstance(d, numbers.Integral) and not isinstance(d, bool) for d in dims
        )
    ):
        raise TypeError(
            f"`{name}` must be None, an int or a tuple of ints. "
            f"Received: {name}={value!r} of type {type(value).__name__}."
        )
    if any(d <= 0 for d in dims):
        raise ValueError(
            f"`{name}` must hold positive ints. Received: {name}={value!r}."
        )
    return tuple(int(d) for d in dims)


def check_output_shape(output_shape, output_dim):
    """`output_shape` (int or tuple) and its alias `output_dim` as a tuple or None."""
    output_shape = check_shape_argument("output_shape", output_shape)
    output_dim = check_positive_int("output_dim", output_dim, allow_none=True)
    if output_dim is not None:
        if output_shape not in (None, (output_dim,)):
            raise ValueError(
                "`output_dim` is another name for an int `output_shape`; pass "
                f"one of them. Received: output_shape={output_shape}, "
                f"output_dim={output_dim}."
            )
        output_shape = (output_dim,)
    return output_shape


def normalize_attention_axes(attention_axes):
    """`None`, or a sorted tuple of ints, from an int or a list/tuple of ints."""
    if attention_axes is None:
        return None
    axes = (attention_axes,) if isinstance(attention_axes, int) else attention_axes
    if (
        isinstance(attention_axes, bool)
        or not isinstance(axes, list | tuple)
        or not axes
        or not all(
            isinstance(a, numbers.Integral) and not isinstance(a, bool) for a in axes
        )
    ):
        raise TypeError(
            "`attention_axes` must be None, an int or a non-empty list/tuple of "
            f"ints. Received: attention_axes={attention_axes!r}."
        )
    return tuple(int(a) for a in axes)


def check_key_value_heads(num_heads, num_key_value_heads):
    """`num_key_value_heads`, checked: `None` or a positive divisor of
    `num_heads` (grouped-query attention)."""
    num_key_value_heads = check_positive_int(
        "num_key_value_heads", num_key_value_heads, allow_none=True
    )
    if num_key_value_heads and num_heads % num_key_value_heads:
        raise ValueError(
            "`num_key_value_heads` must divide `num_heads`. Received: "
            f"num_heads={num_heads}, num_key_value_heads={num_key_value_heads}."
        )
    return num_key_value_heads


def get_keras_object(name, get, identifier):
    """`get(identifier)` (e.g. `keras.initializers.get`), naming `name` on error."""
    try:
        return get(identifier)
    except (TypeError, ValueError) as error:
        kind = name.split("_")[-1]  # kernel_initializer -> initializer
        error_class = ValueError if isinstance(identifier, str | dict) else TypeError
        raise error_class(
            f"`{name}` must be a Keras {kind}, or the name or config of one. "
            f"Received: {name}={identifier!r}."
        ) from error


def check_size(name, value, ranks=(0,), minimum=0):
    """Raise unless `value` is an int (>= `minimum`, unless `None`) or an int
    tensor of one of `ranks`, whose values are not read (it may be traced).
    A symbolic dimension (a traced length: torch's `SymInt`, a JAX shape
    expression) passes unchecked."""
    expected = "an int" + ("" if minimum is None else f" >= {minimum}")
    expected += " or a scalar int tensor" if ranks == (0,) else " or an int tensor"
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        if minimum is not None and value < minimum:
            raise ValueError(f"`{name}` must be {expected}. Received: {name}={value}.")
        return
    if hasattr(value, "dtype") and hasattr(value, "shape"):
        dtype = keras.backend.standardize_dtype(value.dtype)
        if "int" not in dtype or len(value.shape) not in ranks:
            raise TypeError(
                f"`{name}` must be {expected} of rank {' or '.join(map(str, ranks))}. "
                f"Received: {name}.dtype={dtype}, {name}.shape={tuple(value.shape)}."
            )
        return
    if value is None or isinstance(value, bool | numbers.Number | str | list | tuple):
        raise TypeError(
            f"`{name}` must be {expected}. "
            f"Received: {name}={value!r} of type {type(value).__name__}."
        )


def check_sizes(**sizes):
    """Raise unless each size (a dimension of a tensor to make, by argument
    name) is an int >= 1, or a scalar int tensor (a traced dimension)."""
    for name, value in sizes.items():
        check_size(name, value, minimum=1)


def check_heads_divide(num_heads, key_dim, width, name):
    """Raise unless `key_dim` is given or `num_heads` divides the known
    `width` of the input `name` (`"query"`, `"input"`)."""
    if key_dim is None and (width is None or width % num_heads):
        raise ValueError(
            f"`num_heads` must divide the {name} width when `key_dim` is not "
            f"given. Received: num_heads={num_heads}, {name} width={width}. "
            "Pass `key_dim` explicitly or choose a divisor of the width."
        )
