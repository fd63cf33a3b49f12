"""Attention over a single key (a one-token call, as in a decoder's first
step or `predict` on one token) gives softmax's numbers without Keras'
"softmax over an axis of size 1" warning, which the TensorFlow demo printed."""

import warnings

import keras
import numpy as np

import keras_attn

RNG = np.random.default_rng(0)


def test_one_key_keeps_nan_and_masked_rows_as_softmax_does():
    query = RNG.normal(size=(1, 2, 1, 4)).astype("float32")
    key = RNG.normal(size=(1, 1, 1, 4)).astype("float32")
    value = RNG.normal(size=(1, 1, 1, 4)).astype("float32")
    key[0, 0, 0, 0] = np.nan
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*softmax over axis")
        output = keras_attn.ops.dot_product_attention(
            query, key, value, flash_attention=False
        )
    assert np.isnan(keras.ops.convert_to_numpy(output)).all()
