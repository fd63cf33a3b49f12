"""Dropless grouped experts against a dense feed-forward network: forward and
training step.

    OMP_NUM_THREADS=1 KERAS_BACKEND=jax python benchmarks/mixture_of_experts.py
    OMP_NUM_THREADS=1 KERAS_BACKEND=torch python benchmarks/mixture_of_experts.py

`--tokens` tokens (4,096) of width `--width` (512) go through `--experts` (8)
gated (SwiGLU) experts of hidden width `--hidden` (1,024), each token to its
`--top-k` (2) experts: router logits from a random `(width, experts)` matrix
(roughly balanced), the top k, their softmax as the weights (computed once,
outside the timed calls: they are the same for every contender). Contenders:

- dense: one gated feed-forward network with the active parameters (hidden
  width `top_k * hidden`), the 1.00x of the table;
- grouped: `keras_attn.ops.kernels.experts.grouped_feedforward` as
  `plan_experts` chooses (and each block size in `--blocks`);
- loop: a Python loop over experts, each gathering its tokens (found on the
  host, `np.nonzero`: shapes vary, so it runs eagerly);
- all experts: every expert on every token, weighted by the routing (zero
  for unchosen experts), as keras-hub's mixture of experts does.

A training step: the gradients of `sum(out * c)` (a fixed random `c`) with
respect to the tokens, the routing weights and every matrix. Compiled as
Keras compiles a train step: `jax.jit` on JAX, `tf.function(jit_compile=True)`
on TensorFlow, eager on PyTorch (the loop eager everywhere). Reported: the
median of `--calls` calls after a warm-up call (`benchmarks/timing.py`),
contenders interleaved, against dense.

Results go to `benchmarks/results/mixture_of_experts_<backend>.md` (or
`--results DIR`).
"""

import argparse
import os
import sys

import keras
import numpy as np
from keras import ops

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.report import write_report  # noqa: E402
from benchmarks.timing import describe, time_calls  # noqa: E402
from keras_attn.ops.kernels.experts import (  # noqa: E402
    ExpertsPlan,
    ExpertWeights,
    grouped_feedforward,
    plan_experts,
)

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def swiglu(gate, up):
    return ops.silu(gate) * up


def routing(x, experts, top_k, seed=0):
    """Top-k of random router logits: ids `(N, k)` int32, softmax weights."""
    router = np.random.default_rng(seed).normal(size=(x.shape[1], experts))
    logits = x @ (router / np.sqrt(x.shape[1]))
    ids = np.argsort(-logits, axis=1)[:, :top_k]
    top = np.take_along_axis(logits, ids, axis=1)
    weights = np.exp(top - top.max(axis=1, keepdims=True))
    return ids.astype("int32"), (weights / weights.sum(1, keepdims=True)).astype(
        "float32"
    )


def dense(x, scales, gate, up, down):
    """The dense network (`scales` unused: the same arguments as the rest)."""
    return ops.matmul(swiglu(ops.matmul(x, gate), ops.matmul(x, up)), down)


def all_experts(x, scales, ids, w):
    """keras-hub's way: `(E, N, F)` hidden, every expert on every token."""
    experts = w.intermediate.shape[0]
    combine = ops.sum(ops.one_hot(ids, experts) * scales[:, :, None], axis=1)
    gate = ops.einsum("nd,edf->enf", x, w.gate)
    hidden = swiglu(gate, ops.einsum("nd,edf->enf", x, w.intermediate))
    out = ops.einsum("enf,efd->end", hidden, w.output)
    return ops.einsum("end,ne->nd", out, combine)


def loop(x, scales, ids, w):
    """A Python loop over experts, each on its own tokens (host indices)."""
    host_ids = np.asarray(ops.convert_to_numpy(ids))
    out = ops.zeros_like(x)
    for e in range(w.intermediate.shape[0]):
        tokens, slots = np.nonzero(host_ids == e)
        if len(tokens) == 0:
            continue
        rows = ops.take(x, tokens, axis=0)
        hidden = swiglu(
            ops.matmul(rows, w.gate[e]), ops.matmul(rows, w.intermediate[e])
        )
        y = ops.matmul(hidden, w.output[e])
        flat = tokens * host_ids.shape[1] + slots
        scale = ops.take(ops.reshape(scales, (-1,)), flat)[:, None]
        out = out + ops.scatter(tokens[:, None], y * scale, x.shape)
    return out


def compiled(fn, train, eager=False):
    """`fn(x, scales, m1, m2, m3)`, or its training step (the gradients of
    `sum(fn(...) * c)` for every argument), compiled as Keras compiles a
    step; called as `step(c, x, scales, m1, m2, m3)`."""
    backend = keras.config.backend()

    def loss(c, *arrays):
        return ops.sum(fn(*arrays) * c)

    def forward(c, *arrays):
        return fn(*arrays)

    if backend == "jax":
        import jax

        step = jax.grad(loss, argnums=(1, 2, 3, 4, 5)) if train else forward
        step = step if eager else jax.jit(step)
        return lambda *a: jax.block_until_ready(step(*a))
    if backend == "tensorflow":
        import tensorflow as tf

        def tf_step(c, *a):
            if not train:
                return fn(*a)
            with tf.GradientTape() as tape:
                tape.watch(a)
                total = loss(c, *a)
            return tape.gradient(total, a)

        step = tf_step if eager else tf.function(tf_step, jit_compile=True)
        return lambda *a: keras.tree.map_structure(np.asarray, step(*a))

    def torch_step(c, *a):
        if not train:
            return fn(*a).detach()
        import torch

        return torch.autograd.grad(loss(c, *a), a, allow_unused=True)

    return torch_step


