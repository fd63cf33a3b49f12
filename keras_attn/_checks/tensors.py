"""Checks of tensors: static shapes and dtypes, and the few that read values
(in eager calls only, never inside `generate`'s decoding loop)."""

import numbers

import keras
from keras import ops

from keras_attn._checks.arguments import check_bool, check_positive_float
from keras_attn._keras_compat import in_stateless_scope


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
    """Raise unless the mask `mask` fits `expected_shape` (see `check_fits`)
    and holds truth values.

    Masks are read as Keras reads them, cast to bool (nonzero: True). A
    float mask holding anything but 0 and 1 (a 0.3, an additive mask's
    -inf, which the cast would make True) is refused where its values can
    be read (eager calls); inside compiled graphs it is cast unchecked.
    """
    if mask is None:
        return
    if not hasattr(mask, "shape"):
        mask = ops.convert_to_tensor(mask)
    check_fits(name, mask, expected_shape, broadcast)
    if "float" not in keras.backend.standardize_dtype(mask.dtype):
        return
    values = concrete_value(mask)
    if values is None:
        return
    bad = values[(values != 0) & (values != 1)]
    if bad.size:
        raise ValueError(
            f"`{name}` is a mask: True (or 1) where attention may look, False "
            f"(or 0) where not. Received: a float {name} holding {float(bad.flat[0]):g}"
            f"{' among other values' if bad.size > 1 else ''}, which Keras' "
            "cast to bool would make True. Pass a bool mask; an additive mask "
            "(0 and -inf) is an attention bias: pass it as the call's bias."
        )


def check_fits(name, tensor, expected_shape, broadcast=False):
    """Raise unless `tensor` fits `expected_shape`, dims compared where both
    are known.

    `expected_shape` is a shape, or a dict `rank -> shape` for tensors that
    may come in several ranks. With `broadcast`, dims of size 1 are accepted.
    """
    if tensor is None:
        return
    if not hasattr(tensor, "shape"):
        tensor = ops.convert_to_tensor(tensor)
    shape = tuple(tensor.shape)
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
    check_fits("positions", positions, {1: (length,), 2: (batch, length)})


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


# Tensor values (eager calls only).


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


def in_keras_step():
    """Whether this call runs inside a Keras stateless scope (a JAX
    trainer's step, a `stateless_call`), where values are not read."""
    return in_stateless_scope is not None and in_stateless_scope()


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
    `torch.compile` traces have none yet.

    Nor is a tensor read inside a Keras stateless scope (JAX's `fit`,
    `predict` and `evaluate` run their steps in one, `jit_compile=False`
    included): the JAX trainer takes the weights out of the model's
    variables for the loop and puts them back after it, so an error raised
    inside a step would leave the model without weights (Keras 3.15). There,
    as in compiled graphs, a check that needs values does not run.
    """
    if isinstance(tensor, keras.KerasTensor) or compiled_by_torch() or in_keras_step():
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


def dims_differ(a, b):
    """Whether two dimensions are both known and differ."""
    return _known(a) and _known(b) and a != b


def _known(dim):
    return isinstance(dim, int)


def _describe(shape):
    return "(" + ", ".join(str(d) if _known(d) else "None" for d in shape) + ")"
