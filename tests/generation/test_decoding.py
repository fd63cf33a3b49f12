"""Decoding equals the full pass: the layers' caches token by token, and
`generate`'s greedy loop (padded prompts, RoPE, sliding windows and their
attention sinks, the cache's segments, biases by sublayer) against the model
called on the whole prefix."""

import keras
import numpy as np
import pytest

import keras_attn
from keras_attn.generation import generate
from keras_attn.models import DecoderLMSpec, decoder_lm
from tests.helpers.backend import BACKEND, to_numpy
from tests.helpers.builders import GENERATION_VOCAB as VOCAB
from tests.helpers.builders import GENERATION_WIDTH as WIDTH
from tests.helpers.builders import llama_model, random_floats
from tests.helpers.doubles import count_key_widths
from tests.helpers.references import naive_greedy

# --- The caches in the layers -------------------------------------------------


@pytest.mark.parametrize("num_key_value_heads", [None, 1])
@pytest.mark.parametrize("with_encoder", [False, True])
@pytest.mark.parametrize("normalize_first", [False, True])
def test_token_by_token_equals_full_forward(
    num_key_value_heads, with_encoder, normalize_first
):
    decoder = keras_attn.TransformerDecoder(
        24, 4, num_key_value_heads=num_key_value_heads, normalize_first=normalize_first
    )
    x, memory = random_floats(2, 6, WIDTH), random_floats(2, 5, 8, seed=1)
    padding = np.ones((2, 6), bool)
    padding[1, :2] = False  # a left-padded row
    memory_padding = np.array([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], bool)
    encoder_args = {"encoder_sequence": memory} if with_encoder else {}
    if with_encoder:
        encoder_args["encoder_padding_mask"] = memory_padding
    full = to_numpy(decoder(x, decoder_padding_mask=padding, **encoder_args))
    cache = decoder.get_empty_self_attention_cache(2, 6)
    assert tuple(cache.shape) == (2, 2, num_key_value_heads or 4, 6, WIDTH // 4)
    cross = decoder.compute_cross_attention_cache(memory) if with_encoder else None
    steps, start = [], 0
    for stop in (3, 4, 5, 6):  # a 3-token prefill, then one token at a time
        outputs = decoder(
            x[:, start:stop],
            decoder_padding_mask=padding,
            self_attention_cache=cache,
            self_attention_cache_update_index=start,
            cross_attention_cache=cross,
            encoder_padding_mask=memory_padding if with_encoder else None,
        )
        steps.append(to_numpy(outputs[0]))
        cache = outputs[1]
        start = stop
    np.testing.assert_allclose(np.concatenate(steps, 1), full, atol=1e-5, rtol=1e-5)


def test_multi_head_attention_cache_with_grouped_heads_and_cross_cache():
    layer = keras_attn.MultiHeadAttention(num_heads=6, num_key_value_heads=2)
    x, memory = random_floats(2, 4, 12), random_floats(2, 7, 12, seed=1)
    full_self = to_numpy(layer(x, use_causal_mask=True))
    cache = layer.get_empty_cache(2, 4)
    assert tuple(cache.shape) == (2, 2, 2, 4, 2)
    for i in range(4):
        step, cache = layer(
            x[:, i : i + 1], cache=cache, cache_update_index=i, use_causal_mask=True
        )
        np.testing.assert_allclose(to_numpy(step)[:, 0], full_self[:, i], atol=1e-5)
    cross = layer.compute_cache(memory)
    output, same = layer(x, cache=cross)
    np.testing.assert_allclose(to_numpy(output), to_numpy(layer(x, memory)), atol=1e-5)
    assert same is cross
    causal, _ = layer(x, cache=cross, use_causal_mask=True)  # no other mask
    np.testing.assert_allclose(
        to_numpy(causal), to_numpy(layer(x, memory, use_causal_mask=True)), atol=1e-5
    )


def test_bad_caches():
    decoder = keras_attn.TransformerDecoder(24, 4)
    x = random_floats(2, 3, WIDTH)
    decoder(x)
    good = decoder.get_empty_self_attention_cache(2, 5)
    with pytest.raises(
        ValueError, match=r"self_attention_cache.shape=\(2, 2, 2, 5, 4\)"
    ):
        decoder(
            x,
            self_attention_cache=good[:, :, :2],
            self_attention_cache_update_index=0,
        )
    with pytest.raises(TypeError, match="self_attention_cache.dtype=int32"):
        decoder(
            x,
            self_attention_cache=keras.ops.cast(good, "int32"),
            self_attention_cache_update_index=0,
        )
    with pytest.raises(ValueError, match="go together"):
        decoder(x, self_attention_cache=good)
    with pytest.raises(ValueError, match=r"decoder_padding_mask.shape=\(2, 3\)"):
        decoder(
            x,
            self_attention_cache=good,
            self_attention_cache_update_index=0,
            decoder_padding_mask=np.ones((2, 3), bool),
        )
    with pytest.raises(ValueError, match="cross_attention_cache.*decoder-only"):
        decoder(x, cross_attention_cache=good)
    attention = keras_attn.MultiHeadAttention(2, key_dim=4, value_dim=6)
    attention(x)
    with pytest.raises(ValueError, match="key_dim=4, value_dim=6"):
        attention.get_empty_cache(2, 5)


# --- generate: greedy equals the naive loop -------------------------------------


def check_padded_prompts_against_naive_loop(model, side, max_length):
    """Greedy `generate` on three prompts padded on `side` equals the naive
    loop, row by row; returns the tokens."""
    prompts = [[3, 4, 5, 6], [7, 8], [9, 1, 2]]
    padded = np.zeros((3, 4), "int32")
    for row, prompt in zip(padded, prompts, strict=True):
        if side == "left":
            row[4 - len(prompt) :] = prompt
        else:
            row[: len(prompt)] = prompt
    tokens = generate(model, padded, max_length=max_length)
    for row, prompt, padded_row in zip(tokens, prompts, padded, strict=True):
        pads = 4 - len(prompt)
        if side == "left":  # each row gets max_length - prompt width new tokens
            expected = naive_greedy(model, prompt, max_length - pads)
            assert row.tolist() == padded_row[:pads].tolist() + expected
        else:  # each row is filled up to max_length
            assert row.tolist() == naive_greedy(model, prompt, max_length)
    return tokens


@pytest.mark.parametrize("side", ["left", "right"])
def test_greedy_equals_naive_loop_decoder_only(gpt, side):
    tokens = check_padded_prompts_against_naive_loop(gpt, side, 11)
    assert tokens.shape == (3, 11) and tokens.dtype == np.int32


def test_greedy_equals_naive_loop_encoder_decoder(translator):
    sources = np.array([[3, 4, 5, 6, 7], [8, 9, 0, 0, 0], [10, 11, 12, 0, 0]])
    start = np.ones((3, 1), "int32")
    tokens = generate(translator, [sources, start], max_length=9)
    by_name = generate(translator, {"source": sources, "target": start}, max_length=9)
    np.testing.assert_array_equal(tokens, by_name)
    for row, source in zip(tokens, sources, strict=True):
        assert row.tolist() == naive_greedy(translator, [1], 9, source=source)


def assert_greedy(logits, tokens, start):
    """Each token from `start` on is the argmax of the logits one position back.

    `logits` come from one full forward pass over `tokens`; 1e-4 of slack for
    near-ties between the cached and the full computation.
    """
    for row, row_logits in zip(tokens, logits, strict=True):
        for position in range(start, len(row)):
            chosen = row_logits[position - 1, row[position]]
            assert chosen >= row_logits[position - 1].max() - 1e-4, position


def test_long_generation_crosses_cache_segments(gpt, translator):
    """Past 64 positions the caches grow (64, 128, then max_length); nothing is
    lost at the seams: every token is the full forward pass's argmax."""
    prompts = np.array([[3, 4, 5, 6], [7, 8, 9, 10]])
    tokens = generate(gpt, prompts, max_length=140)
    assert_greedy(to_numpy(gpt(tokens)), tokens, start=4)
    np.testing.assert_array_equal(
        generate(gpt, prompts, 140, method="beam", num_beams=1), tokens
    )
    sources = np.array([[3, 4, 5, 6, 7], [8, 9, 0, 0, 0]])
    tokens = generate(translator, [sources, np.ones((2, 1), "int32")], 140)
    assert_greedy(to_numpy(translator([sources, tokens])), tokens, start=1)


@pytest.mark.parametrize("side", ["left", "right"])
def test_greedy_equals_naive_loop_with_rope_and_a_tied_head(side):
    """Rotary positions per row (padded prompts), a sliding window across the
    cache segments, and the tied head: every token is the full pass's argmax."""
    check_padded_prompts_against_naive_loop(llama_model(VOCAB, WIDTH), side, 10)


def test_rope_generation_crosses_cache_segments():
    """Gemma 2's shape (a windowed and a global decoder, each sublayer's
    output normalized) past the first cache segment."""
    model = llama_model(VOCAB, WIDTH, tied=False, normalize_sublayer_outputs=True)
    prompts = np.array([[3, 4, 5, 6], [7, 8, 9, 10]])
    tokens = generate(model, prompts, max_length=80)
    assert_greedy(to_numpy(model(tokens)), tokens, start=4)


def test_biases_by_sublayer_generate_the_full_pass_tokens():
    """A `decoder_lm` whose block dicts carry the bias options (as a Hugging
    Face folder gives them): Qwen2's block (biases on query, key and value
    alone) and Llama's `mlp_bias=True` (feed-forward biases alone), every
    bias random. Cached decoding (on PyTorch through the decoding's bound
    projections, W_O without a bias) gives the full pass's argmax."""
    keras.utils.set_random_seed(0)
    block = dict(
        intermediate_dim=32,
        num_heads=4,
        num_key_value_heads=2,
        activation="silu",
        normalize_first=True,
        normalization="rms_norm",
        gated_feedforward=True,
        rope_max_wavelength=10000.0,
    )
    qwen2 = dict(
        block, use_bias=True, use_output_bias=False, use_feedforward_bias=False
    )
    mlp_bias = dict(block, use_bias=False, use_feedforward_bias=True)
    spec = DecoderLMSpec(
        vocabulary_size=VOCAB, hidden_dim=WIDTH, blocks=(qwen2, mlp_bias)
    )
    model = decoder_lm(spec)
    biases = [w for w in model.weights if w.name == "bias"]
    assert len(biases) == 3 + 3  # query, key, value; three feed-forward matrices
    for seed, bias in enumerate(biases):
        bias.assign(random_floats(*bias.shape, seed=seed))
    prompts = np.array([[3, 4, 5, 6], [7, 8, 9, 10]])
    tokens = generate(model, prompts, max_length=12)
    assert_greedy(to_numpy(model(tokens)), tokens, start=4)


def test_a_sliding_window_decoder_caches_only_its_window(monkeypatch):
    """The windowed decoder's cache holds 3 positions in every step (a
    rolling cache), the other's grows with the sequence (64, then 150)."""
    model = llama_model(VOCAB, WIDTH, windows=(3, None), tied=False)
    decoders = [
        layer
        for layer in model.layers
        if isinstance(layer, keras_attn.TransformerDecoder)
    ]
    lengths = {decoder.name: set() for decoder in decoders}
    for decoder in decoders:

        def spy(
            x, cache, *args, _call=decoder.decode_unchecked, _name=decoder.name, **kw
        ):
            lengths[_name].add(cache.length)
            return _call(x, cache, *args, **kw)

        monkeypatch.setattr(decoder, "decode_unchecked", spy)
    tokens = generate(model, np.array([[3, 4, 5, 6]]), max_length=150)
    windowed, full = (lengths[d.name] for d in decoders)
    assert windowed == {64, 3} and full == {64, 128, 150}  # 64: the prompt's
    monkeypatch.undo()
    assert_greedy(to_numpy(model(tokens)), tokens, start=4)


def test_rolling_caches_in_beam_search_and_encoder_decoder_models():
    """Beam search of one beam equals greedy with a rolling cache; a windowed
    decoder with cross-attention decodes as its naive loop; a prompt as long
    as `max_length` returns unchanged."""
    model = llama_model(VOCAB, WIDTH, windows=(2, None))
    prompts = np.array([[0, 3, 4, 5], [6, 7, 8, 9]])
    greedy = generate(model, prompts, max_length=12)
    beam = generate(model, prompts, 12, method="beam", num_beams=1)
    np.testing.assert_array_equal(beam, greedy)
    np.testing.assert_array_equal(generate(model, prompts, 4), prompts)
    # Not `encoder_decoder_model`: this one creates its encoder before it calls
    # the embedding, and so draws other weights.
    keras.utils.set_random_seed(2)
    source = keras.Input((None,), dtype="int32", name="source")
    target = keras.Input((None,), dtype="int32", name="target")
    embed = keras_attn.SinusoidalEmbedding(
        vocabulary_size=VOCAB, embedding_dim=WIDTH, mask_zero=True
    )
    memory = keras_attn.TransformerEncoder(32, 4)(embed(source))
    y = keras_attn.SinusoidalEmbedding(
        vocabulary_size=VOCAB, embedding_dim=WIDTH, mask_zero=True
    )(target)
    y = keras_attn.TransformerDecoder(32, 4, sliding_window=2)(y, memory)
    translator = keras.Model([source, target], keras.layers.Dense(VOCAB)(y))
    sources = np.array([[3, 4, 5, 6, 7], [8, 9, 0, 0, 0]])
    tokens = generate(translator, [sources, np.ones((2, 1), "int32")], 9)
    for row, row_source in zip(tokens, sources, strict=True):
        assert row.tolist() == naive_greedy(translator, [1], 9, source=row_source)


def test_attention_sinks_generate_past_the_window_as_the_full_recompute(
    monkeypatch,
):
    """StreamingLLM: a window of 4 and 2 sinks, 16 new tokens after a prompt
    of 5, through a decoder with RoPE on sinusoidal positions. Each
    row, left-padded or not (one shorter than its sinks), is what the model,
    masking sinks and window, computes on its own tokens: every new token the
    argmax of the full pass (the naive loop, in one causal call), with its
    score; the cache holds the 6 slots in every step."""
    keras.utils.set_random_seed(0)
    ids = keras.Input((None,), dtype="int32")
    x = keras_attn.SinusoidalEmbedding(
        vocabulary_size=VOCAB, embedding_dim=WIDTH, mask_zero=True
    )(ids)
    decoder = keras_attn.TransformerDecoder(
        32, 4, rope_max_wavelength=1e4, sliding_window=4, attention_sinks=2
    )
    model = keras.Model(ids, keras.layers.Dense(VOCAB)(decoder(x)))
    lengths = set()  # of the caches the decoder gets

    def spy(x, cache, *args, _call=decoder.decode_unchecked, **kwargs):
        lengths.add(cache.length)
        return _call(x, cache, *args, **kwargs)

    monkeypatch.setattr(decoder, "decode_unchecked", spy)
    prompts = [[3, 4, 5, 6, 7], [8, 9], [10]]
    padded = np.zeros((3, 5), "int32")
    for row, prompt in zip(padded, prompts, strict=True):
        row[5 - len(prompt) :] = prompt
    tokens, scores = generate(model, padded, max_length=21, return_scores=True)
    monkeypatch.undo()
    assert lengths == {21, 6}  # 21: the prompt's
    unpadded = np.zeros_like(tokens)  # each row's own tokens, from position 0
    for row, own, prompt in zip(tokens, unpadded, prompts, strict=True):
        own[: 16 + len(prompt)] = row[5 - len(prompt) :]
    logits = model.predict(unpadded, verbose=0)  # compiled: quicker on JAX
    log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    for i, prompt in enumerate(prompts):
        new = range(len(prompt), len(prompt) + 16)  # positions of the new tokens
        assert_greedy(logits[i : i + 1], unpadded[i : i + 1, : new[-1] + 1], new[0])
        expected = [log_probs[i, p - 1, unpadded[i, p]] for p in new]
        np.testing.assert_allclose(scores[i, 5:], expected, atol=1e-4)
    if BACKEND == "torch":  # eager rounds: the same Python on every backend
        # Speculating keeps full caches (no roll); the sinks mask them alike.
        speculated = generate(
            model, padded, max_length=21, draft_model=model, num_speculative_tokens=3
        )
        np.testing.assert_array_equal(speculated, tokens)


def test_prompts_of_another_width_reuse_nothing_stale(gpt):
    """A second call with a wider prompt gets its own compiled loops."""
    short, wide = np.array([[3, 4, 5]]), np.array([[3, 4, 5, 6, 7]])
    generate(gpt, short, 10)
    tokens = generate(gpt, wide, 10)
    assert tokens[0, :5].tolist() == [3, 4, 5, 6, 7]
    assert_greedy(to_numpy(gpt(tokens)), tokens, start=5)


def count_host_reads(monkeypatch):
    """Each way a torch tensor comes back to the host, counted."""
    import torch

    reads = []
    for name in ("item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__"):
        original = getattr(torch.Tensor, name)

        def spy(self, *args, _original=original, _name=name, **kwargs):
            reads.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, spy)
    return reads


