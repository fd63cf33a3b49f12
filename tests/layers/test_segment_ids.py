"""Packed sequences (`segment_ids`): several documents in one row give what
each document gives alone, in the layers, forward and backward; bad ids raise
at the door. The op and its chunked path: tests/ops/test_chunked_gradients.py."""

import keras
import numpy as np
import pytest

from keras_attn import MultiHeadAttention, TransformerDecoder, TransformerEncoder
from keras_attn.layers._attention_call import AttentionCall
from tests.helpers.backend import (
    BACKEND,
    compiled_value_and_gradients,
    to_numpy,
    value_and_gradients,
)
from tests.helpers.builders import random_floats

WIDTH = 8
# Three documents of uneven lengths a row, the first id coming back for the
# third (a new document: a contiguous run of equal ids is one); 4 tokens, so
# that a window of 2 and a sink hide a key. Alone, the documents go in one
# batch, right-padded to 4 tokens and their padding masked: one shape, one
# compilation on JAX.
LENGTHS = ((2, 4, 2), (4, 2, 2))
SEGMENT_IDS = np.array(
    [[7, 7, 2, 2, 2, 2, 7, 7], [0, 0, 0, 0, -2, -2, 0, 0]], dtype="int32"
)
LONGEST = 4
ROPE = dict(rope_max_wavelength=100.0)


def documents(packed):
    """The documents of the packed rows, each alone in a row, right-padded
    with zeros to the longest: `(documents, LONGEST, ...)`."""
    pieces = []
    for row, lengths in enumerate(LENGTHS):
        ends = np.cumsum(lengths)
        for start, end in zip(ends - lengths, ends, strict=True):
            piece = packed[row, start:end]
            padding = [(0, LONGEST - (end - start))] + [(0, 0)] * (piece.ndim - 1)
            pieces.append(np.pad(piece, padding))
    return np.stack(pieces)


REAL = documents(np.ones(SEGMENT_IDS.shape, bool))  # (documents, LONGEST)


def compiled(fn):
    """`fn` under `jax.jit` on JAX (its eager ops each compile), else as is."""
    if BACKEND != "jax":
        return fn
    import jax

    return jax.jit(fn)


def packed_equals_separate(layer, x, padding, gradients=True, **kwargs):
    """`layer` on the packed rows with `segment_ids` equals it on the
    documents alone (their padding masked by the call argument `padding`),
    forward and (with `gradients`) the gradient of the input (so no gradient
    crosses a document's border), at 1e-5 in float32."""
    layer.build(x.shape)  # outside the gradient

    def packed_call(x):
        return layer(x, segment_ids=SEGMENT_IDS, **kwargs)

    def alone(x):
        return layer(x, **{padding: REAL}, **kwargs)

    if gradients:  # JAX compiles the step once, eager it compiles each op
        value_and_grad = (
            compiled_value_and_gradients if BACKEND == "jax" else value_and_gradients
        )
        cotangent = random_floats(*x.shape, seed=9)  # the same for both
        packed, (grad,) = value_and_grad(packed_call, x, cotangent=cotangent)
        theirs, (their_grad,) = value_and_grad(
            alone, documents(x), cotangent=documents(cotangent)
        )
        np.testing.assert_allclose(documents(grad)[REAL], their_grad[REAL], atol=1e-5)
    else:
        packed = to_numpy(compiled(packed_call)(x))
        theirs = to_numpy(compiled(alone)(documents(x)))
    np.testing.assert_allclose(
        documents(packed)[REAL], theirs[REAL], atol=1e-5, rtol=1e-5
    )


@pytest.mark.parametrize("causal", [False, True])
def test_multi_head_attention_packed_equals_separate(causal):
    """Rotary positions restart at each document (else the second document
    of a row would sit at 2 or 4 onwards and differ), and the third document
    does not see the first, whose id it repeats."""
    layer = MultiHeadAttention(num_heads=2, num_key_value_heads=1, **ROPE)
    packed_equals_separate(
        layer,
        random_floats(2, 8, WIDTH, seed=1),
        "query_mask",
        gradients=False,
        use_causal_mask=causal,
    )


