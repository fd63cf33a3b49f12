"""The grouped experts on PyTorch in eager execution: `"sorted"`.

The one place the experts import a backend module. In eager PyTorch the
assignments' per-expert counts can be read to the host once a call, and
then each expert multiplies exactly its own contiguous rows: no padding, no
`(blocks, D, F)` copy of the matrices, no Keras scatter (which on PyTorch
loops over elements in Python). The gradients come from torch's autograd:
`index_select`'s is an `index_add_`, one kernel.

Eager only: under `torch.compile` or CUDA graph capture a host read breaks
the graph (or fails), and `eager()` says no; the plan then keeps the static
`"blocks"` algorithm.
"""

import torch


def eager():
    """Whether this call may read a tensor to the host (no tracing, no
    compiling, no CUDA graph being captured)."""
    if torch.compiler.is_compiling() or torch.jit.is_tracing():
        return False
    return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def grouped_feedforward(x, expert_ids, expert_weights, weights, hidden_fn):
    """`experts.grouped_feedforward`'s sum, one matmul per expert on its rows."""
    num_tokens, top_k = expert_ids.shape
    num_experts = weights.intermediate.shape[0]
    flat_ids = expert_ids.reshape(-1).long()  # (A,)
    order = torch.argsort(flat_ids, stable=True)  # grouped by expert
    # The one host read, allowed in eager execution only (`eager()`): the
    # group sizes make the slices' shapes.
    counts = torch.bincount(flat_ids, minlength=num_experts).tolist()
    rows = x.index_select(0, order // top_k)  # (A, D), sorted
    outs = []
    for e, group in enumerate(torch.split(rows, counts)):
        # Empty groups run too: their matrices then get zero gradients.
        outs.append(_expert(group, weights, e, hidden_fn))
    out = torch.cat(outs)  # (A, D), sorted
    out = out.index_select(0, torch.argsort(order))  # (A, D), by assignment
    out = out.reshape(num_tokens, top_k, -1)
    scale = expert_weights.to(out.dtype)[:, :, None]
    return (out * scale).sum(dim=1)


def _expert(rows, weights, e, hidden_fn):
    def project(matrix, bias):
        out = rows @ matrix[e]  # (R, F)
        return out if bias is None else out + bias[e]

    up = project(weights.intermediate, weights.intermediate_bias)
    gate = None
    if weights.gate is not None:
        gate = project(weights.gate, weights.gate_bias)
    out = hidden_fn(gate, up) @ weights.output[e]  # (R, D)
    return out if weights.output_bias is None else out + weights.output_bias[e]
