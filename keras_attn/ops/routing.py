"""Mixture-of-experts routing: which `k` of `E` experts each token reaches,
with which weights, and the routers' auxiliary losses.

Every router takes the router's logits `(N, E)` and returns `(weights (N,
k) float32, expert_ids (N, k) int32)`. Scores are computed in float32 (the
routers of Mixtral, Qwen3-MoE, gpt-oss and DeepSeek-V3 in `transformers`
do the same).
"""

from keras import ops

__all__ = [
    "load_balancing_loss",
    "router_z_loss",
    "sigmoid_top_k",
    "softmax_top_k",
    "top_k_softmax",
]


def softmax_top_k(logits, top_k, normalize=True, scale=1.0):
    """Softmax over all experts, then the `top_k` largest (Mixtral,
    Qwen3-MoE); with `normalize` the `k` weights are renormalized to sum 1
    (Mixtral always, Qwen3-MoE by `norm_topk_prob`); then times `scale`.

    Example:
    >>> weights, ids = softmax_top_k(np.array([[0.0, 2.0, 1.0]]), top_k=2)
    >>> ops.convert_to_numpy(ids).tolist()
    [[1, 2]]
    """
    probs = ops.softmax(ops.cast(logits, "float32"), axis=-1)  # (N, E)
    weights, ids = ops.top_k(probs, top_k)  # (N, k)
    if normalize:
        weights = weights / ops.sum(weights, axis=-1, keepdims=True)
    return weights * scale, ops.cast(ids, "int32")


def top_k_softmax(logits, top_k, scale=1.0):
    """The `top_k` largest logits, then a softmax over those `k` (gpt-oss);
    times `scale`."""
    values, ids = ops.top_k(ops.cast(logits, "float32"), top_k)  # (N, k)
    return ops.softmax(values, axis=-1) * scale, ops.cast(ids, "int32")


def sigmoid_top_k(
    logits,
    top_k,
    correction_bias=None,
    num_groups=None,
    top_k_groups=None,
    normalize=True,
    scale=1.0,
):
    """DeepSeek-V3's router: `scores = sigmoid(logits)`; experts chosen by
    `scores + correction_bias`, within the `top_k_groups` best of
    `num_groups` groups (a group's score: the sum of its two best corrected
    scores) when `num_groups` is given; weighted by their uncorrected
    scores, divided by their sum (+ 1e-20) with `normalize`, times `scale`.
    """
    scores = ops.sigmoid(ops.cast(logits, "float32"))  # (N, E)
    choice = scores
    if correction_bias is not None:
        choice = choice + ops.cast(correction_bias, "float32")
    if num_groups is not None:
        choice = _keep_groups(choice, num_groups, top_k_groups)
    _, ids = ops.top_k(choice, top_k)  # (N, k)
    weights = ops.take_along_axis(scores, ids, axis=-1)
    if normalize:
        weights = weights / (ops.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return weights * scale, ops.cast(ids, "int32")


def _keep_groups(choice, num_groups, top_k_groups):
    """`choice` `(N, E)` with the experts outside each token's
    `top_k_groups` best groups set to float32's minimum."""
    num_experts = choice.shape[-1]
    per_group = num_experts // num_groups
    grouped = ops.reshape(choice, (-1, num_groups, per_group))  # (N, G, E/G)
    best, _ = ops.top_k(grouped, min(2, per_group))
    group_scores = ops.sum(best, axis=-1)  # (N, G)
    _, group_ids = ops.top_k(group_scores, top_k_groups)  # (N, g)
    kept = ops.sum(ops.one_hot(group_ids, num_groups), axis=1) > 0  # (N, G)
    kept = ops.repeat(kept, per_group, axis=-1)  # (N, E)
    return ops.where(kept, choice, ops.cast(-3.4028235e38, "float32"))


def load_balancing_loss(logits, top_k, real=None):
    """Switch Transformer's load-balancing loss for one layer, as
    `transformers`' `load_balancing_loss_func` computes it:
    `E * sum_e f_e P_e`, `f_e` the mean over tokens and the `k` slots of
    expert `e` being in a token's top-`k` of the softmax, `P_e` the mean
    softmax probability of `e`. `logits` `(N, E)`; `real`: optional float
    `(N,)`, 1 for real tokens and 0 for padding, which the means leave out
    (its `attention_mask`). A float32 scalar."""
    probs = ops.softmax(ops.cast(logits, "float32"), axis=-1)  # (N, E)
    num_experts = probs.shape[-1]
    _, ids = ops.top_k(probs, top_k)  # (N, k)
    chosen = ops.one_hot(ids, num_experts, dtype="float32")  # (N, k, E)
    tokens_per_expert = _mean_over_tokens(chosen, real)  # (k, E)
    prob_per_expert = _mean_over_tokens(probs, real)  # (E,)
    return ops.sum(tokens_per_expert * prob_per_expert[None, :]) * num_experts


def router_z_loss(logits, real=None):
    """ST-MoE's router z-loss (Zoph et al. 2022):
    `mean(logsumexp(logits)^2)` over the (real) tokens; a float32 scalar."""
    z = ops.logsumexp(ops.cast(logits, "float32"), axis=-1)  # (N,)
    return _mean_over_tokens(ops.square(z), real)


def _mean_over_tokens(values, real):
    """The mean over the first axis, of the rows `real` marks (all without)."""
    if real is None:
        return ops.mean(values, axis=0)
    weights = ops.reshape(real, (-1,) + (1,) * (len(values.shape) - 1))
    return ops.sum(values * weights, axis=0) / ops.maximum(ops.sum(real), 1.0)
