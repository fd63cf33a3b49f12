"""Keras' projection and normalization ops on PyTorch tensors, each as the
one torch call Keras' op makes, without Keras' per-op dispatch; and the
in-place writes of the key/value caches.

Ground floor, as `_checks`: it imports nothing of ours, and only modules that
run on PyTorch import it (`ops/constants.py`, `layers/_lean_call.py`, the
caches, generation's compiled step).

On PyTorch's eager steps Python bounds a small block, and a `keras.ops`
call costs several times the torch call it makes: `keras.ops.einsum`
converts each operand (a no-op `aten::to` per tensor, keras#23274), resolves
dtypes and only then calls `torch.einsum`; `keras.ops.layer_normalization`
casts its inputs, calls `torch.nn.functional.layer_norm` and casts back.
These functions make the same torch calls on the same tensors, for the
dtype cases where Keras' op makes exactly that call (Keras 3.15.1,
`keras/src/backend/torch/numpy.py`, `keras/src/ops/nn.py`), and return
`None` elsewhere, for the caller to take Keras' op:

- `projection` (`einsum` or `matmul`, then `add`): tensors of one float
  dtype on one device (Keras casts and moves nothing then; it computes a
  float16 matmul on a CPU in float32, so that is left to it);
- `layer_norm` over the last axis, `rms_norm` over the last axis: the input
  taken to float32 and the weights to its dtype, then cast back, as Keras
  does;
- `constant`: Python numbers as a tensor (`keras_attn.ops.constants`);
- `write_slots`: a cache's new keys and values copied into its tensor in
  place, as gpt-fast's and Hugging Face's static caches are written (Keras'
  `slice_update` returns a copy of the whole cache).

Keras 3.15's dtype rules read `torch.float64` as float32 (its matmul, add and
norms compute float64 tensors in float32), so float64 is left to Keras' ops.

An einsum that is a matmul of flattened axes (every projection of
`MultiHeadAttention`; each letter once, shapes that torch's einsum takes)
runs as that matmul, and so does a `Dense` matmul: one `torch.mm` of views
of the input and kernel. Autograd then records one product, not torch
einsum's permutes and batched matmul, and a projection with its bias takes
about half the aten ops (`benchmarks/results/torch_overhead.md`). Other
equations, shapes that torch's einsum refuses, and inputs that
torch's matmul would take as a batched product go to Keras' torch call.

The numbers are Keras' own on a CPU, bit for bit at a block's shapes
(`tests/test_torch_eager.py`, `tests/layers/test_lean_path.py`), a
`Dense` matmul at every shape. At some small shapes torch's einsum takes a
batched kernel whose sums round an ulp apart from the matmul's (in a sweep,
a few with a contracted size of 32 or less, none from 64). On a GPU torch
may also pick another kernel for the matmul than for the einsum's batched
matmul, with other roundings.
"""

import functools
import math

import torch
from torch.nn import functional

FLOATS = (torch.float32, torch.bfloat16, torch.float16)  # not float64 (above)
_HALF = torch.float16  # Keras' torch matmul computes it in float32 on a CPU


def projection(x, kernel, bias=None, equation=None):
    """`keras.ops.einsum(equation, x, kernel)` (`keras.ops.matmul(x, kernel)`
    without an equation) plus `bias` with `keras.ops.add`; `None` where
    Keras would cast or move: tensors of more than one dtype or device, or
    not float, or a float16 matmul."""
    tensors = (x, kernel) if bias is None else (x, kernel, bias)
    dtype = x.dtype
    if dtype not in FLOATS or any(t.dtype != dtype for t in tensors):
        return None
    if not _one_device(*tensors):
        return None
    if equation is None:
        if dtype == _HALF:
            return None
        # Else torch's matmul: its broadcasting, or its error for a mismatch.
        matrix = kernel.dim() == 2 and x.dim() >= 2 and x.shape[-1] == kernel.shape[0]
        y = _matmul(x, kernel, 1) if matrix else None
        y = torch.matmul(x, kernel) if y is None else y
    else:  # float16 too: torch's einsum, as Keras calls it
        contracted = dtype != _HALF and _matmul_axes(equation, x, kernel)
        y = _matmul(x, kernel, contracted) if contracted else None
        y = torch.einsum(equation, x, kernel) if y is None else y
    return y if bias is None else torch.add(y, bias)


