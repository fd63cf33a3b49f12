"""The chunked explicit path's own gradient (`keras_attn/ops/kernels/chunked.py`):
compiled as each backend trains, it equals the materialized path's, and under
TensorFlow's XLA it keeps no weights of the whole length, lengths known only
at run time (`plan.RUNTIME`) included."""

import keras
import numpy as np
import pytest

from keras_attn import ops as attn_ops
from keras_attn.ops import plan
from keras_attn.ops.attention import attend
from keras_attn.ops.positions import segment_runs
from tests.helpers.backend import (
    BACKEND,
    compiled_value_and_gradients,
    value_and_gradients,
)
from tests.helpers.builders import random_floats
from tests.helpers.doubles import largest_array, largest_xla_array

CASES = {
    "causal, a mask and a bias per row, grouped heads, a soft cap": dict(
        keys=11, value_width=8, bias=(1, 4, 11, 11), causal=True, cap=5.0
    ),
    "cross-attention: a mask only, a bias shared by the rows, values of "
    "another width": dict(keys=7, value_width=6, bias=(1, 4, 1, 7), causal=False),
}


@pytest.mark.parametrize("case", CASES)
def test_compiled_chunked_gradients_equal_the_materialized_path(case, small_chunks):
    """Everything the chunked path handles, in two calls: masks per row that
    leave rows empty, biases per row and shared (its gradient summed over
    the rows), grouped heads, a soft cap, keys of another length and values
    of another width, a padded last chunk (11 rows in chunks of 4)."""
    case = CASES[case]
    q = random_floats(2, 11, 4, 8, seed=1, scale=3.0)
    k = random_floats(2, case["keys"], 2, 8, seed=2)
    v = random_floats(2, case["keys"], 2, case["value_width"], seed=3)
    bias = random_floats(*case["bias"], seed=4)
    mask = np.random.default_rng(5).random((2, 1, 11, case["keys"])) > 0.3
    mask[:, :, ::4] = False  # rows with no key: zeros, and no gradient

    def attend(q, k, v, bias):
        return attn_ops.dot_product_attention(
            q, k, v, mask=mask, bias=bias, is_causal=case["causal"],
            logit_soft_cap=case.get("cap"),
        )  # fmt: skip

    chunked = compiled_value_and_gradients(attend, q, k, v, bias)
    assert small_chunks.calls, "the chunked path did not run"
    small_chunks()
    # The reference as it runs fastest: JAX's eager calls each compile.
    reference = (
        compiled_value_and_gradients if BACKEND == "jax" else value_and_gradients
    )
    materialized = reference(attend, q, k, v, bias)
    for ours, theirs in zip(
        keras.tree.flatten(chunked), keras.tree.flatten(materialized), strict=True
    ):
        np.testing.assert_allclose(ours, theirs, atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(chunked[0][:, ::4], 0.0)
    assert np.abs(chunked[1][-1]).max() > 0.01  # a bias gradient to compare


def _tensorflow_unknown_lengths(fn, arrays, jit_compile):
    """`fn` under `tf.function` traced with every length unknown (axis 1 of
    the rank-4 arrays, the last axis of the others), as Keras traces
    `keras.Input((None, width))`."""
    import tensorflow as tf

    def unknown(x, axes):
        shape = list(np.shape(x))
        for axis in axes:
            shape[axis] = None
        return tf.TensorSpec(shape, tf.as_dtype(np.asarray(x).dtype))

    specs = [unknown(x, (1,) if np.ndim(x) == 4 else (-1,)) for x in arrays]
    return tf.function(fn, input_signature=specs, jit_compile=jit_compile)


@pytest.mark.skipif(BACKEND != "tensorflow", reason="TensorFlow's XLA program")
def test_tensorflow_xla_gradient_keeps_no_weights_of_the_whole_length(monkeypatch):
    """The largest array in the XLA program of a gradient step (TensorFlow's
    `experimental_get_compiler_ir(...)(stage="optimized_hlo")`, whose HLO
    text writes each array's shape, e.g. `f32[1,2,32,256]`): in chunks, a
    chunk's logits; materialized, all `H * T * S` of them (the memory rule of
    `plan.CHUNKED_FROM`, `benchmarks/long_sequence.py`). Traced with the
    length unknown (`keras.Input((None, width))`), a training call's rule is
    computed in the graph: chunks at 256 rows, one chunk under
    `CHUNKED_FROM`; an inference call materializes (what export takes)."""
    import tensorflow as tf

    monkeypatch.setattr(plan, "CHUNK_LOGITS", 2 * 32 * 256)  # chunks of 32 rows
    q = random_floats(1, 256, 2, 8)

    def largest(chunked_from, length=256, unknown=False, training=True):
        monkeypatch.setattr(plan, "CHUNKED_FROM", chunked_from)

        def gradient(q):
            with tf.GradientTape() as tape:
                tape.watch(q)
                output = attend(q, q, q, is_causal=True, training=training)
                total = tf.reduce_sum(output * output)
            return tape.gradient(total, q)

        if unknown:
            traced = _tensorflow_unknown_lengths(gradient, [q], jit_compile=True)
        else:
            traced = tf.function(gradient, jit_compile=True)
        return largest_xla_array(traced, tf.constant(q[:, :length]))

    assert largest(1) == 2 * 32 * 256
    assert largest(float("inf")) >= 2 * 256 * 256
    assert largest(2 * 64 * 256, unknown=True) == 2 * 32 * 256
    assert largest(2 * 64 * 256, length=48, unknown=True) == 2 * 48 * 48
    assert largest(2 * 64 * 256, unknown=True, training=False) >= 2 * 256 * 256


@pytest.mark.skipif(BACKEND != "tensorflow", reason="TensorFlow's unknown lengths")
@pytest.mark.parametrize("jit_compile", [False, True], ids=["graph", "xla"])
def test_tensorflow_lengths_known_at_run_time_go_in_chunks(jit_compile, small_chunks):
    """A training call traced with the lengths unknown (`keras.Input((None,
    width))`) still goes in chunks, counted in the graph (`plan.RUNTIME`; 11
    rows in chunks of 4): causal, masked, a sliding window's band with a
    sink, segment ids and sink logits, forward and backward, equal to the
    materialized path, in a graph and under XLA; a call of no rows gives no
    rows."""
    import tensorflow as tf

    q = random_floats(2, 11, 4, 8, seed=1, scale=3.0)
    k, v = random_floats(2, 11, 2, 8, seed=2), random_floats(2, 11, 2, 8, seed=3)
    ids = np.array([[5] * 3 + [2] * 6 + [5] * 2, [1] * 11], dtype="int32")
    sinks = random_floats(4, seed=4)
    cotangent = tf.constant(random_floats(2, 11, 4, 8, seed=99))

    def step(q, k, v, ids):
        with tf.GradientTape() as tape:
            tape.watch((q, k, v))
            runs = segment_runs(ids)
            output = attend(
                q, k, v, is_causal=True, segment_ids=(runs, runs),
                sink_logits=sinks, training=True, band=(5, 1),
                mask=tf.sequence_mask(tf.shape(k)[1] - 1 - tf.range(2), tf.shape(k)[1])[
                    :, None, None
                ],
            )  # fmt: skip
            total = tf.reduce_sum(output * cotangent[:, : tf.shape(q)[1]])
        return output, tape.gradient(total, (q, k, v))

    traced = _tensorflow_unknown_lengths(step, (q, k, v, ids), jit_compile)
    ours = traced(q, k, v, ids)
    assert small_chunks.calls == [(2, None, 4, 8)], small_chunks.calls
    empty = traced(q[:, :0], k[:, :0], v[:, :0], ids[:, :0])
    assert [tuple(x.shape) for x in keras.tree.flatten(empty)] == [
        (2, 0, 4, 8), (2, 0, 4, 8), (2, 0, 2, 8), (2, 0, 2, 8)
    ]  # fmt: skip
    small_chunks()
    theirs = step(*(tf.constant(x) for x in (q, k, v, ids)))
    for a, b in zip(keras.tree.flatten(ours), keras.tree.flatten(theirs), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


def test_chunked_segment_ids_equal_their_materialized_mask(small_chunks):
    """Segment ids ride with each chunk (11 rows in chunks of 4, a segment
    across a chunk's border, an id coming back later: a third document, which
    does not see the first), forward and backward: they give what their mask
    `segment_mask` gives, materialized."""
    q = random_floats(2, 11, 4, 8, seed=1, scale=3.0)
    k, v = random_floats(2, 11, 2, 8, seed=2), random_floats(2, 11, 2, 8, seed=3)
    ids = np.array([[5] * 3 + [2] * 6 + [5] * 2, [1] * 11], dtype="int32")
    padding = (np.arange(11) < np.array([[11], [9]]))[:, None, None, :]  # (B, 1, 1, S)

    def chunked(q, k, v):
        return attn_ops.dot_product_attention(
            q, k, v, mask=padding, is_causal=True, query_segment_ids=ids
        )

    segments = keras.ops.convert_to_numpy(attn_ops.segment_mask(ids))[:, 0]
    assert not segments[0, 9:, :3].any()  # the third document, the first's id

    def materialized(q, k, v):
        mask = attn_ops.merge_attention_masks(padding, attn_ops.segment_mask(ids))
        return attn_ops.dot_product_attention(q, k, v, mask=mask, is_causal=True)

    ours = compiled_value_and_gradients(chunked, q, k, v)
    assert small_chunks.calls, "the chunked path did not run"
    small_chunks()
    reference = (
        compiled_value_and_gradients if BACKEND == "jax" else value_and_gradients
    )
    theirs = reference(materialized, q, k, v)
    for a, b in zip(keras.tree.flatten(ours), keras.tree.flatten(theirs), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(BACKEND != "jax", reason="JAX's traced program (its jaxpr)")
def test_segment_ids_keep_the_chunked_gradient_linear_in_memory(monkeypatch):
    """Packed rows in chunks (T = S = 256, chunks of 32 rows): no array of
    the program of a gradient step, as traced before XLA fuses anything, has
    `T * S` elements (each chunk builds its own `(B, 1, 32, S)` mask). The
    segment mask folded in, or the materialized path, would."""
    import jax

    monkeypatch.setattr(plan, "CHUNK_LOGITS", 2 * 32 * 256)  # chunks of 32 rows
    q = random_floats(1, 256, 2, 8)
    ids = np.repeat(np.arange(8, dtype="int32"), 32)[None]  # 8 documents

    def largest(chunked_from, **segments):
        monkeypatch.setattr(plan, "CHUNKED_FROM", chunked_from)

        def loss(q):
            output = attn_ops.dot_product_attention(q, q, q, is_causal=True, **segments)
            return (output * output).sum()

        return largest_array(jax.grad(loss), q)

    assert largest(1, query_segment_ids=ids) < 256 * 256
    assert largest(1, mask=attn_ops.segment_mask(ids)) >= 256 * 256
    assert largest(float("inf"), query_segment_ids=ids) >= 256 * 256
