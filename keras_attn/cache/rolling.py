"""The rolling cache of a sliding window: each row's attention sinks, then a
ring of the last `window` positions, so that memory stays `sinks + window`
slots however long the generation runs."""

import collections

from keras import ops

from keras_attn.cache import _slots
from keras_attn.ops.constants import constant
from keras_attn.ops.dtypes import int32


class RollingCache(collections.namedtuple("RollingCache", ["slots", "sinks"])):
    """A sliding window's keys and values (Mistral's rolling buffer cache,
    with StreamingLLM's attention sinks).

    `slots`: a `DenseCache` or `Int8Cache` of `s + w` slots; `sinks`: int32
    `(batch, s)`, each row's sink positions (its first `s` real positions,
    `pads + k` for a row left-padded by `pads`). Sink slot `k` holds position
    `sinks[:, k]` once it is written; ring slot `s + (p % w)` holds position
    `p`, so that after a write at `index` the ring holds `index - w + 1, ...,
    index`: the window of the query at `index`, nothing more. A position that
    is also a sink is seen in its sink slot only. A write moves nothing: one
    slot per row (in place on PyTorch), whatever the window.

    Made by `from_prefill` from the dense cache of a prompt; `update` takes
    one token at a time (a decoding step). `w`, `s` and every other fact are
    read from the tensors' shapes.
    """

    __slots__ = ()

    @classmethod
    def from_prefill(cls, cache, width, pads, window, sinks=0):
        """The rolling cache after a prompt of `width` positions (a Python
        int): `cache`, a `DenseCache` or `Int8Cache` of at least `width`
        slots, holds them; `pads` (int32 `(batch,)`) is each row's left
        padding, so its sinks are `pads, ..., pads + sinks - 1`. The ring
        takes positions `width - window, ..., width - 1` (those before 0 are
        never seen); the next write, at `width`, replaces the first."""
        # Ring slot j holds the position p with p % window == j.
        ring = [width - window + (j - width) % window for j in range(window)]
        held = _sink_positions(pads, sinks)  # (B, s)
        ring = constant(ring, "int32", held)[None]  # (1, w)
        batch = ops.shape(pads)[0]
        positions = ops.concatenate(
            [held, ops.broadcast_to(ring, (batch, window))], axis=1
        )
        at = ops.clip(positions, 0, cache.length - 1)
        return cls(cache.take(at), held)

    @property
    def length(self):
        """The number of slots, `sinks + window`."""
        return self.slots.length

    @property
    def window(self):
        return self.slots.length - self.sinks.shape[1]

    @property
    def nbytes(self):
        """The cache's memory, in bytes."""
        return self.slots.nbytes + _slots.nbytes(self.sinks)

    def update(self, keys, values, index):
        """One token's `keys` and `values` `(batch, 1, kv_heads, head_dim)`
        written at position `index` (a scalar int tensor or int): into its
        ring slot, and into a row's sink slot where it is one of its sinks."""
        sinks, index = self.sinks.shape[1], int32(index)
        slot = sinks + ops.mod(index, self.window)
        slots = self.slots.update(keys, values, slot)
        if sinks:
            slots = slots.blend(self.sinks == index, keys, values)
        return RollingCache(slots, self.sinks)

    def read(self, dtype):
        """`(keys, values)`, each `(batch, kv_heads, sinks + window, head_dim)`."""
        return self.slots.read(dtype)

    def positions(self, index):
        """int32 `(batch, sinks + window)`: the position each slot holds once
        position `index` is written (sinks not yet written: past `index`;
        ring slots never written: below 0)."""
        window = self.window
        ring = index - ops.mod(index - ops.arange(0, window, dtype="int32"), window)
        ring = ops.broadcast_to(ring[None], (ops.shape(self.sinks)[0], window))
        return ops.concatenate([self.sinks, ring], axis=1)

    def top_left_causal(self, index):
        """Never: ring slots do not hold their positions."""
        return False

    def mask(self, index, count, real=None, window=None, sinks=None):
        """Which slots the query at `index` sees, bool `(batch, 1, 1, sinks +
        window)`: written, real (`real`, bool `(batch, length)` by
        position), and a ring slot only where its position is not one of the
        row's sinks. `count` must be 1; `window` and `sinks` are the
        cache's own (its slots hold nothing else)."""
        positions = self.positions(index)  # (B, S)
        seen = (positions >= 0) & (positions <= index)
        if real is not None:
            at = ops.clip(positions, 0, real.shape[1] - 1)
            seen = ops.logical_and(seen, ops.take_along_axis(real, at, axis=1))
        if self.sinks.shape[1]:  # past the row's last sink
            ring = positions[:, self.sinks.shape[1] :] > self.sinks[:, -1:]
            held = ops.concatenate([ops.ones_like(self.sinks, "bool"), ring], axis=1)
            seen = ops.logical_and(seen, held)
        return seen[:, None, None]


def _sink_positions(pads, sinks):
    """int32 `(B, s)`: each row's first `s` real positions."""
    return ops.cast(pads, "int32")[:, None] + ops.arange(0, sinks, dtype="int32")
