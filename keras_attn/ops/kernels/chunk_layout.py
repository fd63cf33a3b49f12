"""How the chunked path lays out query rows in chunks and joins them again:
`chunking` (how many chunks of how many rows), `split` (each chunk's inputs,
stacked, and the inputs all share), `in_chunks` and `joined` (a tensor's axis
padded and split, and its inverse), `stacked` and `put` (stacks of chunks)."""

import keras
from keras import ops


def chunking(length, rows):
    """`(count, rows)`: how many chunks of about `rows` rows, and the rows
    of each (the fewest padded rows for `count` chunks): Python ints, or
    int32 tensors where the lengths are known only at run time (the plan's
    rows a tensor)."""
    count = -(-length // rows)
    if isinstance(count, int):
        return count, -(-length // count)
    count = ops.maximum(count, 1)  # a row-less call: one chunk of one row
    return count, ops.maximum(-(-length // count), 1)


def split(query, masking, count, rows):
    """`(chunks, shared)`: each chunk's inputs, stacked `(N, ...)`, and the
    inputs all chunks share; `masking`: a `chunked.Masking`."""
    chunks, shared = {"query": in_chunks(query, 1, count, rows)}, {}
    if masking.segments is not None:  # the rows' per chunk, the keys' shared
        query_segments, key_segments = masking.segments
        chunks["segments"] = in_chunks(query_segments, 1, count, rows)  # (N, B, C)
        shared["key_segments"] = key_segments  # (B, S)
    for name, x in (("mask", masking.mask), ("bias", masking.bias)):
        if x is not None and x.shape[2] != 1:  # per query row: chunked too
            chunks[name] = in_chunks(x, 2, count, rows)  # (N, B, H|1, C, S)
        elif x is not None:
            shared[name] = x
    if masking.is_causal or masking.band:  # each chunk's first row
        chunks["offset"] = ops.arange(0, count * rows, rows, dtype="int32")
    return chunks, shared


def stacked(parts):
    """The groups' stacks `(N_g, ...)` as one `(N, ...)` (one as it is)."""
    return parts[0] if len(parts) == 1 else ops.concatenate(parts, axis=0)


def put(stack, index, x):
    """`stack` `(N, ...)` with `x` at `index`."""
    return ops.scatter_update(stack, ops.reshape(index, (1, 1)), x[None])


def joined(chunks, length, axis=1):
    """The inverse of `in_chunks`: `(N, ..., C, ...)` chunks joined on
    `axis`, the padding cut off."""
    shape = list(ops.shape(chunks))
    joined = ops.moveaxis(chunks, 0, axis)  # (..., N, C, ...)
    joined = ops.reshape(
        joined, shape[1 : axis + 1] + [shape[0] * shape[axis + 1]] + shape[axis + 2 :]
    )
    return joined[(slice(None),) * axis + (slice(0, length),)]


def in_chunks(x, axis, count, rows):
    """`x` with `axis` padded to `count * rows` and split: `(count, ..., rows, ...)`."""
    padding = [(0, 0)] * len(x.shape)
    padding[axis] = (0, count * rows - ops.shape(x)[axis])
    x = ops.pad(
        x, padding, constant_values=keras.backend.standardize_dtype(x.dtype) == "bool"
    )
    shape = list(ops.shape(x))
    x = ops.reshape(x, shape[:axis] + [count, rows] + shape[axis + 1 :])
    return ops.moveaxis(x, axis, 0)
