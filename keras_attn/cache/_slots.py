"""What the caches share: their tensors' slots, written, gathered and
blended, and which slots a query sees where slot `p` holds position `p`.

A cache tensor is `(batch, 2, kv_heads, slots, width)`: keys at index 0 of
axis 1, values at index 1, heads-major so that a step reads each head's keys
contiguously (the int8 cache's scales have width 1).
"""

import math

import keras
from keras import ops

from keras_attn.ops.dtypes import int32
from keras_attn.ops.masks import causal, sink_keys, window_band

if keras.config.backend() == "torch":
    from keras_attn import _torch_eager
else:
    _torch_eager = None


class Linear:
    """The slots of a dense or int8 cache: slot `p` holds position `p`."""

    __slots__ = ()

    @property
    def length(self):
        """The number of slots."""
        return self.kv.shape[3]

    def positions(self, index):
        """int32 `(1, length)`: the position each slot holds (slot `p`: `p`)."""
        return ops.expand_dims(ops.arange(0, self.length, dtype="int32"), 0)

    def top_left_causal(self, index):
        """Whether `mask(index, ...)` lies within the top-left causal mask
        (query `i` sees no slot past `i`), as known when the call is traced:
        `index` the Python int 0 (a prompt's prefill)."""
        return isinstance(index, int) and index == 0

    def mask(self, index, count, real=None, window=None, sinks=None):
        """Which slots the `count` queries at `index, ...` see: bool `(batch
        or 1, 1, count, length)`; `real` (bool `(batch, length)`, True for
        real tokens), the layer's sliding `window` and attention `sinks` as
        in `linear_mask`."""
        return linear_mask(index, count, self.length, real, window, sinks)

    def grown(self, size):
        """The cache with every tensor padded with zeros to `size` slots."""
        widths = [[0, 0], [0, 0], [0, 0], [0, size - self.length], [0, 0]]
        return type(self)(*(ops.pad(t, widths) for t in self))


def write(buffer, keys, values, index, in_place=True):
    """`keys` and `values` `(B, n, K, X)` written into `buffer` at slots
    `index, ..., index + n - 1`: in place on PyTorch with `in_place` (the
    same tensor returned) where no gradient is recorded (autograd may have
    saved the buffer for a backward pass), else into a new buffer
    (`slice_update`, which XLA writes in place inside a compiled loop)."""
    if _in_place(in_place):
        return _torch_eager.write_slots(buffer, keys, values, index)
    update = ops.transpose(ops.stack([keys, values], axis=1), (0, 1, 3, 2, 4))
    return ops.slice_update(buffer, [0, 0, 0, int32(index), 0], update)


def blend(buffer, arrives, keys, values):
    """The first `s` slots of `buffer` take one token's `keys` and `values`
    `(B, 1, K, X)` where `arrives` `(B, s)` is True (in place on PyTorch)."""
    sinks = arrives.shape[1]
    new = ops.transpose(ops.stack([keys, values], axis=1), (0, 1, 3, 2, 4))
    chosen = ops.where(arrives[:, None, None, :, None], new, buffer[:, :, :, :sinks])
    if _in_place(True):  # (B, 2, K, s, X) -> two (B, s, K, X)
        first, second = (chosen[:, i].transpose(1, 2) for i in range(2))
        return _torch_eager.write_slots(buffer, first, second, 0)
    return ops.slice_update(buffer, [0, 0, 0, 0, 0], chosen)


def _in_place(asked):
    """Whether a write goes in place: asked for, on PyTorch, with no
    gradient recorded."""
    return asked and _torch_eager is not None and not _torch_eager.recording()


def take(buffer, positions):
    """`buffer`'s slots at `positions` `(B|1, n)` (int32): `(B, 2, K, n, X)`."""
    shape = (*ops.shape(buffer)[:3], positions.shape[1], buffer.shape[4])
    at = ops.broadcast_to(positions[:, None, None, :, None], shape)
    return ops.take_along_axis(buffer, at, axis=3)


def linear_mask(index, count, length, real=None, window=None, sinks=None):
    """Which of `length` slots, slot `p` holding position `p`, the queries at
    `index, ..., index + count - 1` see: bool `(B or 1, 1, count, S)`, the
    rank attention takes as it is (one head axis, broadcast).

    A query sees the positions written up to its own (the causal mask), real
    ones (`real`, bool `(B, S)` by position, True for real tokens), within a
    sliding `window` of it or among the first `sinks` real positions of its
    row: the masks of `ops/masks.py`, as a layer's own call builds them.
    """
    # Operators and indexing, not Keras' ops: a decoding step builds this
    # mask (Keras' ops convert each argument on PyTorch's eager steps).
    if real is not None and not ops.is_tensor(real):
        real = ops.convert_to_tensor(real, "bool")
    if count == 1:  # one new token: every position written so far
        seen = (ops.arange(0, length, dtype="int32") <= index)[None]
    else:
        seen = causal(count, length, index)
    if window is not None:
        band = window_band(count, length, window, index)
        if sinks:
            band = band | sink_keys(length, sinks, real)
        seen = seen & band
    if real is not None:
        seen = seen & real[:, None]
    return seen[:, None] if len(seen.shape) == 3 else seen[None, None]


def nbytes(*tensors):
    """The memory of `tensors` in bytes (static shapes)."""
    return sum(math.prod(t.shape) * _itemsize(t.dtype) for t in tensors)


def _itemsize(dtype):
    dtype = keras.backend.standardize_dtype(dtype)
    if dtype == "bool":
        return 1
    return int("".join(c for c in dtype if c.isdigit())) // 8