@pytest.mark.skipif(BACKEND != "torch", reason="PyTorch's loop runs from Python")
@pytest.mark.parametrize("embedding", ["sinusoidal", "keras"])
def test_decoding_steps_read_nothing_back_to_the_host(monkeypatch, embedding):
    """The eager loop's steps: no check of the layers (`generate` checked its
    inputs) and no other read; what is read happens once, not per token."""
    ids = keras.Input((None,), dtype="int32")
    if embedding == "sinusoidal":
        x = keras_attn.SinusoidalEmbedding(
            vocabulary_size=20, embedding_dim=16, mask_zero=True
        )(ids)
        x = keras_attn.TransformerDecoder(32, 2)(x)
    else:  # rotary positions: the index reaches the layers as a tensor
        x = keras.layers.Embedding(20, 16)(ids)
        x = keras_attn.TransformerDecoder(32, 2, rope_max_wavelength=100.0)(x)
    model = keras.Model(ids, keras.layers.Dense(20)(x))
    prompt = np.array([[3, 4, 5], [0, 6, 7]])
    reads = {}
    for new_tokens in (2, 10):
        generate(model, prompt, max_new_tokens=new_tokens)  # built, warmed up
        with monkeypatch.context() as patch:
            counted = count_host_reads(patch)
            generate(model, prompt, max_new_tokens=new_tokens)
        reads[new_tokens] = len(counted)
    assert reads[10] == reads[2], reads