def bound_projection(kernel, bias=None, equation=None):
    """`projection(x, kernel, bias, equation)` as a function of `x`, what
    depends on the weights alone decided once (a decoding binds its
    projections so: `layers/_lean_call.py`): for an `x` of the kernel's
    dtype and device and the shape the equation folds, the same `torch.mm`
    of views and `torch.add`; for any other, `projection` itself. `None`
    where `projection` would give `None` for any `x`."""
    dtype = kernel.dtype
    if dtype not in FLOATS or (dtype == _HALF and equation is None):
        return None  # Keras' own call: float64, a float16 matmul
    if bias is not None and (bias.dtype != dtype or bias.device != kernel.device):
        return None
    form = (1, None) if equation is None else _matmul_form(equation)

    def general(x):
        return projection(x, kernel, bias, equation)

    if dtype == _HALF or form is None or (equation is None and kernel.dim() != 2):
        return general
    contracted, rank = form
    inner = tuple(kernel.shape[:contracted])

    def call(x):
        y = None
        if x.dtype == dtype and x.device == kernel.device and _fits(x, inner, rank):
            y = _matmul(x, kernel, contracted)
        if y is None:
            return general(x)
        return y if bias is None else torch.add(y, bias)

    return call


@functools.lru_cache(maxsize=64)
def _matmul_form(equation):
    """`(contracted axes, input rank or None with an ellipsis)` for an
    equation `P C, C K -> P K` (the input's last axes contracted with the
    kernel's first, the rest kept in order, each letter once: every
    projection of `MultiHeadAttention`); else `None`."""
    inputs, rest = equation.replace(" ", "").split(",")
    kernel, output = rest.split("->")
    letters = [term.replace("...", "") for term in (inputs, kernel, output)]
    if "." in kernel or any(len(set(term)) != len(term) for term in letters):
        return None  # a diagonal or a sum over a repeated letter
    for n in range(1, min(len(inputs), len(kernel))):
        kept, contracted, free = inputs[:-n], inputs[-n:], kernel[n:]
        shared = set(kept) & set(kernel)  # a batch axis of both: not a matmul
        if kernel[:n] == contracted and output == kept + free and not shared:
            rank = None if "..." in inputs else len(inputs)
            return (n, rank) if kept and free else None
    return None


def _matmul_axes(equation, x, kernel):
    """The contracted axes where `equation` of these tensors is a matmul of
    flattened axes (its form, and shapes that torch's einsum would take: else
    it raises), or `None`."""
    form = _matmul_form(equation)
    if form is None:
        return None
    contracted, rank = form
    return contracted if _fits(x, tuple(kernel.shape[:contracted]), rank) else None


def _fits(x, inner, rank):
    """Whether `x` (of rank `rank`, any rank for `None`) ends in axes of the
    sizes `inner`, the kernel's contracted ones, and keeps an axis before
    them."""
    contracted = len(inner)
    return (
        (rank is None or x.dim() == rank)
        and x.dim() > contracted
        and tuple(x.shape[x.dim() - contracted :]) == inner
    )


def _matmul(x, kernel, contracted):
    """The product of `x`'s last `contracted` axes with `kernel`'s first:
    the matrix product that `torch.matmul` makes of the flattened axes (it
    folds the input's leading axes into rows), as one `torch.mm` of views
    (an op each, where `reshape` is two and `matmul` adds its own). `None`
    for one contracted axis where `torch.matmul` would not fold (`_folds`)
    but take a batched product, with other roundings: that is left to
    Keras' call.

    torch's einsum makes the same product through permutes and a batched
    matmul, which autograd records op by op (its forward and backward twice
    a matmul's time on a CPU, at a block's small shapes)."""
    if contracted == 1 and not _folds(x, kernel):
        return None
    kept = x.shape[: x.dim() - contracted]
    size, free = math.prod(kernel.shape[:contracted]), kernel.shape[contracted:]
    rows = _flat(x, (math.prod(kept), size))  # a copy where `x` is strided
    return torch.mm(rows, _flat(kernel, (size, math.prod(free)))).view(*kept, *free)


def _folds(x, kernel):
    """Whether `torch.matmul(x, kernel)` (a matrix kernel) makes one `mm`:
    torch's `should_fold` (`aten/src/ATen/native/LinearAlgebra.cpp`, torch
    2.13) folds for a kernel that requires grad, an empty input, or leading
    axes laid out as rows (each stride the next one's times its size: size-1
    axes count, which `is_contiguous` skips); a matrix input is an `mm`."""
    if x.dim() == 2 or kernel.requires_grad or x.numel() == 0:
        return True
    sizes, strides = x.shape, x.stride()
    return all(strides[i] == strides[i + 1] * sizes[i + 1] for i in range(x.dim() - 2))


