"""Argument and tensor checks, one message style, raised before any state
changes (ground floor: imports nothing of ours but the version).

Each public entry (a layer's `__init__`, `build` or `call`, a public op,
`generate`) checks its arguments once; inner code trusts them. Checks of
shapes and dtypes read static shapes only. The few that read tensor values
(`check_index`, token ids) do so in eager calls only, and never inside the
decoding loop of `generate`, which checks its inputs once and runs its steps
through the layers' unchecked twins (`decode_unchecked`, `call_unchecked`).
"""

import inspect
import numbers

import keras
from keras import ops

from keras_attn._version import __version__

# --- Arguments (Python values) ------------------------------------------------


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


# --- Tensors (static shapes and dtypes) ---------------------------------------


def check_rank(name, shape, rank, description):
    """Raise unless `shape` has `rank` dimensions."""
    if len(shape) != rank:
        raise ValueError(
            f"`{name}` must have rank {rank}, {description}. "
            f"Received: {name}.shape={tuple(shape)}."
        )


def check_float(name, tensor):
    """Raise unless `tensor` has a floating dtype."""
    dtype = keras.backend.standardize_dtype(tensor.dtype)
    if "float" not in dtype:
        raise TypeError(
            f"`{name}` must be a float tensor. Received: {name}.dtype={dtype}."
        )


