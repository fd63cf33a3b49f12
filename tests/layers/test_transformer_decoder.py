"""TransformerDecoder: the contract, causality, Keras masks, scores, and
keras-hub's ways with caches. What both blocks share:
tests/layers/test_block.py; bad arguments: tests/layers/test_arguments.py."""

import keras
import numpy as np
import pytest

from keras_attn import SinusoidalEmbedding, TransformerDecoder
from tests.helpers.backend import to_numpy
from tests.helpers.builders import random_floats
from tests.helpers.contract import run_layer_contract

B, T, S, WIDTH = 3, 5, 7, 12
TOLERANCE = {"atol": 1e-5, "rtol": 1e-5}


@pytest.mark.parametrize("normalize_first", [False, True])
def test_layer_contract_encoder_decoder(tmp_path, normalize_first):
    run_layer_contract(
        TransformerDecoder,
        {"intermediate_dim": 20, "num_heads": 4, "normalize_first": normalize_first},
        {
            "decoder_sequence": random_floats(B, T, WIDTH),
            "encoder_sequence": random_floats(B, S, 8),
        },
        expected_output_shape=(B, T, WIDTH),
        tmp_path=tmp_path,
        # Quantization, LoRA and policy maps act on the sublayers, which are
        # the same in either order: checked once, post-norm. Every mode on
        # the attention's projections: MultiHeadAttention's contracts.
        machinery=not normalize_first,
        quantization_modes=("int8",),
    )


def test_layer_contract_decoder_only(tmp_path):
    run_layer_contract(
        TransformerDecoder,
        {"intermediate_dim": 20, "num_heads": 4, "num_key_value_heads": 1},
        {"decoder_sequence": random_floats(B, T, WIDTH)},
        expected_output_shape=(B, T, WIDTH),
        tmp_path=tmp_path,
        # The same sublayers as the encoder-decoder case's; grouped key/value
        # heads quantize in the LLaMA decoder's contract.
        machinery=False,
    )


@pytest.mark.parametrize("flash_attention", [None, False])
@pytest.mark.parametrize("with_encoder", [True, False])
def test_causal_equals_explicit_lower_triangle(flash_attention, with_encoder):
    decoder = TransformerDecoder(16, 4, flash_attention=flash_attention)
    args = [random_floats(B, T, WIDTH)] + (
        [random_floats(B, S, 8)] if with_encoder else []
    )
    causal = to_numpy(decoder(*args))
    tril = np.broadcast_to(np.tril(np.ones((T, T), bool)), (B, T, T))
    explicit = decoder(*args, use_causal_mask=False, decoder_attention_mask=tril)
    np.testing.assert_allclose(causal, to_numpy(explicit), atol=1e-6)
    unmasked = to_numpy(decoder(*args, use_causal_mask=False))
    assert not np.allclose(causal, unmasked, atol=1e-3)


@pytest.mark.parametrize("flash_attention", [None, False])
@pytest.mark.parametrize("normalize_first", [False, True])
def test_future_tokens_do_not_change_earlier_outputs(flash_attention, normalize_first):
    decoder = TransformerDecoder(
        16, 4, normalize_first=normalize_first, flash_attention=flash_attention
    )
    x, memory = random_floats(B, T, WIDTH), random_floats(B, S, 8)
    changed = x.copy()
    changed[:, 3:] += 7.0
    a, b = to_numpy(decoder(x, memory)), to_numpy(decoder(changed, memory))
    np.testing.assert_allclose(a[:, :3], b[:, :3], atol=1e-5)
    assert not np.allclose(a[:, 3:], b[:, 3:], atol=1e-3)


@pytest.mark.parametrize("flash_attention", [None, False])
def test_padded_source_tokens_do_not_change_outputs(flash_attention):
    decoder = TransformerDecoder(16, 4, flash_attention=flash_attention)
    x, memory = random_floats(B, T, WIDTH), random_floats(B, S, 8)
    changed = memory.copy()
    changed[:, 4:] *= -9.0
    source_padding = np.zeros((B, S), bool)
    source_padding[:, :4] = True
    a = decoder(x, memory, encoder_padding_mask=source_padding)
    b = decoder(x, changed, encoder_padding_mask=source_padding)
    np.testing.assert_allclose(to_numpy(a), to_numpy(b), atol=1e-5)