def _flat(x, shape):
    """`x.reshape(shape)`: `x` itself in that shape, else a view (one op)
    where `x` is contiguous."""
    if tuple(x.shape) == tuple(shape):
        return x
    return x.view(shape) if x.is_contiguous() else x.reshape(shape)


def layer_norm(x, gamma, beta, epsilon):
    """`keras.ops.layer_normalization(x, gamma, beta, -1, epsilon)`, or
    `None` (float64)."""
    if x.dtype not in FLOATS or not _one_device(x, gamma, beta):
        return None
    y = _as(x, torch.float32)
    gamma, beta = _as(gamma, torch.float32), _as(beta, torch.float32)
    return _as(functional.layer_norm(y, y.shape[-1:], gamma, beta, epsilon), x.dtype)


def rms_norm(x, scale, epsilon):
    """`keras.ops.rms_normalization(x, scale, -1, epsilon)`, or `None`
    (float64)."""
    if x.dtype not in FLOATS or not _one_device(x, scale):
        return None
    y = _as(x, torch.float32)
    scale = _as(scale, torch.float32)
    return _as(functional.rms_norm(y, y.shape[-1:], scale, epsilon), x.dtype)


def quantize(x):
    """`keras_attn.cache.quantize` as torch calls (the same ones Keras' ops
    make, without their dispatch): int8 `q` and float32 `scale` with `x ~ q
    * scale`."""
    x = _as(x, torch.float32)
    scale = x.abs().amax(-1, keepdim=True) / 127.0
    q = torch.round(x / torch.where(scale > 0, scale, 1.0))
    return q.to(torch.int8), scale


def dequantize(values, scale, dtype):
    """`values` (int8) times `scale` (float32, broadcast), in `dtype`: the
    int8 cache's read as one torch multiply, which casts the int8 operand as
    it reads it (no float32 copy of the cache made first, as `keras.ops.cast`
    then `multiply` make)."""
    return _as(torch.mul(values, scale), getattr(torch, dtype))


def embedding(ids, table, dtype):
    """`keras.ops.take(table, ids, axis=0)` in `dtype` (a Keras dtype name):
    the lookup Keras' `Embedding.call` makes, negative ids counted from the
    end as Keras' `take` counts them."""
    ids = ids.long()
    ids = torch.where(ids < 0, ids + table.shape[0], ids)
    return _as(functional.embedding(ids, table), getattr(torch, dtype))


def constant(values, dtype, like):
    """`torch.as_tensor(values)` in `dtype` (a Keras dtype name) on the
    device of `like`: the call Keras' `convert_to_tensor(values, dtype)`
    makes (`keras_attn.ops.constants` says why not Keras')."""
    return torch.as_tensor(values, dtype=getattr(torch, dtype), device=like.device)


def _one_device(x, *tensors):
    """Whether the tensors (`None` aside) are on `x`'s device: Keras' ops
    would move them to its own device, which is left to them."""
    return all(t is None or t.device == x.device for t in tensors)


def _as(x, dtype):
    """`x` in `dtype` (`None` stays): Keras' casts, without the no-op ones
    (an `aten::to` each on eager PyTorch)."""
    return x if x is None or x.dtype == dtype else x.to(dtype)


def recording():
    """Whether autograd records the operations run now."""
    return torch.is_grad_enabled()


def write_slots(buffer, first, second, index):
    """`first` and `second` `(B, n, K, X)` copied into `buffer`
    `(B, 2, K, S, X)` at slots `index, ..., index + n - 1` of axis 3 (the
    first at `buffer[:, 0]`), in place, through views of the buffer (no
    stacked, transposed copy of the update); returns `buffer`."""
    slots = slot_positions(index, first.shape[1], buffer.device)
    for i, update in enumerate((first, second)):
        buffer[:, i].transpose(1, 2).index_copy_(1, slots, update)  # (B, S, K, X)
    return buffer


def write_in_place(buffer, update, index, axis=1):
    """`update` copied into `buffer` at positions `index, ..., index + n - 1`
    of `axis` (`n`: the update's size there), in place; returns `buffer`."""
    slots = slot_positions(index, update.shape[axis], buffer.device)
    return buffer.index_copy_(axis, slots, update)


def slot_positions(index, count, device):
    """int64 `(count,)`: `index, ..., index + count - 1`. They stay a tensor:
    nothing is read back to the host (a CUDA graph replays no host value)."""
    if count == 1 and isinstance(index, torch.Tensor):  # a step: no `arange`
        return index.reshape(1).long()
    return index + torch.arange(count, device=device)  # int32 + int64: int64
