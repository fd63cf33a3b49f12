"""How a checkpoint's tensors and a model's variables correspond: each
`Link` ties one Hugging Face tensor to one or more of our variables, with the
layout change both ways (so loading and saving share one table)."""

import dataclasses
import math

import numpy as np


@dataclasses.dataclass(frozen=True)
class Layout:
    """One variable's layout in a checkpoint tensor.

    `kind`:
    - `"same"`: the same array;
    - `"linear"`: a `torch.nn.Linear` weight `(out, in)`, where ours is
      `(*in, *out)` with `inputs` leading axes (EinsumDense kernels);
    - `"flat"`: ours reshaped to `(in, out)` with `inputs` leading axes
      (GPT-2's `Conv1D`), or to one axis with `inputs=None` (biases);
    - `"plus_one"`: Gemma's norms, which scale by `1 + w`: ours holds `1 + w`.
    """

    kind: str = "same"
    inputs: int | None = None

    def shape(self, ours):
        if self.kind == "linear":
            return (math.prod(ours[self.inputs :]), math.prod(ours[: self.inputs]))
        if self.kind == "flat":
            if self.inputs is None:
                return (math.prod(ours),)
            return (math.prod(ours[: self.inputs]), math.prod(ours[self.inputs :]))
        return tuple(ours)

    def load(self, theirs, ours):
        if self.kind == "linear":
            return theirs.T.reshape(ours)
        if self.kind == "plus_one":
            return theirs.astype("float32") + 1.0
        return theirs.reshape(ours)

    def save(self, value):
        if self.kind == "linear":
            return value.reshape(self.shape(value.shape)[::-1]).T
        if self.kind == "plus_one":
            return value.astype("float32") - 1.0
        return value.reshape(self.shape(value.shape))


SAME, LINEAR, BIAS, PLUS_ONE = (
    Layout(),
    Layout("linear", 1),
    Layout("flat"),
    Layout("plus_one"),
)
OUTPUT_LINEAR = Layout("linear", 2)  # W_O: ours (heads, head_dim, width)


@dataclasses.dataclass(frozen=True)
class Link:
    """The checkpoint tensor `theirs` holds our variables `ours`, each in
    `layout`, concatenated along `axis` when there are several (Phi-3's fused
    qkv and gate-up, GPT-2's fused qkv), or alternating along it with
    `interleaved` (gpt-oss's gate-up: gate, up, gate, up, ...).

    `expert`: the tensor holds slice `expert` (of the first axis) of each of
    our variables (one expert's matrix, Mixtral's `experts.3.w1.weight`);
    `shapes` are then the variables' shapes, and the layout acts on the
    slice."""

    theirs: str
    ours: tuple
    layout: Layout = SAME
    axis: int = 0
    interleaved: bool = False
    expert: int | None = None

    def shape(self, shapes):
        """The checkpoint tensor's shape, from our variables' `shapes`."""
        parts = [self.layout.shape(self._part(shapes[path])) for path in self.ours]
        if len(parts) == 1:
            return parts[0]
        total = sum(part[self.axis] for part in parts)
        return (*parts[0][: self.axis], total, *parts[0][self.axis + 1 :])

    def load(self, array, shapes):
        """`{our path: array}` from the checkpoint tensor `array` (each one
        expert's slice with `expert`)."""
        shapes = {path: self._part(shapes[path]) for path in self.ours}
        if self.interleaved:
            count = len(self.ours)
            index = [slice(None)] * array.ndim
            pieces = []
            for i in range(count):
                index[self.axis] = slice(i, None, count)
                pieces.append(array[tuple(index)])
        else:
            sizes = [self.layout.shape(shapes[path])[self.axis] for path in self.ours]
            pieces = np.split(array, np.cumsum(sizes)[:-1], axis=self.axis)
        return {
            path: self.layout.load(piece, shapes[path])
            for path, piece in zip(self.ours, pieces, strict=True)
        }

    def save(self, values):
        """The checkpoint tensor from `{our path: array}` (whole variables;
        expert slices are not written)."""
        if self.expert is not None:
            raise NotImplementedError("Writing one expert's slice is not supported.")
        parts = [self.layout.save(values[path]) for path in self.ours]
        if len(parts) == 1:
            return parts[0]
        if self.interleaved:
            stacked = np.stack(parts, axis=self.axis + 1)
            return stacked.reshape(self.shape({p: values[p].shape for p in self.ours}))
        return np.concatenate(parts, axis=self.axis)

    def _part(self, shape):
        return tuple(shape)[1:] if self.expert is not None else tuple(shape)


def link(theirs, ours, layout=SAME, axis=0, interleaved=False, expert=None):
    ours = (ours,) if isinstance(ours, str) else tuple(ours)
    return Link(theirs, ours, layout, axis, interleaved, expert)