def test_encoder_packed_equals_separate_in_training():
    """Forward (the gradients: the decoder's test, and the chunked path's in
    tests/ops/test_chunked_gradients.py)."""
    encoder = TransformerEncoder(16, num_heads=2, normalize_first=True, **ROPE)
    x = random_floats(2, 8, WIDTH, seed=2)
    packed_equals_separate(encoder, x, "padding_mask", gradients=False, training=True)


def test_decoder_only_packed_equals_separate_in_training():
    decoder = TransformerDecoder(16, num_heads=2, gated_feedforward=True, **ROPE)
    x = random_floats(2, 8, WIDTH, seed=3)
    packed_equals_separate(decoder, x, "decoder_padding_mask", training=True)


def test_explicit_positions_win_over_segment_positions():
    query, positions = random_floats(2, 8, WIDTH), np.arange(8, dtype="int32") + 3
    call = AttentionCall(query, positions=positions, segment_ids=SEGMENT_IDS)
    np.testing.assert_array_equal(to_numpy(call.rope_positions()[0]), positions)
    call = AttentionCall(query, segment_ids=SEGMENT_IDS)
    expected = [[0, 1, 0, 1, 2, 3, 0, 1], [0, 1, 2, 3, 0, 1, 0, 1]]
    np.testing.assert_array_equal(to_numpy(call.rope_positions()[0]), expected)


BAD = {
    "float ids": (dict(segment_ids=SEGMENT_IDS.astype("float32")), ValueError, "int"),
    "a wrong length": (dict(segment_ids=SEGMENT_IDS[:, :5]), ValueError, r"\(2, 8\)"),
    "rank 1": (dict(segment_ids=SEGMENT_IDS[0]), ValueError, "shape"),
    "a separate value": (dict(value="other"), ValueError, "separate `value`"),
    "a cache": (dict(cache="cache"), ValueError, "a `cache`"),
}


@pytest.mark.parametrize("name", BAD)
def test_bad_segment_ids_raise_naming_them(name):
    kwargs, error, match = BAD[name]
    layer = MultiHeadAttention(num_heads=2)
    x = random_floats(2, 8, WIDTH)
    layer.build(x.shape)
    kwargs = {"segment_ids": SEGMENT_IDS, **kwargs}
    if kwargs.get("value") == "other":
        kwargs["value"] = random_floats(2, 8, WIDTH, seed=5)
    if kwargs.get("cache") == "cache":
        kwargs.update(cache=layer.get_empty_cache(2, 8), cache_update_index=0)
    with pytest.raises(error, match=f"(?s)`segment_ids.*{match}"):
        layer(x, **kwargs)


def test_blocks_check_segment_ids():
    x = random_floats(2, 8, WIDTH)
    encoder, decoder = TransformerEncoder(16, 2), TransformerDecoder(16, 2)
    encoder.build(x.shape), decoder.build(x.shape)
    with pytest.raises(ValueError, match=r"`segment_ids`.*\(2, 8\)"):
        encoder(x, segment_ids=SEGMENT_IDS[:, :5])
    with pytest.raises(ValueError, match="`segment_ids` must be an int"):
        decoder(x, segment_ids=keras.ops.cast(SEGMENT_IDS, "float32"))
    cross = TransformerDecoder(16, 2)
    cross.build(x.shape, x.shape)
    with pytest.raises(ValueError, match="(?s)`segment_ids`.*`encoder_sequence`"):
        cross(x, x, segment_ids=SEGMENT_IDS)
    cache = decoder.get_empty_self_attention_cache(2, 8)
    with pytest.raises(ValueError, match="`segment_ids`.*`self_attention_cache`"):
        decoder(
            x,
            segment_ids=SEGMENT_IDS,
            self_attention_cache=cache,
            self_attention_cache_update_index=0,
        )


def test_attention_sinks_are_each_segments_first_tokens():
    """Sinks and a window in a packed row: each document keeps its own first
    tokens visible, as it does alone."""
    layer = MultiHeadAttention(num_heads=2, sliding_window=2, attention_sinks=1)
    packed_equals_separate(
        layer,
        random_floats(2, 8, WIDTH, seed=2),
        "query_mask",
        gradients=False,
        use_causal_mask=True,
    )
