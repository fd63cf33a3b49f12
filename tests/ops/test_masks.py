"""`keras_attn.ops.masks`: the causal mask, merging masks of every rank, and
ALiBi."""

import keras
import numpy as np
import pytest

import keras_attn
from keras_attn import ops as attn_ops
from tests.helpers.backend import to_numpy
from tests.helpers.builders import random_floats


def test_causal_mask_with_offset():
    mask = to_numpy(attn_ops.causal_mask(2, 5, query_offset=3))
    np.testing.assert_array_equal(mask, [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]])


def test_merge_attention_masks_ands_masks_of_every_rank():
    padding = np.array([[True, False, True]])
    assert attn_ops.merge_attention_masks() is None
    assert attn_ops.merge_attention_masks(None, None) is None
    merged = to_numpy(
        attn_ops.merge_attention_masks(padding[:, None, :], np.eye(3, dtype=bool))
    )
    assert merged.shape == (1, 1, 3, 3)
    np.testing.assert_array_equal(merged[0, 0], np.eye(3) * [1, 0, 1])
    heads = np.ones((1, 2, 3, 3), bool)
    heads[0, 1, 0] = False
    merged = to_numpy(attn_ops.merge_attention_masks(padding[:, None, :], heads, None))
    assert merged.shape == (1, 2, 3, 3)
    np.testing.assert_array_equal(merged[0, 1, 0], [0, 0, 0])
    np.testing.assert_array_equal(merged[0, 0, 0], [1, 0, 1])
    with pytest.raises(ValueError, match=r"rank 2 .*Received: mask.shape=\(3,\)"):
        attn_ops.merge_attention_masks(padding[0])


def test_alibi_slopes_are_the_papers():
    bias = to_numpy(keras_attn.ops.alibi_bias(8, 4, 4))
    np.testing.assert_allclose(
        bias[0, :, 3, 0] / -3, 2.0 ** -np.arange(1, 9), rtol=1e-6
    )
    assert bias.dtype == np.float32 and bias.shape == (1, 8, 4, 4)
    keras_hub = pytest.importorskip("keras_hub")
    for heads in (6, 12):  # not powers of two: the paper's interleaving
        theirs = keras_hub.layers.AlibiBias()._get_slopes(heads)
        ours = -to_numpy(keras_attn.ops.alibi_bias(heads, 2, 2))[0, :, 1, 0]
        np.testing.assert_allclose(ours, theirs, rtol=1e-6)


def test_alibi_softmax_equals_keras_hub_under_a_causal_mask():
    """keras-hub adds `slope * (j - (S - 1))`, the paper `-slope * (i - j)`:
    they differ by a per-row constant, which softmax ignores."""
    keras_hub = pytest.importorskip("keras_hub")
    logits = random_floats(2, 4, 5, 5)
    causal = np.tril(np.ones((5, 5), bool))
    theirs = to_numpy(keras_hub.layers.AlibiBias()(keras.ops.convert_to_tensor(logits)))
    ours = logits + to_numpy(keras_attn.ops.alibi_bias(4, 5, 5))

    def softmax(x):
        x = np.where(causal, x, -np.inf)
        return np.exp(x - x.max(-1, keepdims=True)) / np.exp(
            x - x.max(-1, keepdims=True)
        ).sum(-1, keepdims=True)

    np.testing.assert_allclose(softmax(ours), softmax(theirs), atol=1e-6)


def test_alibi_with_a_query_offset_is_the_rows_of_the_full_bias():
    full = to_numpy(keras_attn.ops.alibi_bias(2, 6, 6))
    step = to_numpy(keras_attn.ops.alibi_bias(2, 1, 6, query_offset=4))
    np.testing.assert_array_equal(step[:, :, 0], full[:, :, 4])


def test_segments_are_runs_in_self_attention_and_ids_across_sequences():
    """Self-attention: a contiguous run of equal ids is one segment, so
    `[5, 5, 2, 5]` is three documents, as for the positions and the sinks
    (the op's: tests/ops/test_chunked_gradients.py). The keys' own ids
    (another sequence, `S != T`) are compared by value, by the op too."""
    ids, keys = np.array([[5, 5, 2, 5]], "int32"), np.array([[2, 5, 5]], "int32")
    runs = [[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]]
    np.testing.assert_array_equal(to_numpy(attn_ops.segment_mask(ids))[0, 0], runs)
    across = ids[0, :, None] == keys[0, None, :]  # (T, S)
    mask = to_numpy(attn_ops.segment_mask(ids, keys))
    np.testing.assert_array_equal(mask[0, 0], across)
    q, kv = random_floats(1, 4, 1, 4, seed=1), random_floats(1, 3, 1, 4, seed=2)
    ours = attn_ops.dot_product_attention(
        q, kv, kv, query_segment_ids=ids, key_segment_ids=keys
    )
    theirs = attn_ops.dot_product_attention(q, kv, kv, mask=mask)
    np.testing.assert_allclose(to_numpy(ours), to_numpy(theirs), atol=1e-6)
