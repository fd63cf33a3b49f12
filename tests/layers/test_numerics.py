"""Numerical safety of every layer: fully masked rows, large activations in
mixed precision, length 1 and batch 1, query and key lengths that differ,
4096 tokens on a CPU."""

import resource

import keras
import numpy as np
import pytest

from keras_attn import (
    MultiHeadAttention,
    SinusoidalEmbedding,
    TransformerDecoder,
    TransformerEncoder,
)
from tests.helpers.backend import to_numpy
from tests.helpers.builders import VOCAB, random_floats, random_ids
from tests.helpers.references import attention_reference, reference_encoding

# Key length 1 is a case like any other here.
pytestmark = pytest.mark.filterwarnings("ignore:You are using a softmax over axis -1")

B, T, S, W, VW = 2, 3, 5, 8, 6


@pytest.mark.parametrize("flash_attention", [None, False])
def test_rows_with_nothing_to_attend_give_the_output_bias(flash_attention):
    layer = MultiHeadAttention(
        num_heads=2,
        key_dim=3,
        flash_attention=flash_attention,
        bias_initializer=keras.initializers.RandomNormal(seed=1),
    )
    query, value = random_floats(B, 4, W, seed=1), random_floats(B, S, VW, seed=2)
    value_mask = np.array([[False] * S, [True, True, True, False, False]])
    attention_mask = np.ones((B, 4, S), bool)
    attention_mask[1, 2] = False  # one more empty row
    output, scores = layer(
        query,
        value,
        value_mask=value_mask,
        attention_mask=attention_mask,
        return_attention_scores=True,
    )
    allowed = value_mask[:, None, None, :] & attention_mask[:, None]
    expected = attention_reference(layer, query, value, allowed)
    bias = to_numpy(layer.output_dense.bias)
    np.testing.assert_allclose(expected[0], np.broadcast_to(bias, (4, W)))
    np.testing.assert_allclose(to_numpy(output), expected, atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(to_numpy(scores)[0], 0.0)
    np.testing.assert_array_equal(to_numpy(scores)[1, :, 2], 0.0)
    fused = layer(query, value, value_mask=value_mask, attention_mask=attention_mask)
    np.testing.assert_allclose(to_numpy(fused), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("flash_attention", [None, False])
def test_fully_padded_sequences_stay_finite_in_the_blocks(flash_attention):
    """A sequence that is all padding attends to nothing: each position's output
    then depends on that position alone, and every number stays finite."""
    x, memory = random_floats(B, 4, W), random_floats(B, S, VW, seed=1)
    padding = np.array([[False] * 4, [False, True, True, True]])
    memory_padding = np.array([[False] * S, [True] * S])
    changed, changed_memory = x.copy(), memory.copy()
    changed[0, 1:] += 5.0
    changed_memory[0] -= 5.0
    encoder = TransformerEncoder(16, 2, flash_attention=flash_attention)
    decoder = TransformerDecoder(16, 2, flash_attention=flash_attention)
    outputs = []
    for inputs, source in ((x, memory), (changed, changed_memory)):
        encoded = to_numpy(encoder(inputs, padding_mask=padding))
        decoded = to_numpy(
            decoder(
                inputs,
                source,
                decoder_padding_mask=padding,  # row 1 left-padded: causal row 0 empty
                encoder_padding_mask=memory_padding,
            )
        )
        assert np.all(np.isfinite(encoded)) and np.all(np.isfinite(decoded))
        outputs.append((encoded, decoded))
    (encoded, decoded), (encoded_changed, decoded_changed) = outputs
    np.testing.assert_allclose(encoded[0, 0], encoded_changed[0, 0], atol=1e-5)
    np.testing.assert_allclose(decoded[0, 0], decoded_changed[0, 0], atol=1e-5)
    np.testing.assert_allclose(encoded[1], encoded_changed[1], atol=1e-5)


def assert_mostly_close(output, reference, tolerance):
    """Finite, and 90% of the positions (rows) within `tolerance` of the
    reference's largest magnitude: rounding in half precision may flip an
    argmax between nearly tied keys of a saturated softmax, which changes a
    few rows (in bfloat16 at scale 3000, 2 of 32)."""
    output = to_numpy(keras.ops.cast(output, "float32"))
    reference = to_numpy(reference)
    assert np.all(np.isfinite(output))
    close = np.abs(output - reference) <= tolerance * np.abs(reference).max()
    rows = close.all(axis=-1)
    assert rows.mean() >= 0.9, (rows.mean(), tolerance)


TOLERANCE = {"mixed_float16": 0.01, "mixed_bfloat16": 0.05}


def twins(cls, kwargs, policy, *inputs):
    """`cls(**kwargs)` in `policy` and a float32 copy with the same weights."""
    layer, reference = cls(**kwargs, dtype=policy), cls(**kwargs, dtype="float32")
    layer(*inputs)
    reference(*inputs)
    reference.set_weights(layer.get_weights())
    return layer, reference


@pytest.mark.parametrize("scale", [300.0, 3000.0])
@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_large_activations_in_mixed_precision(policy, scale):
    """Inputs whose squares overflow float16: the float32 softmax (and layer
    norms) keep every layer finite and close to float32."""
    x = random_floats(B, 16, W, scale=scale, seed=1)
    memory = random_floats(B, S, VW, scale=scale, seed=2)
    tolerance = TOLERANCE[policy]
    for flash_attention in (None, False):
        kwargs = {"num_heads": 2, "flash_attention": flash_attention}
        for args in ((x, memory), (x,)):  # cross- and causal self-attention
            layer, reference = twins(MultiHeadAttention, kwargs, policy, *args)
            causal = len(args) == 1
            assert_mostly_close(
                layer(*args, use_causal_mask=causal),
                reference(*args, use_causal_mask=causal),
                tolerance,
            )
    for normalize_first in (False, True):
        kwargs = {"intermediate_dim": 16, "num_heads": 2}
        kwargs["normalize_first"] = normalize_first
        encoder, reference = twins(TransformerEncoder, kwargs, policy, x)
        assert_mostly_close(encoder(x), reference(x), tolerance)
        decoder, reference = twins(TransformerDecoder, kwargs, policy, x, memory)
        assert_mostly_close(decoder(x, memory), reference(x, memory), tolerance)
    far = 60_000  # positions far beyond float16's integers
    ids = random_ids(B, 6)
    initializer = keras.initializers.RandomNormal(stddev=scale, seed=3)
    kwargs = {"embedding_dim": 16, "vocabulary_size": VOCAB}
    kwargs["embeddings_initializer"] = initializer
    embedding, reference = twins(SinusoidalEmbedding, kwargs, policy, ids)
    assert_mostly_close(
        embedding(ids, start_index=far), reference(ids, start_index=far), tolerance
    )
    embedding, reference = twins(SinusoidalEmbedding, {}, policy, x)
    assert_mostly_close(
        embedding(x, start_index=far), reference(x, start_index=far), tolerance
    )


@pytest.mark.parametrize("flash_attention", [None, False])
def test_length_one_and_batch_one(flash_attention):
    query, value = random_floats(1, 1, W), random_floats(1, 1, VW, seed=1)
    attention = MultiHeadAttention(2, key_dim=3, flash_attention=flash_attention)
    attention.build(query.shape, value.shape)
    expected = attention_reference(attention, query, value)
    for kwargs in ({}, {"use_causal_mask": True}):
        output = to_numpy(attention(query, value, **kwargs))
        np.testing.assert_allclose(output, expected, atol=1e-5, rtol=1e-5)
    encoder = TransformerEncoder(16, 2, flash_attention=flash_attention)
    encoded = to_numpy(encoder(query))
    assert encoded.shape == (1, 1, W) and np.all(np.isfinite(encoded))
    decoder = TransformerDecoder(16, 2, flash_attention=flash_attention)
    causal = to_numpy(decoder(query, value))
    assert causal.shape == (1, 1, W) and np.all(np.isfinite(causal))
    # One position sees itself, causal or not.
    unmasked = to_numpy(decoder(query, value, use_causal_mask=False))
    np.testing.assert_allclose(unmasked, causal, atol=1e-6)
    embedding = SinusoidalEmbedding(vocabulary_size=VOCAB, embedding_dim=W)
    ids = np.array([[7]], "int32")
    embedded = to_numpy(embedding(ids))
    table = to_numpy(embedding.embeddings)
    expected = table[ids] * np.sqrt(W) + reference_encoding(1, W)[0]
    np.testing.assert_allclose(embedded, expected, atol=1e-5)


@pytest.mark.parametrize("query_length, key_length", [(1, 7), (7, 1), (2, 5), (5, 2)])
def test_query_and_key_lengths_that_differ(query_length, key_length):
    query = random_floats(B, query_length, W, seed=1)
    value = random_floats(B, key_length, VW, seed=2)
    padding = np.ones((B, key_length), bool)
    padding[1, -1] = False  # with one key, batch row 1 attends to nothing
    layer = MultiHeadAttention(
        4, num_key_value_heads=2, key_dim=3, bias_initializer="ones"
    )
    layer.build(query.shape, value.shape)
    for flash_attention in (None, False):
        layer.flash_attention = flash_attention  # same weights, other path
        for causal in (False, True):
            allowed = padding[:, None, None, :]
            if causal:  # Aligned at the first position: query i sees keys <= i.
                allowed = allowed & np.tril(np.ones((query_length, key_length), bool))
            output = layer(query, value, value_mask=padding, use_causal_mask=causal)
            expected = attention_reference(layer, query, value, allowed)
            np.testing.assert_allclose(to_numpy(output), expected, atol=1e-5, rtol=1e-5)
    decoder = TransformerDecoder(16, 2)
    output, self_scores, cross_scores = decoder(
        query, value, encoder_padding_mask=padding, return_attention_scores=True
    )
    assert tuple(cross_scores.shape) == (B, 2, query_length, key_length)
    assert tuple(self_scores.shape) == (B, 2, query_length, query_length)
    assert np.all(np.isfinite(to_numpy(output)))
    sums = to_numpy(cross_scores).sum(-1)
    expected = np.broadcast_to(padding.any(-1)[:, None, None], sums.shape)
    np.testing.assert_allclose(sums, expected.astype("float32"), atol=1e-5)


@pytest.mark.parametrize("flash_attention", [None, False])
def test_4096_tokens_on_cpu(flash_attention):
    """Batch 1, 4096 tokens, width 16: correct and bounded memory (measured:
    0.1-1.5 s and 0.1-0.6 GB, the (1, 2, 4096, 4096) float32 weights)."""
    length = 4096
    x = random_floats(1, length, 16)
    padding = np.ones((1, length), bool)
    padding[0, -100:] = False
    attention = MultiHeadAttention(2, flash_attention=flash_attention)
    attention.build(x.shape)
    encoder = TransformerEncoder(32, 2, flash_attention=flash_attention)
    encoder.build(x.shape)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    output = to_numpy(attention(x, value_mask=padding, use_causal_mask=True))
    encoded = to_numpy(encoder(x, padding_mask=padding))
    growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak
    assert growth < 2 * 1024**2, f"peak memory grew by {growth / 1024:.0f} MiB"
    assert output.shape == (1, length, 16) and np.all(np.isfinite(output))
    assert encoded.shape == (1, length, 16) and np.all(np.isfinite(encoded))
    rows = np.r_[0:4, length - 104 : length - 100, length - 4 : length]
    allowed = np.tril(np.ones((length, length), bool))[rows] & padding[0]
    expected = attention_reference(attention, x[:, rows], x, allowed[None, None])
    np.testing.assert_allclose(output[:, rows], expected, atol=1e-5, rtol=1e-4)