def test_keras_masks_equal_explicit_padding_masks():
    target_ids, source_ids = (
        keras.Input((None,), dtype="int32"),
        keras.Input((None,), dtype="int32"),
    )
    target_embedding = SinusoidalEmbedding(
        vocabulary_size=20, embedding_dim=WIDTH, mask_zero=True
    )
    source_embedding = SinusoidalEmbedding(
        vocabulary_size=20, embedding_dim=8, mask_zero=True
    )
    decoder = TransformerDecoder(16, 4)
    outputs = decoder(target_embedding(target_ids), source_embedding(source_ids))
    model = keras.Model([target_ids, source_ids], outputs)
    assert outputs._keras_mask is not None
    target = np.array([[3, 4, 5, 0, 0], [1, 2, 3, 4, 5], [6, 0, 0, 0, 0]])
    source = np.array([[1, 2, 0, 0, 0, 0, 0], [3] * 7, [4, 5, 6, 0, 0, 0, 0]])
    explicit = decoder(
        target_embedding(target),
        source_embedding(source),
        decoder_padding_mask=target != 0,
        encoder_padding_mask=source != 0,
    )
    np.testing.assert_allclose(
        to_numpy(model([target, source])), to_numpy(explicit), atol=1e-6
    )
    # Decoder-only: the Keras mask arrives through `mask`.
    gpt = TransformerDecoder(16, 4)
    ids = keras.Input((None,), dtype="int32")
    gpt_model = keras.Model(ids, gpt(target_embedding(ids)))
    np.testing.assert_allclose(
        to_numpy(gpt_model(target)),
        to_numpy(gpt(target_embedding(target), decoder_padding_mask=target != 0)),
        atol=1e-6,
    )


def test_return_attention_scores():
    decoder = TransformerDecoder(16, 4)
    x, memory = random_floats(B, T, WIDTH), random_floats(B, S, 8)
    outputs, self_scores, cross_scores = decoder(
        x, memory, return_attention_scores=True
    )
    assert tuple(self_scores.shape) == (B, 4, T, T)
    assert tuple(cross_scores.shape) == (B, 4, T, S)
    assert np.all(np.triu(to_numpy(self_scores), k=1) == 0)
    np.testing.assert_allclose(
        to_numpy(outputs), to_numpy(decoder(x, memory)), atol=1e-6
    )
    gpt = TransformerDecoder(16, 4)
    outputs, self_scores = gpt(x, return_attention_scores=True)
    assert tuple(self_scores.shape) == (B, 4, T, T)


def test_keras_hub_style_cross_attention_cache_with_an_update_index():
    """keras-hub writes the encoder's keys and values into a given cross
    cache at `cross_attention_cache_update_index` (caches heads-major here)."""
    decoder = TransformerDecoder(16, 2, num_key_value_heads=1)
    x, memory = random_floats(2, 5, 8, seed=1), random_floats(2, 4, 8, seed=2)
    full = to_numpy(decoder(x, memory))
    empty_self = decoder.get_empty_self_attention_cache(2, 5)
    empty_cross = np.zeros((2, 2, 1, 4, 4), "float32")
    output, self_cache, cross_cache = decoder(
        x,
        memory,
        self_attention_cache=empty_self,
        self_attention_cache_update_index=0,
        cross_attention_cache=empty_cross,
        cross_attention_cache_update_index=0,
    )
    np.testing.assert_allclose(to_numpy(output), full, **TOLERANCE)
    np.testing.assert_allclose(
        to_numpy(cross_cache),
        to_numpy(decoder.compute_cross_attention_cache(memory)),
        **TOLERANCE,
    )


def test_cached_decoding_in_a_while_loop_as_in_keras_hub():
    decoder = TransformerDecoder(16, 2)
    x = random_floats(2, 5, 8)
    full = to_numpy(decoder(x))
    empty = decoder.get_empty_self_attention_cache(2, 5)

    def body(i, outputs, cache):
        step = keras.ops.slice(x, (0, i, 0), (2, 1, 8))
        output, cache = decoder(
            step, self_attention_cache=cache, self_attention_cache_update_index=i
        )
        return i + 1, keras.ops.slice_update(outputs, (0, i, 0), output), cache

    _, outputs, _ = keras.ops.while_loop(
        lambda i, outputs, cache: i < 5, body, (0, keras.ops.zeros_like(x), empty)
    )
    np.testing.assert_allclose(to_numpy(outputs), full, **TOLERANCE)


def test_rotary_scaling_reaches_self_attention_only():
    """Cross-attention keys are another sequence's: no rotary positions, so
    neither their scaling (it used to raise: a scaling without positions)."""
    decoder = TransformerDecoder(
        16, 2, rope_max_wavelength=100.0, rope_scaling_factor=2.0
    )
    decoder(random_floats(2, 3, 8), random_floats(2, 5, 8))
    assert decoder.self_attention.rope_scaling_factor == 2.0
    assert decoder.cross_attention.rope_max_wavelength is None
    assert decoder.cross_attention.rope_scaling_factor == 1.0


def test_the_call_record_lists_the_arguments_of_call_in_order():
    """`call` builds its `DecoderCall` positionally: a field out of order
    would hand one argument's value to another."""
    import dataclasses
    import inspect

    from keras_attn.layers._decoder_call import DecoderCall

    parameters = list(inspect.signature(TransformerDecoder.call).parameters)[1:]
    fields = [f.name for f in dataclasses.fields(DecoderCall) if f.init]
    assert fields == parameters
