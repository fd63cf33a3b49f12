"""The routers and their auxiliary losses against numpy written from the
formulas (Mixtral/Qwen3-MoE, gpt-oss, DeepSeek-V3) and against
`transformers`' `load_balancing_loss_func`; the public experts op's
dense fallback against its grouped kernels."""

import keras
import numpy as np
import pytest

from keras_attn.ops import ExpertWeights, expert_feedforward, routing
from tests.helpers.backend import require, to_numpy
from tests.helpers.builders import random_floats

N, E, K = 11, 8, 3


def softmax(x):
    x = np.exp(x - x.max(-1, keepdims=True))
    return x / x.sum(-1, keepdims=True)


def top_k(x, k):
    """Indices of the `k` largest per row, largest first."""
    return np.argsort(-x, axis=-1, kind="stable")[:, :k]


def assert_routes(actual, weights, ids):
    """Same experts per token (as sets, with their weights), to 1e-6."""
    actual_weights, actual_ids = (to_numpy(a) for a in actual)
    assert actual_ids.dtype == np.int32
    for row in range(len(ids)):
        order, expected = np.argsort(actual_ids[row]), np.argsort(ids[row])
        np.testing.assert_array_equal(actual_ids[row][order], ids[row][expected])
        np.testing.assert_allclose(
            actual_weights[row][order], weights[row][expected], atol=1e-6
        )


@pytest.fixture(scope="module")
def logits():
    return random_floats(N, E, seed=1, scale=2.0)


@pytest.mark.parametrize("normalize", [True, False])
def test_softmax_top_k(logits, normalize):
    probs = softmax(logits)
    ids = top_k(probs, K)
    weights = np.take_along_axis(probs, ids, -1)
    if normalize:
        weights = weights / weights.sum(-1, keepdims=True)
    actual = routing.softmax_top_k(logits, K, normalize, scale=2.5)
    assert_routes(actual, weights * 2.5, ids)


def test_top_k_softmax(logits):
    ids = top_k(logits, K)
    weights = softmax(np.take_along_axis(logits, ids, -1))
    assert_routes(routing.top_k_softmax(logits, K, scale=0.5), weights * 0.5, ids)


def sigmoid_reference(logits, bias, groups, kept, normalize, scale):
    """DeepSeek-V3's `DeepseekV3TopkRouter.route_tokens_to_experts`."""
    scores = 1 / (1 + np.exp(-logits))
    choice = scores + bias
    if groups:
        grouped = choice.reshape(len(logits), groups, -1)
        group_scores = np.sort(grouped, -1)[..., -2:].sum(-1)
        mask = np.zeros_like(group_scores, bool)
        np.put_along_axis(mask, top_k(group_scores, kept), True, -1)
        choice = np.where(np.repeat(mask, E // groups, -1), choice, -np.inf)
    ids = top_k(choice, K)
    weights = np.take_along_axis(scores, ids, -1)
    if normalize:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return weights * scale, ids


@pytest.mark.parametrize(
    "groups, kept, normalize",
    [(None, None, True), (4, 2, True), (2, 1, False)],
)
def test_sigmoid_top_k(logits, groups, kept, normalize):
    # A bias large enough to change the choice: the weights stay uncorrected.
    bias = random_floats(E, seed=2, scale=0.5)
    weights, ids = sigmoid_reference(logits, bias, groups, kept, normalize, 2.5)
    actual = routing.sigmoid_top_k(logits, K, bias, groups, kept, normalize, 2.5)
    assert_routes(actual, weights, ids)
    unbiased = routing.sigmoid_top_k(logits, K, None, groups, kept, normalize, 2.5)
    assert not np.array_equal(to_numpy(unbiased[1]), to_numpy(actual[1]))


def test_groups_limit_the_choice(logits):
    """Every chosen expert lies in one of the kept groups."""
    _, ids = routing.sigmoid_top_k(logits, 2, None, num_groups=4, top_k_groups=1)
    groups = to_numpy(ids) // (E // 4)
    assert np.all(groups[:, 0] == groups[:, 1])


def test_load_balancing_loss_matches_transformers(logits):
    require("torch")
    import torch
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    expected = load_balancing_loss_func((torch.tensor(logits),), E, K).item()
    actual = float(to_numpy(routing.load_balancing_loss(logits, K)))
    np.testing.assert_allclose(actual, expected, rtol=1e-6)


def test_load_balancing_loss_numpy(logits):
    probs = softmax(logits)
    chosen = np.eye(E)[top_k(probs, K)]  # (N, K, E)
    expected = E * np.sum(chosen.mean(0) * probs.mean(0)[None])
    actual = float(to_numpy(routing.load_balancing_loss(logits, K)))
    np.testing.assert_allclose(actual, expected, rtol=1e-6)


def test_router_z_loss(logits):
    z = np.log(np.exp(logits).sum(-1))
    actual = float(to_numpy(routing.router_z_loss(logits)))
    np.testing.assert_allclose(actual, np.mean(z**2), rtol=1e-6)


def test_every_expert_fallback_equals_grouped():
    """Where the token count is unknown when traced, every expert runs on
    every token: the same numbers as the grouped kernels."""
    from keras_attn.ops.experts import _every_expert

    x = random_floats(N, 5, seed=3)
    shapes = [(E, 5, 7), (E, 7, 5), (E, 5, 7), (E, 7), (E, 7), (E, 5)]
    weights = ExpertWeights(  # tensors, as the layer hands them (not numpy)
        *(
            keras.ops.convert_to_tensor(random_floats(*shape, seed=seed))
            for seed, shape in enumerate(shapes, start=4)
        )
    )
    route_weights, ids = routing.softmax_top_k(random_floats(N, E, seed=10), K)

    def hidden(gate, up):
        return keras.ops.silu(gate) * up

    grouped = expert_feedforward(x, ids, route_weights, weights, hidden)
    dense = _every_expert(x, ids, route_weights, weights, hidden)
    np.testing.assert_allclose(to_numpy(dense), to_numpy(grouped), atol=1e-5)
