"""Bad input to the public ops (issue 28): `dot_product_attention`'s tensors
and the mask and position builders' arguments raise our `ValueError` or
`TypeError`, naming the argument and what was received, on every backend;
and what a NaN in a query row gives on each path, pinned."""

import re

import keras
import numpy as np
import pytest

from keras_attn import ops as attn_ops
from tests.helpers.backend import BACKEND, has_accelerator, to_numpy
from tests.helpers.builders import random_floats

# Distinct sizes: batch, query length, query heads, key length, key/value
# heads, width.
B, T, H, S, K, D = 2, 3, 4, 5, 2, 8


def shape_of(shape):
    return re.escape(str(shape))


# --- dot_product_attention: ranks and shapes ----------------------------------

# name: (query, key, value shapes, extra arguments, error, message)
ATTENTION_ROWS = {
    "query of rank 3": (
        (B, T, D), (B, S, K, D), (B, S, K, D), {}, ValueError,
        r"`query` must have rank 4, \(batch, length, heads, width\).*"
        rf"query.shape={shape_of((B, T, D))}",
    ),
    "all of rank 3 (no heads axis)": (
        (B, T, D), (B, S, D), (B, S, D), {}, ValueError,
        r"`query` must have rank 4",
    ),
    "key of rank 3": (
        (B, T, H, D), (B, S, D), (B, S, K, D), {}, ValueError,
        rf"`key` must have rank 4.*key.shape={shape_of((B, S, D))}",
    ),
    "value of rank 5": (
        (B, T, H, D), (B, S, K, D), (B, S, K, D, 1), {}, ValueError,
        r"`value` must have rank 4",
    ),
    "heads-major key of rank 3": (
        (B, T, H, D), (B, S, D), (B, S, D), {"heads_major": True}, ValueError,
        r"`key` must have rank 4, \(batch, heads, length, width\)",
    ),
    "batch of the keys": (
        (B, T, H, D), (B + 1, S, K, D), (B + 1, S, K, D), {}, ValueError,
        r"`query` and `key` must have the same batch size",
    ),
    "width of the keys": (
        (B, T, H, D), (B, S, K, D + 1), (B, S, K, D + 1), {}, ValueError,
        rf"same width.*key.shape={shape_of((B, S, K, D + 1))}",
    ),
    "key/value heads not dividing the query heads": (
        (B, T, H, D), (B, S, 3, D), (B, S, 3, D), {}, ValueError,
        r"key/value heads \(3\) must divide the query heads \(4\)",
    ),
    "heads-major heads not dividing": (
        (B, T, H, D), (B, 3, S, D), (B, 3, S, D), {"heads_major": True},
        ValueError, r"key/value heads \(3\).*heads_major=True",
    ),
    "keys longer than the values": (
        (B, T, H, D), (B, S, K, D), (B, S - 1, K, D), {}, ValueError,
        r"`key` and `value` must agree on every dimension but the last.*"
        rf"value.shape={shape_of((B, S - 1, K, D))}",
    ),
    "values of another batch": (
        (B, T, H, D), (B, S, K, D), (B + 1, S, K, D), {}, ValueError,
        r"`key` and `value` must agree",
    ),
    "a mask of the wrong query length": (
        (B, T, H, D), (B, S, K, D), (B, S, K, D),
        {"mask": np.ones((T + 1, S), bool)}, ValueError,
        rf"`mask` does not match.*mask.shape={shape_of((T + 1, S))}",
    ),
    "a rank-3 mask of another batch": (
        (B, T, H, D), (B, S, K, D), (B, S, K, D),
        {"mask": np.ones((B + 1, T, S), bool)}, ValueError,
        r"`mask` does not match",
    ),
    "a mask of rank 5": (
        (B, T, H, D), (B, S, K, D), (B, S, K, D),
        {"mask": np.ones((1, 1, 1, T, S), bool)}, ValueError,
        r"`mask` must have rank 2 or 3 or 4",
    ),
    "a bias of the wrong key length": (
        (B, T, H, D), (B, S, K, D), (B, S, K, D),
        {"bias": np.zeros((1, H, T, S + 1), "float32")}, ValueError,
        r"`bias` must be broadcastable to \(batch, heads, query_length, key_length\)",
    ),
    "a bias of ints": (
        (B, T, H, D), (B, S, K, D), (B, S, K, D),
        {"bias": np.zeros((1, H, T, S), "int32")}, TypeError,
        r"`bias` must be a float tensor",
    ),
    "float segment ids": (
        (B, T, H, D), (B, S, K, D), (B, S, K, D),
        {"query_segment_ids": np.zeros((B, T), "float32")}, ValueError,
        r"`query_segment_ids` must be an int tensor.*dtype=float32",
    ),
    "segment ids of another length": (
        (B, T, H, D), (B, S, K, D), (B, S, K, D),
        {"query_segment_ids": np.zeros((B, T + 1), "int32"),
         "key_segment_ids": np.zeros((B, S), "int32")}, ValueError,
        rf"`query_segment_ids` must have shape \(batch, query_length\) = "
        rf"{shape_of((B, T))}.*shape={shape_of((B, T + 1))}",
    ),
    "the query's segment ids for keys of another length": (
        (B, T, H, D), (B, S, K, D), (B, S, K, D),
        {"query_segment_ids": np.zeros((B, T), "int32")}, ValueError,
        r"`query_segment_ids \(the keys' by default\)` must have shape "
        r"\(batch, key_length\)",
    ),
    "key segment ids alone": (
        (B, T, H, D), (B, S, K, D), (B, S, K, D),
        {"key_segment_ids": np.zeros((B, S), "int32")}, ValueError,
        r"`key_segment_ids` needs `query_segment_ids`",
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", list(ATTENTION_ROWS))
@pytest.mark.parametrize("flash_attention", [None, False])
def test_dot_product_attention_checks_its_inputs(name, flash_attention):
    """Ours, not the backend's error (nor, on PyTorch, a silent result for
    rank-3 inputs or keys longer than the values), on every path."""
    query, key, value, extra, error, match = ATTENTION_ROWS[name]
    q, k, v = (
        random_floats(*shape, seed=i) for i, shape in enumerate((query, key, value))
    )
    with pytest.raises(error, match=match):
        attn_ops.dot_product_attention(
            q, k, v, flash_attention=flash_attention, **extra
        )


OPTION_ROWS = {
    "is_causal as a string": ({"is_causal": "no"}, r"`is_causal` must be a bool"),
    "return_scores as a string": (
        {"return_scores": "False"}, r"`return_scores` must be a bool",
    ),
    "heads_major as an int": ({"heads_major": 1}, r"`heads_major` must be a bool"),
    "flash_attention as a string": (
        {"flash_attention": "yes"}, r"`flash_attention` must be a bool or None",
    ),
    "a dropout rate instead of a callable": (
        {"dropout": 0.1}, r"`dropout` must be a callable",
    ),
    "scale as a string": ({"scale": "a"}, r"`scale` must be a positive float"),
}  # fmt: skip


@pytest.mark.parametrize("name", list(OPTION_ROWS))
def test_dot_product_attention_checks_its_options(name):
    """Each option's type, at the door: a string `is_causal` or
    `return_scores` ran silently, a float `dropout` failed deep inside."""
    extra, match = OPTION_ROWS[name]
    q = random_floats(B, T, H, D, seed=1)
    kv = random_floats(B, S, K, D, seed=2)
    with pytest.raises(TypeError, match=match):
        attn_ops.dot_product_attention(q, kv, kv, **extra)
    with pytest.raises(ValueError, match=r"`scale` must be positive"):
        attn_ops.dot_product_attention(q, kv, kv, scale=-1.0)


@pytest.mark.parametrize(
    "dtypes", [("int32",) * 3, ("float32", "float16", "float16")], ids=str
)
def test_dot_product_attention_takes_float_inputs_of_one_dtype(dtypes):
    """An int query ran silently on JAX; mixed float dtypes gave torch's own
    error."""
    shapes = ((B, T, H, D), (B, S, K, D), (B, S, K, D))
    q, k, v = (
        keras.ops.cast(random_floats(*shape, seed=i), dtype)
        for i, (shape, dtype) in enumerate(zip(shapes, dtypes, strict=True))
    )
    with pytest.raises(TypeError, match=r"must be float tensors of one dtype"):
        attn_ops.dot_product_attention(q, k, v)


def test_dot_product_attention_takes_what_broadcasts():
    """The checks leave alone what the op takes: masks and biases with axes of
    size 1, rank-3 masks, a rank-3 bias `(H, T, S)`, heads-major caches.
    (Unknown dims: the layers' symbolic calls, `tests/layers`.)"""
    q = random_floats(B, T, H, D)
    kv = random_floats(B, S, K, D)
    for mask in (np.ones((1, 1, T, S), bool), np.ones((B, 1, S), bool)):
        attn_ops.dot_product_attention(q, kv, kv, mask=mask)
    attn_ops.dot_product_attention(q, kv, kv, bias=random_floats(H, 1, S))
    major = np.transpose(kv, (0, 2, 1, 3))  # (B, K, S, D)
    output = attn_ops.dot_product_attention(q, major, major, heads_major=True)
    assert tuple(output.shape) == (B, T, H, D)


# --- The mask and position builders: their arguments --------------------------


def row(builder, args, kwargs, error, match):
    def short(value):
        if isinstance(value, np.ndarray):
            return f"{value.dtype}{value.shape}"
        return repr(value)

    shown = [short(a) for a in args] + [f"{k}={short(v)}" for k, v in kwargs.items()]
    id_ = f"{builder}({', '.join(shown)})"
    return pytest.param(builder, args, kwargs, error, match, id=id_)


BUILDER_ROWS = [
    row(
        "causal_mask",
        (-1, 3),
        {},
        ValueError,
        r"`query_length` must be an int >= 0.*query_length=-1",
    ),
    row("causal_mask", (3, -2), {}, ValueError, r"`key_length`.*key_length=-2"),
    row(
        "causal_mask",
        (3, 3),
        {"query_offset": -1},
        ValueError,
        r"`query_offset`.*query_offset=-1",
    ),
    row(
        "causal_mask",
        (2.5, 3),
        {},
        TypeError,
        r"`query_length`.*query_length=2.5 of type float",
    ),
    row(
        "causal_mask",
        (3, "3"),
        {},
        TypeError,
        r"`key_length`.*key_length='3' of type str",
    ),
    row("causal_mask", (None, 3), {}, TypeError, r"query_length=None"),
    row("causal_mask", (True, 3), {}, TypeError, r"query_length=True of type bool"),
    row("causal_mask", (3, np.float32(3.0)), {}, TypeError, r"`key_length`.*float"),
    row(
        "causal_mask",
        (3, np.ones(2, "int32")),
        {},
        TypeError,
        r"key_length.shape=\(2,\)",
    ),
    row("sliding_window_mask", (-1, 3, 2), {}, ValueError, r"query_length=-1"),
    row(
        "sliding_window_mask",
        (3, 3, 0),
        {},
        ValueError,
        r"`window` must be a positive int.*window=0",
    ),
    row("sliding_window_mask", (3, 3, 2.0), {}, TypeError, r"window=2.0 of type float"),
    row(
        "sliding_window_mask",
        (3, 3, 2),
        {"query_offset": -4},
        ValueError,
        r"query_offset=-4",
    ),
    row(
        "sliding_window_mask",
        (3, 3, 2),
        {"attention_sinks": False},
        TypeError,
        r"`attention_sinks` must be None or an int >= 0.*=False of type bool",
    ),
    row(
        "sliding_window_mask",
        (3, 3, 2),
        {"attention_sinks": 0.0},
        TypeError,
        r"attention_sinks=0.0 of type float",
    ),
    row("alibi_bias", (2, -1, 3), {}, ValueError, r"query_length=-1"),
    row(
        "alibi_bias",
        (2, 3, 3),
        {"max_bias": 0.0},
        ValueError,
        r"`max_bias` must be positive.*max_bias=0.0",
    ),
    row("alibi_bias", (2, 3, 3), {"query_offset": 1.5}, TypeError, r"query_offset=1.5"),
    row(
        "sinusoidal_position_encoding", (-1, 4), {}, ValueError, r"`length`.*length=-1"
    ),
    row(
        "sinusoidal_position_encoding",
        (3, 0),
        {},
        ValueError,
        r"`dim` must be a positive int.*dim=0",
    ),
    row(
        "sinusoidal_position_encoding",
        (3, 4.0),
        {},
        TypeError,
        r"dim=4.0 of type float",
    ),
    row(
        "sinusoidal_position_encoding",
        (3, 4),
        {"max_wavelength": 0},
        ValueError,
        r"`max_wavelength` must be positive",
    ),
    row(
        "sinusoidal_position_encoding",
        (3, 4),
        {"start_index": 1.5},
        TypeError,
        r"start_index=1.5",
    ),
    row(
        "sinusoidal_position_encoding",
        (3, 4),
        {"start_index": np.zeros((2, 2), "int32")},
        TypeError,
        r"start_index.shape=\(2, 2\)",
    ),
    row(
        "segment_positions",
        (np.zeros((2, 3), "float32"),),
        {},
        ValueError,
        r"`segment_ids` must be an int tensor.*dtype=float32",
    ),
    row(
        "segment_mask",
        (np.zeros((2, 3), "int32"), np.zeros((3, 3), "int32")),
        {},
        ValueError,
        r"`key_segment_ids` must have shape \(batch, key_length\)",
    ),
]


@pytest.mark.parametrize("builder, args, kwargs, error, match", BUILDER_ROWS)
def test_mask_and_position_builders_check_their_arguments(
    builder, args, kwargs, error, match
):
    with pytest.raises(error, match=match):
        getattr(attn_ops, builder)(*args, **kwargs)


def test_builders_take_int_tensors_and_zero_lengths():
    """Scalar int tensors (their values unread), per-sequence starts and an
    empty query keep working."""
    three = keras.ops.convert_to_tensor(3, "int32")
    assert tuple(attn_ops.causal_mask(three, 4, query_offset=three).shape) == (3, 4)
    assert tuple(attn_ops.sliding_window_mask(2, three, 2).shape) == (2, 3)
    assert tuple(attn_ops.alibi_bias(2, 0, 3).shape) == (1, 2, 0, 3)
    starts = keras.ops.convert_to_tensor([0, 2], "int32")
    table = attn_ops.sinusoidal_position_encoding(three, 4, start_index=starts)
    assert tuple(table.shape) == (2, 3, 4)


# --- A NaN in a query row, on each path (issue 28, item 6) --------------------

NAN_PATHS = {
    # name: (arguments, torch's fused kernel gives zeros on a CPU)
    "fused where it computes the same, no mask": ({}, True),
    "fused, causal as is_causal": ({"is_causal": True}, True),
    "fused, with a mask": ({"mask": np.ones((T, S), bool)}, False),
    "fused, with a bias": ({"bias": np.zeros((1, H, T, S), "float32")}, False),
    "explicit": ({"flash_attention": False}, False),
    "explicit, causal": ({"flash_attention": False, "is_causal": True}, False),
    "explicit in chunks": ({"flash_attention": False, "chunked": True}, False),
}


@pytest.mark.parametrize("name", list(NAN_PATHS))
def test_a_nan_query_row_gives_nan_but_on_torchs_fused_cpu_kernel(name, small_chunks):
    """Pinned, not changed (README, "Fused, explicit and chunked attention"):
    propagating the NaN would cost every call a reduction. Only the row that
    holds the NaN is touched; torch's fused CPU kernel gives it zeros where no
    mask or bias reaches the kernel, every other path NaN. torch's GPU
    kernels are their own: there the row is NaN or zeros."""
    kwargs, zeros_on_torch = NAN_PATHS[name]
    kwargs = dict(kwargs)
    chunked = kwargs.pop("chunked", False)
    if not chunked:
        small_chunks()  # materialize
    q = random_floats(B, T, H, D, seed=1)
    q[0, 1, 0, 0] = np.nan
    kv = random_floats(B, S, K, D, seed=2)
    output = to_numpy(attn_ops.dot_product_attention(q, kv, kv, **kwargs))
    assert bool(small_chunks.calls) == chunked
    row = output[0, 1, 0]
    others = np.delete(output.reshape(B * T * H, D), 1 * H + 0, axis=0)
    assert np.isfinite(others).all()
    fused_torch = BACKEND == "torch" and zeros_on_torch
    if fused_torch and has_accelerator():
        assert np.isnan(row).all() or (row == 0).all(), row
    elif fused_torch:
        np.testing.assert_array_equal(row, np.zeros(D))
    else:
        assert np.isnan(row).all(), row
