"""MultiHeadAttention on one token (a decoder's first step, `predict` on one
token) gives softmax's numbers without Keras' "softmax over an axis of size
1" warning, which the TensorFlow demo printed (the op: tests/ops/test_single_key.py)."""

import warnings

import keras
import numpy as np

import keras_attn

RNG = np.random.default_rng(0)


def test_one_token_attention_warns_nothing_and_keeps_softmax_numbers():
    layer = keras_attn.MultiHeadAttention(num_heads=2, key_dim=4)
    x = RNG.normal(size=(3, 1, 8)).astype("float32")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*softmax over axis")
        output, scores = layer(x, use_causal_mask=True, return_attention_scores=True)
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(scores), 1.0)
    values = layer.value_dense(x)  # one key: the output is its value, projected
    expected = layer.output_dense(values)
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(output),
        keras.ops.convert_to_numpy(expected),
        rtol=1e-5,
        atol=1e-6,
    )
