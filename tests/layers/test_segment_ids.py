"""Packed sequences (`segment_ids`): several documents in one row give what
each document gives alone, in the layers, forward and backward; bad ids raise
at the door. The op and its chunked path: tests/ops/test_chunked_gradients.py."""

import keras
import numpy as np
import pytest

from keras_attn import MultiHeadAttention, TransformerDecoder, TransformerEncoder
from tests.helpers.backend import BACKEND, to_numpy, value_and_gradients
from tests.helpers.builders import random_floats

WIDTH = 8
# Row 0 packs documents of 3 and 5 tokens (ids 4 and 9), row 1 of 5 and 3.
LENGTHS = ((3, 5), (5, 3))
SEGMENT_IDS = np.array([[4] * 3 + [9] * 5, [0] * 5 + [-2] * 3], dtype="int32")
ROPE = dict(rope_max_wavelength=100.0)


def documents(packed):
    """The documents of the packed rows, those of one length stacked:
    `{length: (2, length, ...)}`."""
    pieces = {}
    for row, lengths in enumerate(LENGTHS):
        start = 0
        for length in lengths:
            pieces.setdefault(length, []).append(packed[row, start : start + length])
            start += length
    return {length: np.stack(rows) for length, rows in pieces.items()}


def compiled(fn):
    """`fn` under `jax.jit` on JAX (its eager ops each compile), else as is."""
    if BACKEND != "jax":
        return fn
    import jax

    return jax.jit(fn)


def packed_equals_separate(layer_call, x, gradients=True, **kwargs):
    """`layer_call` on the packed rows with `segment_ids` equals it on the
    documents alone, forward and (with `gradients`) the gradient of the
    input (so no gradient crosses a document's border), at 1e-5 in float32."""
    layer_call(x[:1, :3], **kwargs)  # built outside the gradient
    packed_call = compiled(lambda x: layer_call(x, segment_ids=SEGMENT_IDS, **kwargs))
    alone = compiled(lambda x: layer_call(x, **kwargs))
    if not gradients:
        packed = to_numpy(packed_call(x))
        for length, piece in documents(x).items():
            theirs = to_numpy(alone(piece))
            np.testing.assert_allclose(
                documents(packed)[length], theirs, atol=1e-5, rtol=1e-5
            )
        return
    cotangent = random_floats(*x.shape, seed=9)  # the same for both
    packed, (grad,) = value_and_gradients(packed_call, x, cotangent=cotangent)
    ours = {"output": documents(packed), "gradient": documents(grad)}
    pieces = documents(cotangent)
    for length, piece in documents(x).items():
        theirs, (grad,) = value_and_gradients(alone, piece, cotangent=pieces[length])
        for name, array in (("output", theirs), ("gradient", grad)):
            np.testing.assert_allclose(
                ours[name][length], array, atol=1e-5, rtol=1e-5, err_msg=name
            )


@pytest.mark.parametrize("causal", [False, True])
def test_multi_head_attention_packed_equals_separate(causal):
    """Rotary positions restart at each document (else the second document
    of a row would sit at 3 or 5 onwards and differ)."""
    layer = MultiHeadAttention(num_heads=2, num_key_value_heads=1, **ROPE)
    packed_equals_separate(
        layer,
        random_floats(2, 8, WIDTH, seed=1),
        gradients=False,
        use_causal_mask=causal,
    )


def test_encoder_packed_equals_separate_in_training():
    encoder = TransformerEncoder(16, num_heads=2, normalize_first=True, **ROPE)
    packed_equals_separate(encoder, random_floats(2, 8, WIDTH, seed=2), training=True)


def test_decoder_only_packed_equals_separate_in_training():
    decoder = TransformerDecoder(16, num_heads=2, gated_feedforward=True, **ROPE)
    packed_equals_separate(decoder, random_floats(2, 8, WIDTH, seed=3), training=True)


def test_explicit_positions_win_over_segment_positions():
    layer = MultiHeadAttention(num_heads=2, **ROPE)
    x = random_floats(2, 8, WIDTH, seed=4)
    positions = np.arange(8, dtype="int32")
    ours = layer(x, segment_ids=SEGMENT_IDS, positions=positions)
    mask = SEGMENT_IDS[:, :, None] == SEGMENT_IDS[:, None, :]
    theirs = layer(x, attention_mask=mask, positions=positions)
    np.testing.assert_allclose(to_numpy(ours), to_numpy(theirs), atol=1e-6)


BAD = {
    "float ids": (dict(segment_ids=SEGMENT_IDS.astype("float32")), TypeError, "int"),
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
    layer(x)
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
    encoder(x), decoder(x)
    with pytest.raises(ValueError, match=r"`segment_ids`.*\(2, 8\)"):
        encoder(x, segment_ids=SEGMENT_IDS[:, :5])
    with pytest.raises(TypeError, match="`segment_ids` must be an int"):
        decoder(x, segment_ids=keras.ops.cast(SEGMENT_IDS, "float32"))
    cache = decoder.get_empty_self_attention_cache(2, 8)
    with pytest.raises(ValueError, match="`segment_ids`.*`self_attention_cache`"):
        decoder(
            x,
            segment_ids=SEGMENT_IDS,
            self_attention_cache=cache,
            self_attention_cache_update_index=0,
        )
