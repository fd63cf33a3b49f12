"""Dropless grouped experts: each token's feed-forward through its `k` experts.

`grouped_feedforward(x, expert_ids, expert_weights, weights, hidden_fn)`
computes, for every token `n`,

    sum_j expert_weights[n, j] * (hidden_fn(x_n Wg_e + bg_e, x_n W1_e + b1_e) W2_e
                                  + b2_e),   e = expert_ids[n, j],

with no capacity: every token reaches all of its experts. `plan_experts` is
the one place that chooses how (an `ExpertsPlan`); the two algorithms, keras
ops only, static shapes (so they run under `jax.jit`, TensorFlow's XLA and
`torch.compile`) and differentiable on every backend:

- `"gather"`: each assignment (a token and one of its experts) gathers its
  expert's matrices and multiplies them alone. It reads `N * k` matrices: the
  way for a few tokens (decoding), where it reads no more than every expert.
- `"blocks"`: the `N * k` assignments sorted by expert, each expert's group
  padded to a multiple of `block_size` rows, so that every block of rows
  belongs to one expert; the blocks run as one batched matmul against their
  expert's gathered matrices, and each assignment takes its row back (a
  gather: the gradient is a scatter-add on every backend). The padded rows
  are bounded statically: at most `N * k + E * (block_size - 1)`.
- `"sorted"` (PyTorch in eager execution only, `torch_experts`): the
  assignments sorted by expert, the group sizes read to the host once, each
  expert's matmul on exactly its rows.

Measured and left out (CPU, one thread; `benchmarks/mixture_of_experts.py`,
8 experts, 8,192 rows of 512 times 512x1024 in equal groups; a plain
`x @ w` of the same work took 0.028 s on either backend):

- `jax.lax.ragged_dot` (JAX 0.10): 1.4-1.9 s, about 60x: on a CPU it lowers
  to a dense form that multiplies every row by every expert, masked.
- `torch.nn.functional.grouped_mm` (torch 2.13): 0.21-0.24 s, about 7.5x,
  and its documentation says "Inputs are currently expected to be
  `torch.bfloat16` values on CUDA devices with SM >= 80"; on a CPU in float32
  it runs, but needs rows whose strides are multiples of 16 bytes. Both are
  the natural kernels on a GPU, not measured there yet.
- The blocks one at a time (a Python loop, unrolled under jit: no
  `(blocks, D, F)` copy of the matrices): on PyTorch 2.89x the dense network
  forward against 2.68x for the batched blocks (block 256, a loaded machine).
- The blocks in a `fori_loop` (JAX, jit; each block's matrices by
  `ops.take` of a scalar, padding blocks skipped by `ops.cond`; no weight
  copies): forward 1.34x dense (block 256; 1.40x at 128) against 1.89x for
  the batched blocks, but the training step 2.71x (3.86x at 128) against
  2.00x: each step's gradient adds into the whole `(E, D, F)` matrices.
  Worth a custom gradient; not kept yet.
"""

import collections
import dataclasses

import keras
from keras import ops

__all__ = [
    "ExpertWeights",
    "ExpertsPlan",
    "grouped_feedforward",
    "plan_experts",
]

ExpertWeights = collections.namedtuple(
    "ExpertWeights",
    ["intermediate", "output", "gate", "intermediate_bias", "gate_bias", "output_bias"],
)
ExpertWeights.__doc__ = """The matrices of `E` experts' feed-forward networks.

`intermediate` `(E, D, F)`, `output` `(E, F, D)`, `gate` `(E, D, F)` or None
(a plain network), and the biases `intermediate_bias` `(E, F)`, `gate_bias`
`(E, F)`, `output_bias` `(E, D)`, each or None."""
ExpertWeights.__new__.__defaults__ = (None, None, None, None)

# Rule 1: the gather algorithm up to this many assignments per expert
# (`N * k <= GATHER_UP_TO * E`): it reads `N * k` matrices against the blocks'
# padded rows. TODO measured in benchmarks/mixture_of_experts.py.
GATHER_UP_TO = 1
# The blocks' rows: about a quarter of an expert's mean group (`N * k / E`),
# so the padding (about half a block per expert) adds an eighth at most, and
# the gathered block matrices stay within about 4 + 1 per expert; a power of
# two between `MIN_BLOCK` and `MAX_BLOCK`.
MIN_BLOCK = 8
MAX_BLOCK = 512
# Rule 2: on PyTorch in eager execution, `"sorted"`: 4,096 tokens, top 2 of
# 8 experts, D=512, F=1024 (benchmarks/results/mixture_of_experts_torch.md)
# the blocks took 1.67x the dense network's forward and 1.92x its training
# step, their padding and matrix copies included; `"sorted"` has neither.


