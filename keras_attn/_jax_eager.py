"""Eager calls on JAX as one XLA program each: attention and rotary
positions.

JAX runs every op as a compiled XLA program: an eager call of the explicit
attention path (the products, the mask's `where`, softmax's max, exp and
sum, the casts) runs a dozen or more, rotating queries or keys by their
positions about fifteen, and at shapes not seen before each compiles. An XLA
program costs about the same to compile whatever its size on a CPU (on JAX
0.10, most of it is a fresh MLIR context and LLVM target per program), so
JAX's own `jax.nn` functions are each one `jax.jit`
(`jax/_src/nn/functions.py`), and so are these eager calls: one program for
each function, static arguments and set of shapes, compiled once per
process (what that saves an eager `MultiHeadAttention` call:
`benchmarks/results/jax_eager.md`).

Inside a trace (`jit`, `grad`, `fit`) the caller's program holds the ops, and
they run as they are. Each caller says where else they must (attention: with
dropout, whose Keras `SeedGenerator` an eager call updates in place).

Ground floor, as `_checks`: it imports nothing of ours, and JAX only when a
call on JAX asks.
"""

import functools

import keras


def eager(tensors):
    """Whether this is JAX and every tensor in `tensors` (a tuple, `None`s
    and nested tuples allowed) a concrete array: an eager call, not a
    tracer, nor a symbolic `keras.Input` or a `keras.Variable`, which JAX
    does not take as a compiled program's argument."""
    if keras.config.backend() != "jax":
        return False
    import jax
    import numpy as np

    return all(
        isinstance(tensor, (jax.Array, np.ndarray))
        and not isinstance(tensor, jax.core.Tracer)
        for tensor in jax.tree_util.tree_leaves(tensors)
    )


def run(function, tensors, static=()):
    """`function(*tensors, *static)` as one XLA program: `tensors` a tuple of
    arrays (or `None`, or tuples of them), `static` a tuple of hashable
    values; compiled once per `function`, `static` and the tensors' shapes
    and dtypes."""
    return _compiled()(function, static, tensors)


@functools.cache
def _compiled():
    import jax

    @functools.partial(jax.jit, static_argnums=(0, 1))
    def compiled(function, static, tensors):
        return function(*tensors, *static)

    return compiled


def clear():
    """Forget the programs compiled so far: for tests that replace a function
    or constant these functions read while tracing (a spy, a smaller chunk),
    whose programs from earlier calls would otherwise run instead."""
    if keras.config.backend() == "jax":
        _compiled().clear_cache()
