"""An eager attention call on JAX as one XLA program.

JAX runs every op as a compiled XLA program: an eager call of the explicit
path (the products, the mask's `where`, softmax's max, exp and sum, the
casts) runs a dozen or more, and at shapes not seen before compiles each. An
XLA program costs about the same to compile whatever its size on a CPU (on
JAX 0.10, most of it is a fresh MLIR context and LLVM target per program),
so JAX's own `jax.nn` functions are each one `jax.jit`
(`jax/_src/nn/functions.py`), and so is an eager attention call here: its
masks folded, the query scaled, the kernel run, for each plan, static option
and set of shapes one program, compiled once per process.

An eager `MultiHeadAttention` call then compiles a third of the programs at
new shapes and, compiled, takes about a third of the time
(`benchmarks/results/jax_eager.md`).

Where it does not apply (the kernel runs op by op, as before):
- inside a trace (`jit`, `grad`, `fit`): the caller's program holds it;
- dropout on the weights: it draws from a Keras `SeedGenerator`, whose
  state an eager call updates in place;
- the fused kernel on a TPU: Keras' splash attention reads a concrete mask
  and falls back to XLA's attention for a traced one
  (`keras/src/backend/jax/nn.py`, `dot_product_attention`).

Only `ops/attention.py` imports this module, and only on JAX.
"""

import dataclasses
import functools

import jax


def applies(plan, query, options, platform):
    """Whether this call runs as one program (the module docstring)."""
    return (
        not isinstance(query, jax.core.Tracer)
        and options.dropout is None
        and not (plan.kernel == "fused" and platform == "tpu")
    )


def run(function, plan, query, key, value, mask, bias, is_causal, options, segments):
    """`function(plan, query, key, value, mask, bias, is_causal, options,
    segments)` as one XLA program: the tensors (the sink logits and segment
    ids among them) are its arguments, the rest static."""
    segment_ids, band = segments
    static = dataclasses.replace(options, sink_logits=None)
    tensors = (query, key, value, mask, bias, options.sink_logits, segment_ids)
    return _compiled(function, plan, is_causal, static, band, tensors)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4))
def _compiled(function, plan, is_causal, options, band, tensors):
    query, key, value, mask, bias, sink_logits, segment_ids = tensors
    options = dataclasses.replace(options, sink_logits=sink_logits)
    segments = (segment_ids, band)
    return function(plan, query, key, value, mask, bias, is_causal, options, segments)


def clear():
    """Forget the programs compiled so far: for tests that replace a function
    or constant the kernels read while tracing (a spy, a smaller chunk), whose
    programs from earlier calls would otherwise run instead."""
    _compiled.clear_cache()