@dataclasses.dataclass(frozen=True)
class ExpertsPlan:
    """How one grouped feed-forward call runs.

    Attributes:
        algorithm: `"gather"` (each assignment's expert matrices gathered),
            `"blocks"` (assignments sorted by expert into padded blocks) or
            `"sorted"` (PyTorch eager: one matmul per expert on its rows).
        block_size: int. Rows per block (`"blocks"`), else 0.
        reason: str. Why this algorithm.
    """

    algorithm: str
    block_size: int = 0
    reason: str = ""


def plan_experts(num_tokens, top_k, num_experts, block_size=None, host_reads=False):
    """Choose how `grouped_feedforward` computes `num_tokens` tokens, each
    routed to `top_k` of `num_experts` experts (static ints).

    Rules:
    1. `num_tokens * top_k <= GATHER_UP_TO * num_experts` (a few tokens,
       decoding): `"gather"`, whose weight reads then stay within one read of
       every expert.
    2. `host_reads` (PyTorch in eager execution, where a call may read its
       group sizes to the host): `"sorted"` (benchmarks/results/
       mixture_of_experts_torch.md).
    3. Otherwise `"blocks"`, of `block_size` rows (by default a power of two
       near a quarter of an expert's mean group, see `MIN_BLOCK`).
    """
    assignments = num_tokens * top_k
    if block_size is None and assignments <= GATHER_UP_TO * num_experts:
        return ExpertsPlan("gather", 0, "few assignments: at most one per expert")
    if block_size is None and host_reads:
        return ExpertsPlan("sorted", 0, "eager PyTorch: one matmul per expert")
    if block_size is None:
        quarter = max(assignments // (4 * num_experts), 1)
        block_size = min(max(1 << (quarter.bit_length() - 1), MIN_BLOCK), MAX_BLOCK)
        reason = "many assignments: blocks of about a quarter of a group"
    else:
        reason = "block size given"
    return ExpertsPlan("blocks", int(block_size), reason)


def grouped_feedforward(x, expert_ids, expert_weights, weights, hidden_fn, plan=None):
    """Each token's feed-forward through its experts, weighted and summed.

    Args:
        x: float `(N, D)`.
        expert_ids: int `(N, k)`, each in `[0, E)`.
        expert_weights: float `(N, k)`: each assignment's weight.
        weights: `ExpertWeights` of the `E` experts.
        hidden_fn: `hidden_fn(gate, up)`, elementwise on `(rows, F)`; `gate`
            is None for a plain network.
        plan: an `ExpertsPlan`; by default `plan_experts` of the shapes.

    Returns:
        float `(N, D)`.
    """
    num_tokens, top_k = expert_ids.shape
    if plan is None:
        host_reads = _torch_eager()
        num_experts = weights.intermediate.shape[0]
        plan = plan_experts(num_tokens, top_k, num_experts, host_reads=host_reads)
    if plan.algorithm == "sorted":
        from keras_attn.ops.kernels import torch_experts

        x, expert_ids, expert_weights = (
            ops.convert_to_tensor(t) for t in (x, expert_ids, expert_weights)
        )
        weights = ExpertWeights(
            *(None if w is None else ops.convert_to_tensor(w) for w in weights)
        )
        return torch_experts.grouped_feedforward(
            x, expert_ids, expert_weights, weights, hidden_fn
        )
    if plan.algorithm == "gather":
        return _gathered(x, expert_ids, expert_weights, weights, hidden_fn)
    return _blocks(x, expert_ids, expert_weights, weights, hidden_fn, plan.block_size)


def _torch_eager():
    if keras.config.backend() != "torch":
        return False
    from keras_attn.ops.kernels import torch_experts

    return torch_experts.eager()


def _take(tensor, ids):
    return None if tensor is None else ops.take(tensor, ids, axis=0)


def _feedforward(rows, weights, hidden_fn):
    """The network on rows `(G, R, D)` against per-group matrices `(G, D, F)`
    (biases `(G, F)`), `(G, R, D)`."""

    def project(matrix, bias):
        out = ops.matmul(rows, matrix)  # (G, R, F)
        return out if bias is None else out + bias[:, None, :]

    up = project(weights.intermediate, weights.intermediate_bias)
    gate = None
    if weights.gate is not None:
        gate = project(weights.gate, weights.gate_bias)
    groups, length, width = up.shape
    flat = (groups * length, width)
    if gate is not None:
        gate = ops.reshape(gate, flat)
    hidden = ops.reshape(hidden_fn(gate, ops.reshape(up, flat)), up.shape)
    out = ops.matmul(hidden, weights.output)  # (G, R, D)
    if weights.output_bias is not None:
        out = out + weights.output_bias[:, None, :]
    return out


def _gathered(x, expert_ids, expert_weights, weights, hidden_fn):
    num_tokens, top_k = expert_ids.shape
    flat_ids = ops.reshape(expert_ids, (-1,))  # (A,)
    chosen = ExpertWeights(*(_take(w, flat_ids) for w in weights))  # (A, ...)
    rows = ops.repeat(x, top_k, axis=0)[:, None, :]  # (A, 1, D)
    out = _feedforward(rows, chosen, hidden_fn)  # (A, 1, D)
    out = ops.reshape(out, (num_tokens, top_k, -1))
    scale = ops.cast(expert_weights, out.dtype)[:, :, None]
    return ops.sum(out * scale, axis=1)


def _layout(expert_ids, num_experts, block_size):
    """Where each assignment's row goes in the padded blocks: its row
    `(A,)`, each row's token `(R,)` (padding: token 0) and each block's
    expert `(R / block_size,)`; R static."""
    num_tokens, top_k = expert_ids.shape
    assignments = num_tokens * top_k
    flat_ids = ops.cast(ops.reshape(expert_ids, (-1,)), "int32")
    counts = ops.sum(ops.one_hot(flat_ids, num_experts, dtype="int32"), axis=0)
    padded = (counts + block_size - 1) // block_size * block_size  # (E,)
    padded_ends = ops.cumsum(padded)
    padded_starts = padded_ends - padded
    starts = ops.cumsum(counts) - counts
    order = ops.cast(ops.argsort(flat_ids), "int32")  # grouped by expert
    sorted_ids = ops.take(flat_ids, order)
    rank = ops.arange(assignments, dtype="int32") - ops.take(starts, sorted_ids)
    sorted_rows = ops.take(padded_starts, sorted_ids) + rank
    # Gathers only (Keras' scatter on PyTorch loops over elements in Python):
    # the inverse permutation by a second sort, each row's token from its
    # block's expert and its rank there (padding rows: a real token, unused).
    row_of = ops.take(sorted_rows, ops.cast(ops.argsort(order), "int32"))
    bound = assignments + num_experts * (block_size - 1)
    num_blocks = -(-bound // block_size)
    padded_rows = ops.arange(num_blocks * block_size, dtype="int32")
    row_expert = ops.sum(
        ops.cast(padded_ends[None, :] <= padded_rows[:, None], "int32"), axis=1
    )
    row_expert = ops.minimum(row_expert, num_experts - 1)
    row_rank = padded_rows - ops.take(padded_starts, row_expert)
    last = ops.take(starts + counts, row_expert) - 1
    sorted_index = ops.clip(ops.take(starts, row_expert) + row_rank, 0, last)
    sorted_index = ops.clip(sorted_index, 0, assignments - 1)
    token_of = ops.take(order, sorted_index) // top_k
    block_expert = ops.reshape(row_expert, (num_blocks, block_size))[:, 0]
    return row_of, token_of, block_expert


def _blocks(x, expert_ids, expert_weights, weights, hidden_fn, block_size):
    num_tokens, top_k = expert_ids.shape
    num_experts = weights.intermediate.shape[0]
    row_of, token_of, block_expert = _layout(expert_ids, num_experts, block_size)
    rows = ops.take(x, token_of, axis=0)  # (R, D)
    rows = ops.reshape(rows, (-1, block_size, x.shape[-1]))  # (blocks, b, D)
    chosen = ExpertWeights(*(_take(w, block_expert) for w in weights))
    out = _feedforward(rows, chosen, hidden_fn)  # (blocks, b, D)
    out = ops.reshape(out, (-1, x.shape[-1]))
    out = ops.reshape(ops.take(out, row_of, axis=0), (num_tokens, top_k, -1))
    scale = ops.cast(expert_weights, out.dtype)[:, :, None]
    return ops.sum(out * scale, axis=1)
