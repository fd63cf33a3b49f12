"""The public grouped-experts op: each token's feed-forward through its
experts, weighted and summed (`expert_feedforward`); layers call this, the
kernels under `keras_attn.ops.kernels.experts` are private."""

from keras import ops

from keras_attn.ops.kernels.experts import ExpertWeights, grouped_feedforward

__all__ = ["ExpertWeights", "expert_feedforward"]


def expert_feedforward(x, expert_ids, expert_weights, weights, hidden_fn):
    """`sum_j expert_weights[n, j] * FFN_e(x_n)`, `e = expert_ids[n, j]`, for
    every token `n`, every token reaching all its experts (no capacity).

    `FFN_e(x) = hidden_fn(x Wg_e + bg_e, x W1_e + b1_e) W2_e + b2_e` (the
    gate `None` for a plain network). The algorithm is `plan_experts`'
    choice for the static shapes (eager PyTorch: one matrix product per
    expert on its sorted rows); where the number of tokens is unknown
    when traced (a graph traced for any batch), every expert runs on every
    token, weighted by zero where it was not chosen: the same numbers, at
    `E / k` times the work.

    Args:
        x: float `(N, D)`.
        expert_ids: int32 `(N, k)`, each in `[0, E)`.
        expert_weights: float `(N, k)`.
        weights: `ExpertWeights` of the `E` experts: `intermediate` `(E, D,
            F)`, `output` `(E, F, D)`, `gate` `(E, D, F)` or None, biases
            `(E, F)`, `(E, F)`, `(E, D)` or None.
        hidden_fn: `hidden_fn(gate_or_None, up)`, elementwise.

    Returns:
        float `(N, D)`.

    Example:
    >>> w = ExpertWeights(np.ones((3, 2, 4)), np.ones((3, 4, 2)))
    >>> y = expert_feedforward(np.ones((5, 2)), np.zeros((5, 1), "int32"),
    ...                        np.ones((5, 1)), w, lambda gate, up: up)
    >>> ops.convert_to_numpy(y)[0].tolist()
    [8.0, 8.0]
    """
    num_tokens, top_k = expert_ids.shape
    if num_tokens is None:
        return _every_expert(x, expert_ids, expert_weights, weights, hidden_fn)
    # `grouped_feedforward` asks `plan_experts`, knowing whether this call
    # may read its group sizes to the host (eager PyTorch).
    return grouped_feedforward(x, expert_ids, expert_weights, weights, hidden_fn)


def _every_expert(x, expert_ids, expert_weights, weights, hidden_fn):
    """Every expert on every token, `(N, D)`, weighted by a dense `(N, E)`
    table of the routing weights (zero where not chosen)."""
    num_experts = weights.intermediate.shape[0]

    def project(matrix, bias):
        out = ops.einsum("nd,edf->enf", x, matrix)  # (E, N, F)
        return out if bias is None else out + bias[:, None, :]

    up = project(weights.intermediate, weights.intermediate_bias)
    gate = None
    if weights.gate is not None:
        gate = project(weights.gate, weights.gate_bias)
    out = ops.einsum("enf,efd->end", hidden_fn(gate, up), weights.output)
    if weights.output_bias is not None:
        out = out + weights.output_bias[:, None, :]  # (E, N, D)
    chosen = ops.one_hot(expert_ids, num_experts, dtype=out.dtype)  # (N, k, E)
    dense = ops.einsum("nke,nk->ne", chosen, ops.cast(expert_weights, out.dtype))
    return ops.einsum("end,ne->nd", out, dense)