def arguments(args, seed=0):
    """The cotangent, tokens, routing weights and ids, the experts' matrices
    and the dense network's, as tensors (requiring gradients on PyTorch)."""
    rng = np.random.default_rng(seed)
    d, f, e, k = args.width, args.hidden, args.experts, args.top_k

    def floats(*shape, fan_in=1):
        return (rng.normal(size=shape) / np.sqrt(fan_in)).astype("float32")

    x = floats(args.tokens, d)
    ids, scales = routing(x, e, k)
    experts = [floats(e, d, f, fan_in=d), floats(e, f, d, fan_in=f)]
    experts.append(floats(e, d, f, fan_in=d))
    dense_w = [floats(d, k * f, fan_in=d), floats(d, k * f, fan_in=d)]
    dense_w.append(floats(k * f, d, fan_in=k * f))
    trainable = keras.config.backend() == "torch"

    def tensor(a):
        t = ops.convert_to_tensor(a)
        return t.requires_grad_(True) if trainable else t

    floats_in = [tensor(a) for a in (x, scales)]
    return (
        ops.convert_to_tensor(floats(args.tokens, d)),
        floats_in,
        ops.convert_to_tensor(ids),
        [tensor(a) for a in experts],
        [tensor(a) for a in dense_w],
    )


def contenders(args, ids):
    """Name -> (function of `(x, scales, m1, m2, m3)`, eager only)."""
    # The grouped contender runs as a layer would: eagerly on PyTorch, where
    # the plan may read the group sizes to the host (`"sorted"`).
    eager_torch = keras.config.backend() == "torch"
    plan = plan_experts(args.tokens, args.top_k, args.experts, host_reads=eager_torch)

    def grouped(p):
        def run(x, scales, w1, w2, wg):
            weights = ExpertWeights(w1, w2, wg)
            return grouped_feedforward(x, ids, scales, weights, swiglu, p)

        return run

    def moe(fn):
        def run(x, scales, w1, w2, wg):
            return fn(x, scales, ids, ExpertWeights(w1, w2, wg))

        return run

    def dense_run(x, scales, gate, up, down):
        return dense(x, scales, gate, up, down)

    named = {"dense, active parameters": (dense_run, False)}
    block = f", block {plan.block_size}" if plan.block_size else ""
    named[f"grouped, plan ({plan.algorithm}{block})"] = (
        grouped(plan),
        False,
    )
    for block in args.blocks:
        if plan.algorithm == "sorted" or block != plan.block_size:
            blocks = ExpertsPlan("blocks", block)
            named[f"grouped (blocks, block {block})"] = (grouped(blocks), False)
    named["loop over experts"] = (moe(loop), True)
    if not args.no_all_experts:
        named["all experts (keras-hub)"] = (moe(all_experts), False)
    return named


def measure(args, train):
    """Each contender's `Timing`, interleaved."""
    c, (x, scales), ids, experts, dense_w = arguments(args)
    calls = {}
    for name, (fn, eager) in contenders(args, ids).items():
        matrices = dense_w if name.startswith("dense") else experts
        step = compiled(fn, train, eager)
        calls[name] = lambda step=step, m=matrices: step(c, x, scales, *m)
    return time_calls(calls, args.calls)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--blocks", type=int, nargs="*", default=[])
    parser.add_argument("--no-all-experts", action="store_true")
    parser.add_argument("--calls", type=int, default=3, help="Timed calls a point.")
    parser.add_argument("--results", default=RESULTS, help="Output folder.")
    args = parser.parse_args(argv)
    backend = keras.config.backend()
    threads = os.environ.get("OMP_NUM_THREADS", "unset")
    lines = [
        f"### Mixture of experts, `KERAS_BACKEND={backend}`: {args.tokens} tokens "
        f"of width {args.width}, {args.experts} gated experts of hidden width "
        f"{args.hidden}, top {args.top_k}",
        "",
        f"{describe(args.calls)}, contenders interleaved; OMP_NUM_THREADS="
        f"{threads}; load average {os.getloadavg()[0]:.1f} at the end (a shared "
        "machine: other processes may have run alongside). Dense: one gated "
        f"network of hidden width {args.top_k * args.hidden} (the active "
        "parameters).",
        "",
        "| step | contender | ms | vs dense |",
        "|---|---|---:|---:|",
    ]
    for step, train in (("forward", False), ("train step", True)):
        timings = measure(args, train)
        base = timings["dense, active parameters"].median
        for name, timing in timings.items():
            ms = timing.median * 1e3
            lines.append(
                f"| {step} | {name} | {ms:.1f} | {timing.median / base:.2f}x |"
            )
            print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    return write_report(args.results, f"mixture_of_experts_{backend}.md", text)


if __name__ == "__main__":
    main()
