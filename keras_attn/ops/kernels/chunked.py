"""The explicit path in chunks of query rows: memory linear in the length.

One chunk at a time (`ops.scan`), each recomputed in the backward pass
(`keras.remat`). Every chunk sees all its keys, so its softmax is the
materialized one, row for row.
"""

import keras
from keras import ops

from keras_attn.ops.kernels import explicit


def attention(query, key, value, mask, bias, is_causal, rows, options):
    """The explicit path on `query` `(B, T, H, D)` (already scaled) in chunks
    of about `rows` query rows; returns `(B, T, H, Dv)`.

    The rows are padded to whole chunks, and the padding cut off.
    """
    length = query.shape[1]
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
            return explicit.attention(
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
