"""Property-based tests: MultiHeadAttention equals a float64 numpy reference.

Over random batch sizes, query and key lengths, widths, head counts (grouped
query included) and boolean masks (fully masked rows included), on the fused
path (`flash_attention=None`) and the explicit one (`flash_attention=False`).
JAX compiles every new shape, so the number of examples is kept small (fewer
on JAX); `derandomize=True` makes every run (and CI) test the same examples.
"""

import keras
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from keras_attn import MultiHeadAttention
from tests.helpers.backend import BACKEND, to_numpy
from tests.helpers.references import attention_reference

# Key length 1 is a case like any other here.
pytestmark = pytest.mark.filterwarnings("ignore:You are using a softmax over axis -1")

SETTINGS = settings(
    # JAX compiles the fused kernel for every new shape (about 1.5 s an
    # example on one CPU core), the other backends take milliseconds.
    max_examples=6 if BACKEND == "jax" else 25,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@st.composite
def attention_cases(draw):
    """Sizes, masks and inputs of one MultiHeadAttention call."""
    kv_heads = draw(st.integers(1, 3))
    heads = kv_heads * draw(st.integers(1, 3))  # grouped-query when > 1
    key_dim = draw(st.none() | st.integers(1, 5))  # None: the width // heads
    query_width = heads * draw(st.integers(1, 3)) if key_dim is None else None
    case = {
        "batch": draw(st.integers(1, 3)),
        "query_length": draw(st.integers(1, 7)),
        "heads": heads,
        "kv_heads": kv_heads if kv_heads < heads or draw(st.booleans()) else None,
        "key_dim": key_dim,
        "value_dim": draw(st.sampled_from([None, 2, 3])),
        "query_width": query_width or draw(st.integers(1, 9)),
        "causal": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**16)),
    }
    self_attention = draw(st.booleans())
    case["key_length"] = (
        case["query_length"] if self_attention else draw(st.integers(1, 7))
    )
    case["value_width"] = None if self_attention else draw(st.integers(1, 9))
    batch, t, s = case["batch"], case["query_length"], case["key_length"]
    # Boolean masks, None or drawn per position; rows of all False included.
    masks = st.lists(st.booleans(), min_size=batch * s, max_size=batch * s)
    case["value_mask"] = draw(st.none() | masks)
    attention = st.lists(st.booleans(), min_size=batch * t * s, max_size=batch * t * s)
    case["attention_mask"] = draw(st.none() | attention)
    return case


def keras_bias_misfires(case):
    """Whether a projection has heads of width 1 as many as its positions."""
    key_width = case["key_dim"] or case["query_width"] // case["heads"]
    value_width = case["value_dim"] or key_width
    kv_heads = case["kv_heads"] or case["heads"]
    projections = [
        (case["heads"], key_width, case["query_length"]),
        (kv_heads, key_width, case["key_length"]),
        (kv_heads, value_width, case["key_length"]),
    ]
    return any(w == 1 and 1 < h == n for h, w, n in projections)


def inputs_and_masks(case):
    batch, t, s = case["batch"], case["query_length"], case["key_length"]
    rng = np.random.default_rng(case["seed"])
    query = rng.standard_normal((batch, t, case["query_width"])).astype("float32")
    value = None
    if case["value_width"] is not None:
        value = rng.standard_normal((batch, s, case["value_width"])).astype("float32")
    kwargs, allowed = {}, np.ones((batch, 1, t, s), bool)
    if case["value_mask"] is not None:
        kwargs["value_mask"] = np.reshape(case["value_mask"], (batch, s))
        allowed &= kwargs["value_mask"][:, None, None, :]
    if case["attention_mask"] is not None:
        kwargs["attention_mask"] = np.reshape(case["attention_mask"], (batch, t, s))
        allowed &= kwargs["attention_mask"][:, None]
    if case["causal"]:
        kwargs["use_causal_mask"] = True
        allowed &= np.tril(np.ones((t, s), bool))
    return query, value, kwargs, allowed


@SETTINGS
@given(attention_cases())
def test_multi_head_attention_equals_numpy_reference(case):
    # On TensorFlow the layer refuses heads of width 1 as many as the positions
    # (a Keras bug, see test_heads_of_width_one_as_many_as_the_positions).
    assume(BACKEND != "tensorflow" or not keras_bias_misfires(case))
    query, value, kwargs, allowed = inputs_and_masks(case)
    layer = MultiHeadAttention(
        num_heads=case["heads"],
        key_dim=case["key_dim"],
        value_dim=case["value_dim"],
        num_key_value_heads=case["kv_heads"],
        bias_initializer=keras.initializers.RandomNormal(seed=case["seed"]),
    )
    args = (query,) if value is None else (query, value)
    layer.build(query.shape, None if value is None else value.shape)
    expected = attention_reference(layer, query, args[-1], allowed)

    fused = to_numpy(layer(*args, **kwargs))  # flash_attention=None
    assert np.all(np.isfinite(fused))
    np.testing.assert_allclose(fused, expected, atol=2e-5, rtol=1e-4)

    layer.flash_attention = False  # the explicit path, same weights
    output, scores = layer(*args, return_attention_scores=True, **kwargs)
    np.testing.assert_allclose(to_numpy(output), expected, atol=2e-5, rtol=1e-4)
    # Each row of weights sums to 1, or is all zeros when nothing is allowed.
    scores = to_numpy(scores)
    allowed = np.broadcast_to(allowed, scores.shape)
    np.testing.assert_array_equal(scores[~allowed], 0.0)
    sums = scores.sum(-1)
    np.testing.assert_allclose(sums, allowed.any(-1).astype("float32"), atol=1e-5)
