"""The grouped experts' algorithms against a numpy loop over tokens, their
gradients against the backend's autodiff of a dense reference, compiled and
eager, and the plan's rules."""

import keras
import numpy as np
import pytest

from keras_attn.ops.kernels.experts import (
    ExpertsPlan,
    ExpertWeights,
    grouped_feedforward,
    plan_experts,
)
from tests.helpers.backend import (
    BACKEND,
    compiled_value_and_gradients,
    to_numpy,
    torch_tensor,
    value_and_gradients,
)
from tests.helpers.builders import random_floats
from tests.helpers.doubles import recorded

D, F, E = 5, 7, 4
PLANS = [ExpertsPlan("gather"), ExpertsPlan("blocks", 1), ExpertsPlan("blocks", 4)]
# PyTorch in eager execution only: it reads the group sizes to the host.
PLANS += [ExpertsPlan("sorted")] if BACKEND == "torch" else []


def silu(x):
    return x / (1 + np.exp(-x))


def numpy_hidden(gate, up):
    return up * silu(gate) if gate is not None else np.maximum(up, 0)


def keras_hidden(gate, up):
    return up * keras.ops.silu(gate) if gate is not None else keras.ops.relu(up)


def expert_weights(gated, biased, seed=0):
    shapes = [(E, D, F), (E, F, D), (E, D, F), (E, F), (E, F), (E, D)]
    wanted = [True, True, gated, biased, biased and gated, biased]
    return ExpertWeights(
        *(
            random_floats(*shape, seed=seed + i) if keep else None
            for i, (shape, keep) in enumerate(zip(shapes, wanted, strict=True))
        )
    )


def numpy_reference(x, ids, scales, w):
    """The definition, one token and one expert at a time."""
    out = np.zeros_like(x)
    for n in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = ids[n, j]

            def project(m, b, n=n, e=e):
                y = x[n] @ m[e]
                return y if b is None else y + b[e]

            gate = None if w.gate is None else project(w.gate, w.gate_bias)
            hidden = numpy_hidden(gate, project(w.intermediate, w.intermediate_bias))
            y = hidden @ w.output[e]
            y = y if w.output_bias is None else y + w.output_bias[e]
            out[n] += scales[n, j] * y
    return out


def dense_reference(x, ids, scales, w):
    """Every expert on every token (keras ops), weighted by a one-hot of the
    routing: the autodiff reference for the gradients."""
    routing = keras.ops.sum(
        keras.ops.one_hot(ids, E) * scales[:, :, None], axis=1
    )  # (N, E)

    def project(m, b):
        y = keras.ops.einsum("nd,edf->enf", x, m)
        return y if b is None else y + b[:, None, :]

    gate = None if w.gate is None else project(w.gate, w.gate_bias)
    hidden = keras_hidden(gate, project(w.intermediate, w.intermediate_bias))
    y = keras.ops.einsum("enf,efd->end", hidden, w.output)
    if w.output_bias is not None:
        y = y + w.output_bias[:, None, :]
    return keras.ops.einsum("end,ne->nd", y, routing)


ROUTINGS = {
    "balanced": lambda n, k: np.stack(
        [(np.arange(n) + j) % E for j in range(k)], axis=1
    ),
    # expert 3 gets no token, expert 0 gets every token
    "unbalanced": lambda n, k: np.stack(
        [np.zeros(n, int)] + [1 + (np.arange(n) + j) % 2 for j in range(k - 1)],
        axis=1,
    ),
    "random": lambda n, k: np.argsort(np.random.default_rng(n).random((n, E)), axis=1)[
        :, :k
    ],
}


def inputs(n, k, routing, gated=True, biased=True):
    x = random_floats(n, D, seed=10)
    ids = ROUTINGS[routing](n, k).astype("int32")
    scales = np.random.default_rng(11).random((n, k)).astype("float32")
    return x, ids, scales, expert_weights(gated, biased)


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: f"{p.algorithm}{p.block_size}")
@pytest.mark.parametrize(
    "n, k, routing, gated, biased",
    [
        (11, 2, "random", True, True),
        (11, 2, "unbalanced", True, True),
        (9, 1, "balanced", False, True),
        (9, 2, "unbalanced", False, False),
        (1, 2, "random", True, False),
        (1, 1, "random", False, True),
    ],
)
def test_each_algorithm_matches_the_loop_over_tokens(
    plan, n, k, routing, gated, biased
):
    x, ids, scales, w = inputs(n, k, routing, gated, biased)
    out = grouped_feedforward(x, ids, scales, w, keras_hidden, plan)
    expected = numpy_reference(x, ids, scales, w)
    np.testing.assert_allclose(to_numpy(out), expected, atol=1e-5, rtol=1e-5)


def _flat_weights(gated, biased):
    w = expert_weights(gated, biased)
    present = [i for i, m in enumerate(w) if m is not None]
    return [w[i] for i in present], present


def _call(fn, ids, present):
    def call(x, scales, *matrices):
        full = [None] * 6
        for i, m in zip(present, matrices, strict=True):
            full[i] = m
        return fn(x, ids, scales, ExpertWeights(*full))

    return call