def check_width(name, shape, width):
    """Raise unless the last dimension of `shape` is the `width` built for."""
    if _known(shape[-1]) and _known(width) and shape[-1] != width:
        raise ValueError(
            f"`{name}` must have the width the layer was built with. "
            f"Received: {name}.shape={tuple(shape)}, built width={width}."
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


def check_broadcastable(name, tensor, shape, description):
    """Raise unless `tensor` is a float tensor broadcastable to `shape`
    (dims compared where both are known)."""
    if tensor is None:
        return
    check_float(name, tensor)
    got = tuple(tensor.shape)
    if len(got) > len(shape) or any(
        _known(a) and _known(b) and a not in (1, b)
        for a, b in zip(got[::-1], shape[::-1], strict=False)
    ):
        raise ValueError(
            f"`{name}` must be broadcastable to {description} = "
            f"{_describe(shape)}. Received: {name}.shape={got}."
        )


def check_positions(positions, batch, length, rope_max_wavelength):
    """Raise unless `positions` is a real tensor `(length,)` or `(batch, length)`
    for a layer with rotary positions."""
    if positions is None:
        return
    if rope_max_wavelength is None:
        raise ValueError(
            "`positions` are rotary positions, and this layer has none: create "
            "it with `rope_max_wavelength`. Received: positions of shape "
            f"{tuple(getattr(positions, 'shape', ()))}, rope_max_wavelength=None."
        )
    if not hasattr(positions, "dtype"):
        positions = ops.convert_to_tensor(positions)
    dtype = keras.backend.standardize_dtype(positions.dtype)
    if dtype == "bool" or "complex" in dtype:
        raise TypeError(
            "`positions` must hold int or float positions. "
            f"Received: positions.dtype={dtype}."
        )
    check_mask("positions", positions, {1: (length,), 2: (batch, length)})


def check_segment_ids(name, segment_ids, shape=None, description="(batch, length)"):
    """Raise unless `segment_ids` is an int tensor (or array) of rank 2 that
    fits `shape` (dims compared where both are known)."""
    if not hasattr(segment_ids, "dtype") or not hasattr(segment_ids, "shape"):
        raise TypeError(
            f"`{name}` must be an int tensor {description}. "
            f"Received: {name}={segment_ids!r} of type {type(segment_ids).__name__}."
        )
    dtype = keras.backend.standardize_dtype(segment_ids.dtype)
    if "int" not in dtype:  # a ValueError, as issue 30 specifies for ids
        raise ValueError(
            f"`{name}` must be an int tensor {description}. "
            f"Received: {name}.dtype={dtype}."
        )
    got = tuple(segment_ids.shape)
    shape = shape or (None, None)
    if len(got) != 2 or any(dims_differ(a, b) for a, b in zip(got, shape, strict=True)):
        raise ValueError(
            f"`{name}` must have shape {description} = {_describe(shape)}. "
            f"Received: {name}.shape={got}."
        )


def check_segment_ids_call(segment_ids, shape, conflict=None):
    """Raise unless a layer call's `segment_ids` (`None`, or int `(batch,
    length)` fitting `shape`) go with the call: `conflict` says what the
    call has that packed rows exclude (e.g. "a `cache`"), or is `None`."""
    if segment_ids is None:
        return
    if conflict:
        raise ValueError(
            "`segment_ids` pack several sequences into one row for the "
            "self-attention of a whole sequence of rank 3 (batch, length, "
            "width): a call without a separate `value` or `key`, a cache or "
            "an `encoder_sequence`. Received: segment_ids of shape "
            f"{tuple(getattr(segment_ids, 'shape', ()))} with {conflict}."
        )
    check_segment_ids("segment_ids", segment_ids, shape)


def check_attention_options(
    is_causal, scale, flash_attention, dropout, return_scores, heads_major
):
    """Raise unless the options of an attention call have their types:
    bools, `flash_attention` a bool or `None`, `scale` a positive float or
    `None`, `dropout` a callable (applied to the weights) or `None`."""
    for name, value in (
        ("is_causal", is_causal),
        ("return_scores", return_scores),
        ("heads_major", heads_major),
    ):
        check_bool(name, value)
    check_bool("flash_attention", flash_attention, allow_none=True)
    check_positive_float("scale", scale, allow_none=True)
    if dropout is not None and not callable(dropout):
        raise TypeError(
            "`dropout` must be a callable applied to the attention weights "
            "(e.g. a `keras.layers.Dropout`) or None. "
            f"Received: dropout={dropout!r} of type {type(dropout).__name__}."
        )


def check_attention_inputs(query, key, value, mask=None, bias=None, heads_major=False):
    """Raise unless `query` `(B, T, H, D)`, `key` `(B, S, K, D)` and `value`
    `(B, S, K, Dv)` (keys and values `(B, K, S, D)` with `heads_major`) fit
    together, `K` dividing `H`, and `mask` and `bias` fit the weights
    `(B, H, T, S)`; dims compared where both are known."""
    layout = (
        "(batch, heads, length, width)"
        if heads_major
        else "(batch, length, heads, width)"
    )
    check_rank("query", query.shape, 4, "(batch, length, heads, width)")
    check_rank("key", key.shape, 4, layout)
    check_rank("value", value.shape, 4, layout)
    dtypes = [keras.backend.standardize_dtype(x.dtype) for x in (query, key, value)]
    if "float" not in dtypes[0] or len(set(dtypes)) > 1:
        raise TypeError(
            "`query`, `key` and `value` must be float tensors of one dtype. "
            f"Received: dtypes {dtypes[0]}, {dtypes[1]} and {dtypes[2]}."
        )
    q, k, v = (tuple(x.shape) for x in (query, key, value))
    if any(dims_differ(a, b) for a, b in zip(k[:-1], v[:-1], strict=True)):
        raise ValueError(
            "`key` and `value` must agree on every dimension but the last "
            f"(batch, length and heads). Received: key.shape={k}, value.shape={v}."
        )
    heads, length = (k[1], k[2]) if heads_major else (k[2], k[1])
    if dims_differ(q[0], k[0]) or dims_differ(q[-1], k[-1]):
        raise ValueError(
            "`query` and `key` must have the same batch size and the same "
            f"width (last dimension). Received: query.shape={q}, key.shape={k}."
        )
    if _known(q[2]) and _known(heads) and q[2] % heads:
        raise ValueError(
            f"The key/value heads ({heads}) must divide the query heads ({q[2]}) "
            f"(grouped-query attention). Received: query.shape={q}, key.shape={k}"
            f"{', heads_major=True' if heads_major else ''}."
        )
    weights = (q[0], q[2], q[1], length)  # (B, H, T, S)
    ranks = {2: weights[2:], 3: (q[0], *weights[2:]), 4: weights}
    check_mask("mask", mask, ranks, broadcast=True)
    check_broadcastable(
        "bias", bias, weights, "(batch, heads, query_length, key_length)"
    )


# --- Tensor values (eager calls only) -----------------------------------------


def compiled_by_torch():
    """Whether `torch.compile` is tracing this call: its tensors have no
    values yet, and reading one breaks the graph (the read then runs eagerly).

    The one backend import of the ground floor: Keras has no public way to
    ask.
    """
    if keras.config.backend() != "torch":
        return False
    import torch  # loaded already: it is the backend

    return torch.compiler.is_compiling()


def exported_by_torch():
    """Whether `torch.export` is tracing this call (a static fact the
    attention plan reads)."""
    if keras.config.backend() != "torch":
        return False
    import torch

    return torch.compiler.is_exporting()


def concrete_value(tensor):
    """`tensor` as numpy where it holds values (an eager call), else `None`:
    tracers, graph tensors, torch.export's fake tensors and the tensors
    `torch.compile` traces have none yet."""
    if compiled_by_torch():
        return None
    try:
        return ops.convert_to_numpy(tensor)
    except (TypeError, NotImplementedError, RuntimeError):
        return None


def check_index(name, index, length, size):
    """Raise unless `index` is an int (or scalar int tensor) where `length`
    positions fit in `size`; where both are known, for Python ints."""
    if isinstance(index, bool) or not (
        isinstance(index, numbers.Integral) or hasattr(index, "dtype")
    ):
        raise TypeError(
            f"`{name}` must be an int or a scalar int tensor. "
            f"Received: {name}={index!r} of type {type(index).__name__}."
        )
    if not isinstance(index, numbers.Integral):
        dtype = keras.backend.standardize_dtype(index.dtype)
        if "int" not in dtype or len(index.shape) != 0:
            raise TypeError(
                f"`{name}` must be an int or a scalar int tensor. Received: "
                f"{name}.dtype={dtype}, {name}.shape={tuple(index.shape)}."
            )
        index = concrete_value(index)  # checked in eager calls only
        if index is None:
            return
        index = int(index)
    if index < 0 or (_known(length) and _known(size) and index + length > size):
        raise ValueError(
            f"`{name}` must leave room for the {length} new positions in the "
            f"cache of length {size}: 0 <= {name} <= {size} - {length}. "
            f"Received: {name}={index}."
        )


# --- Saved configs -------------------------------------------------------------


def check_config(cls, config):
    """Raise unless `cls(**config)` gets only arguments it accepts, and all it needs.

    Accepted: the named arguments of every `__init__` from `cls` to
    `keras.layers.Layer`, and the names in `cls.keyword_arguments` (options it
    takes through `**kwargs`). A subclass from elsewhere taking `**kwargs` may
    accept anything, so then only missing arguments are checked.
    """
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    accepted = {"input_dim", "input_shape", *getattr(cls, "keyword_arguments", ())}
    open_ended = False
    for klass in cls.__mro__:
        if "__init__" not in vars(klass):
            continue
        parameters = inspect.signature(klass.__init__).parameters.values()
        accepted |= {p.name for p in parameters if p.kind in named}
        if klass is keras.layers.Layer:
            break
        open_ended |= not klass.__module__.startswith("keras_attn.") and any(
            p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters
        )
    unknown = [] if open_ended else sorted(set(config) - accepted - {"self"})
    missing = sorted(
        p.name
        for p in list(inspect.signature(cls.__init__).parameters.values())[1:]
        if p.kind in named and p.default is p.empty and p.name not in config
    )
    if not unknown and not missing:
        return
    received, advice = [], []
    if unknown:
        received.append(f"unknown arguments {unknown}")
        advice.append("a newer keras_attn saved it: upgrade keras_attn")
    if missing:
        received.append(f"missing required arguments {missing}")
        advice.append(
            "an older keras_attn saved it: install the version that saved it "
            "(downgrade keras_attn)"
        )
    raise ValueError(
        f"Cannot create {cls.__name__} from its saved config with keras_attn "
        f"{__version__}. Received: {' and '.join(received)}. "
        f"Probably {'; or '.join(advice)}."
    )


def check_heads_divide(num_heads, key_dim, width, name):
    """Raise unless `key_dim` is given or `num_heads` divides the known
    `width` of the input `name` (`"query"`, `"input"`)."""
    if key_dim is None and (width is None or width % num_heads):
        raise ValueError(
            f"`num_heads` must divide the {name} width when `key_dim` is not "
            f"given. Received: num_heads={num_heads}, {name} width={width}. "
            "Pass `key_dim` explicitly or choose a divisor of the width."
        )


def dims_differ(a, b):
    """Whether two dimensions are both known and differ."""
    return _known(a) and _known(b) and a != b


def _known(dim):
    return isinstance(dim, int)


def _describe(shape):
    return "(" + ", ".join(str(d) if _known(d) else "None" for d in shape) + ")"
