"""Attention sinks (StreamingLLM, Xiao et al. 2023): `attention_sinks=S` beside
`sliding_window=W` equals the explicit mask "the first S keys or the band",
with left padding moving each row's sinks to its first real keys; the blocks
carry the option to their self-attention and save it; bad values raise.
(Generation past the window: tests/generation/test_decoding.py.)"""

import keras
import numpy as np
import pytest

import keras_attn
from keras_attn import MultiHeadAttention, TransformerDecoder, TransformerEncoder
from tests.helpers.backend import to_numpy
from tests.helpers.builders import random_floats
from tests.helpers.contract import save_and_load

T, S, W = 7, 2, 3  # length, sinks, window


def streaming_mask(causal, first=(0, 0)):
    """`(B, T, T)` by hand: key j visible to query i where |i - j| < W or j is
    one of the row's first S keys after `first[b]` (its left padding), and
    j <= i where causal."""
    i, j = np.arange(T)[:, None], np.arange(T)[None, :]
    masks = []
    for start in first:
        mask = (np.abs(i - j) < W) | ((j >= start) & (j < start + S))
        masks.append(mask & (j <= i) if causal else mask)
    return np.stack(masks)


@pytest.mark.parametrize("causal", [True, False])
def test_sinks_equal_the_explicit_mask(causal):
    """And the mask differs from the window alone (the sinks do something);
    a left-padded row's sinks are its first real keys."""
    x = random_floats(2, T, 8)
    sinks = MultiHeadAttention(2, key_dim=4, sliding_window=W, attention_sinks=S)
    plain = MultiHeadAttention(2, key_dim=4)
    sinks(x), plain(x)
    plain.set_weights(sinks.get_weights())
    padding = np.ones((2, T), bool)
    padding[1, :2] = False  # row 1: two left pads, sinks at keys 2 and 3
    for kwargs, first in (({}, (0, 0)), ({"query_mask": padding}, (0, 2))):
        mask = streaming_mask(causal, first)
        if kwargs:
            mask = mask & padding[:, None, :]
        ours = sinks(x, use_causal_mask=causal, **kwargs)
        theirs = plain(x, attention_mask=mask)
        np.testing.assert_allclose(to_numpy(ours), to_numpy(theirs), atol=1e-5)
    band = np.abs(np.arange(T)[:, None] - np.arange(T)) < W
    band = band & np.tri(T, dtype=bool) if causal else band
    windowed = plain(x, attention_mask=np.broadcast_to(band, (2, T, T)))
    ours = sinks(x, use_causal_mask=causal)
    assert not np.allclose(to_numpy(windowed), to_numpy(ours), atol=1e-3)
    expected = streaming_mask(False)[0].astype(int)
    assert (
        to_numpy(keras_attn.ops.sliding_window_mask(T, T, W, attention_sinks=S))
        .astype(int)
        .tolist()
        == expected.tolist()
    )


def test_the_blocks_carry_and_save_the_sinks(tmp_path):
    """Self-attention gets the sinks, cross-attention not; the config and a
    `.keras` file keep them (the outputs as before)."""
    options = dict(sliding_window=W, attention_sinks=S)
    decoder = TransformerDecoder(16, 2, **options)
    x, memory = random_floats(2, T, 8), random_floats(2, 4, 8, seed=1)
    decoder(x, memory)
    assert decoder.self_attention.attention_sinks == S
    assert decoder.cross_attention.attention_sinks is None
    assert decoder.cross_attention.sliding_window is None
    for block in (decoder, TransformerEncoder(16, 2, **options)):
        config = block.get_config()
        assert config["attention_sinks"] == S
        assert type(block).from_config(config).attention_sinks == S
    inputs = keras.Input((None, 8))
    encoder = TransformerEncoder(16, 2, **options)
    model = keras.Model(inputs, encoder(inputs))
    loaded = save_and_load(model, tmp_path, "sinks")
    assert loaded.layers[1].self_attention.attention_sinks == S
    np.testing.assert_allclose(to_numpy(loaded(x)), to_numpy(model(x)), atol=1e-6)


@pytest.mark.parametrize(
    "layer", [MultiHeadAttention, TransformerEncoder, TransformerDecoder]
)
def test_bad_attention_sinks(layer):
    required = (
        {"num_heads": 2}
        if layer is MultiHeadAttention
        else {
            "intermediate_dim": 8,
            "num_heads": 2,
        }
    )
    with pytest.raises(ValueError, match="attention_sinks=2, sliding_window=None"):
        layer(**required, attention_sinks=2)
    with pytest.raises(ValueError, match="attention_sinks=0"):
        layer(**required, sliding_window=W, attention_sinks=0)
    with pytest.raises(TypeError, match="attention_sinks=1.5"):
        layer(**required, sliding_window=W, attention_sinks=1.5)


def test_bad_attention_sinks_in_the_mask_op():
    with pytest.raises(ValueError, match="attention_sinks=-1"):
        keras_attn.ops.sliding_window_mask(3, 3, 2, attention_sinks=-1)