@pytest.mark.parametrize(
    "plan", PLANS[:2] + [ExpertsPlan("blocks", 8)] + PLANS[3:], ids=str
)
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_gradients_reach_the_inputs_the_routing_weights_and_every_matrix(
    plan, compiled
):
    if compiled and plan.algorithm == "sorted":
        pytest.skip("eager only: the plan never chooses it while compiling")
    x, ids, scales, _ = inputs(13, 2, "unbalanced")
    matrices, present = _flat_weights(gated=True, biased=True)
    ids = keras.ops.convert_to_tensor(ids)
    grouped = _call(
        lambda *a: grouped_feedforward(*a, keras_hidden, plan), ids, present
    )
    dense = _call(dense_reference, ids, present)
    run = compiled_value_and_gradients if compiled else value_and_gradients
    cotangent = random_floats(13, D, seed=99)
    out, grads = run(grouped, x, scales, *matrices, cotangent=cotangent)
    ref, ref_grads = value_and_gradients(
        dense, x, scales, *matrices, cotangent=cotangent
    )
    np.testing.assert_allclose(out, ref, atol=1e-5, rtol=1e-5)
    assert len(grads) == 2 + 6
    for i, (g, r) in enumerate(zip(grads, ref_grads, strict=True)):
        assert np.abs(r).max() > 0
        np.testing.assert_allclose(g, r, atol=1e-4, rtol=1e-4, err_msg=str(i))


@pytest.mark.parametrize(
    "tokens, top_k, experts, algorithm, block",
    [
        (1, 2, 8, "gather", 0),  # decoding one token
        (4, 2, 8, "gather", 0),  # 8 assignments, 8 experts
        (5, 2, 8, "blocks", 8),  # past one assignment per expert
        (4096, 2, 8, "blocks", 256),  # a quarter of the mean group (1024)
        (4096, 1, 64, "blocks", 16),
        (10**6, 2, 8, "blocks", 512),  # at most MAX_BLOCK
    ],
)
def test_plan_rules(tokens, top_k, experts, algorithm, block):
    plan = plan_experts(tokens, top_k, experts)
    assert (plan.algorithm, plan.block_size) == (algorithm, block)
    assert plan.reason


def test_eager_pytorch_sorts_past_a_few_tokens():
    assert plan_experts(1, 2, 8, host_reads=True).algorithm == "gather"
    assert plan_experts(4096, 2, 8, host_reads=True).algorithm == "sorted"
    assert plan_experts(4096, 2, 8, 64, host_reads=True).algorithm == "blocks"


@pytest.mark.skipif(BACKEND != "torch", reason="PyTorch's eager execution")
def test_the_default_plan_sorts_in_eager_pytorch_only(monkeypatch):
    """Eager PyTorch sorts (a host read); under `torch.compile` the plan
    takes another path. Dynamo's trace is what chooses the path, so its
    eager backend proves the point: Inductor's code generation took 55 s of
    the suite."""
    import torch

    from keras_attn.ops.kernels import torch_experts

    def compiling(*args, **kwargs):
        return torch.compiler.is_compiling()

    sorted_calls = recorded(
        monkeypatch, torch_experts, "grouped_feedforward", compiling
    )
    x, ids, scales, w = inputs(11, 2, "unbalanced")
    expected = numpy_reference(x, ids, scales, w)

    def feedforward(*a):
        return grouped_feedforward(*a, w, keras_hidden)

    for run in (feedforward, torch.compile(feedforward, backend="eager")):
        out = run(*(torch_tensor(a) for a in (x, ids, scales)))
        np.testing.assert_allclose(to_numpy(out), expected, atol=1e-5, rtol=1e-5)
    assert sorted_calls == [False], sorted_calls


@pytest.mark.skipif(BACKEND != "torch", reason="PyTorch's CUDA graphs")
def test_no_host_read_while_a_cuda_graph_is_captured(monkeypatch):
    """A CPU double of the CUDA-graph rule: a synchronizing call (`.tolist()`,
    `.item()`) is not allowed during capture (PyTorch's "CUDA Graphs"
    notes, "Constraints"), so the sorted path must stand down there."""
    import torch

    from keras_attn.ops.kernels import torch_experts

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert not torch_experts.eager()

    def refuse(*args, **kwargs):
        raise AssertionError("the sorted path ran during a capture")

    monkeypatch.setattr(torch_experts, "grouped_feedforward", refuse)
    x, ids, scales, w = inputs(11, 2, "unbalanced")
    out = grouped_feedforward(x, ids, scales, w, keras_hidden)
    expected = numpy_reference(x, ids, scales, w)
    np.testing.assert_allclose(to_numpy(out), expected, atol=1e-5, rtol=1e-5)


def test_a_given_block_size_is_kept():
    plan = plan_experts(2, 1, 8, block_size=3)
    assert (plan.algorithm, plan.block_size) == ("blocks", 3)


@pytest.mark.skipif(BACKEND != "jax", reason="jax.jit")
def test_the_blocks_run_under_jit_with_static_shapes():
    import jax

    x, ids, scales, w = inputs(11, 2, "random")
    step = jax.jit(
        lambda *a: grouped_feedforward(*a, w, keras_hidden, ExpertsPlan("blocks", 4))
    )
    expected = numpy_reference(x, ids, scales, w)
    np.testing.assert_allclose(step(x, ids, scales), expected, atol=1e-5, rtol=1e-5)