@pytest.mark.skipif(BACKEND != "torch", reason="Keras' own calls as torch calls")
def test_the_head_runs_as_torch_calls_with_keras_numbers(gpt, monkeypatch):
    """On PyTorch the head's `LayerNormalization` and `Dense` run as the
    torch calls of their `call` (bound once a decoding: `SublayerCalls`),
    not through `__call__`: the same tokens and scores as with every
    sublayer called through `__call__`."""
    head = gpt.layers[-2:]  # LayerNormalization, Dense
    prompts = np.array([[0, 3, 4, 5], [6, 7, 8, 9]])
    called, layer_call = [], keras.layers.Layer.__call__

    def spy(self, *args, **kwargs):
        called.append(self)
        return layer_call(self, *args, **kwargs)

    monkeypatch.setattr(keras.layers.Layer, "__call__", spy)
    tokens, scores = generate(gpt, prompts, 6, return_scores=True)
    assert not any(layer in called for layer in head)
    monkeypatch.setattr("keras_attn.layers._lean_call._state_kept", lambda layer: False)
    expected = generate(gpt, prompts, 6, return_scores=True)
    np.testing.assert_array_equal(to_numpy(tokens), to_numpy(expected[0]))
    np.testing.assert_array_equal(to_numpy(scores), to_numpy(expected[1]))
    assert all(layer in called for layer in head)


def test_a_prompts_prefill_skips_the_slots_past_each_chunk(
    gpt, small_chunks, monkeypatch
):
    """A prompt's prefill (the Python int index 0 on slots that hold their
    positions: `cache.top_left_causal`) is causal attention to the chunked
    path: each chunk of 4 rows of a 9-token prompt computes only the slots up
    to its last row, not all the cache's, and the tokens and scores are
    those of the materialized path."""
    prompts = np.array([[0, 0, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 5, 6, 7, 8, 9]])
    widths = count_key_widths(monkeypatch)
    if BACKEND == "torch":  # the explicit path, as `disable_flash_attention()`
        monkeypatch.setattr(keras.config, "is_flash_attention_enabled", lambda: False)
    tokens, scores = generate(gpt, prompts, max_new_tokens=3, return_scores=True)
    assert small_chunks.calls and min(widths) < prompts.shape[1], widths
    small_chunks()
    expected = generate(gpt, prompts, max_new_tokens=3, return_scores=True)
    np.testing.assert_array_equal(to_numpy(tokens), to_numpy(expected[0]))
    np.testing.assert_allclose(
        to_numpy(scores), to_numpy(expected[1]), atol=1e-5, rtol=1e-5
    )
