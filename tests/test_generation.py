"""Cached decoding in the layers and `keras_attn.generation.generate`."""

import keras
import numpy as np
import pytest

import keras_attn
from keras_attn import generation
from keras_attn.generation import generate
from tests.helpers import (
    decoder_only_model,
    naive_greedy,
    next_token_logits,
    random_floats,
    to_numpy,
)

VOCAB, WIDTH = 13, 16


def encoder_decoder_model(seed=0):
    keras.utils.set_random_seed(seed)
    source = keras.Input((None,), dtype="int32", name="source")
    target = keras.Input((None,), dtype="int32", name="target")
    x = keras_attn.SinusoidalEmbedding(
        vocabulary_size=VOCAB, embedding_dim=WIDTH, mask_zero=True
    )(source)
    x = keras_attn.TransformerEncoder(32, 4)(x)
    y = keras_attn.SinusoidalEmbedding(
        vocabulary_size=VOCAB, embedding_dim=WIDTH, mask_zero=True
    )(target)
    y = keras_attn.TransformerDecoder(32, 4, num_key_value_heads=2)(y, x)
    y = keras_attn.TransformerDecoder(32, 4)(y, x)
    return keras.Model([source, target], keras.layers.Dense(VOCAB)(y))


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


# --- generate -----------------------------------------------------------------


@pytest.fixture(scope="module")
def gpt():
    return decoder_only_model(VOCAB, WIDTH, num_key_value_heads=2)


@pytest.fixture(scope="module")
def translator():
    return encoder_decoder_model()


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


def llama_model(seed=0, tied=True, window=3):
    """Keras' `ReversibleEmbedding` (no positions), LLaMA-style decoders with
    RoPE (one with a sliding window), RMSNorm and the tied embedding as head."""
    keras.utils.set_random_seed(seed)
    ids = keras.Input((None,), dtype="int32", name="ids")
    embedding = keras.layers.ReversibleEmbedding(VOCAB, WIDTH, mask_zero=True)
    options = dict(
        activation="silu",
        normalize_first=True,
        num_key_value_heads=2,
        normalization="rms_norm",
        gated_feedforward=True,
        use_bias=False,
        rope_max_wavelength=10000.0,
    )
    x = keras_attn.TransformerDecoder(32, 4, sliding_window=window, **options)(
        embedding(ids)
    )
    x = keras_attn.TransformerDecoder(32, 4, **options)(x)
    x = keras.layers.RMSNormalization()(x)
    head = embedding if tied else keras.layers.Dense(VOCAB, name="head")
    return keras.Model(ids, head(x, reverse=True) if tied else head(x))


@pytest.mark.parametrize("side", ["left", "right"])
def test_greedy_equals_naive_loop_with_rope_and_a_tied_head(side):
    """Rotary positions per row (padded prompts), a sliding window across the
    cache segments, and the tied head: every token is the full pass's argmax."""
    check_padded_prompts_against_naive_loop(llama_model(), side, 10)


def test_rope_generation_crosses_cache_segments():
    model = llama_model(tied=False)
    prompts = np.array([[3, 4, 5, 6], [7, 8, 9, 10]])
    tokens = generate(model, prompts, max_length=80)
    assert_greedy(to_numpy(model(tokens)), tokens, start=4)


def test_a_sliding_window_decoder_caches_only_its_window(monkeypatch):
    """The windowed decoder's cache holds 3 positions in every step (a
    rolling cache), the other's grows with the sequence (64, then 150)."""
    model = llama_model(tied=False, window=3)
    decoders = [
        layer
        for layer in model.layers
        if isinstance(layer, keras_attn.TransformerDecoder)
    ]
    lengths = {decoder.name: set() for decoder in decoders}
    for decoder in decoders:

        def spy(*args, _call=decoder.call, _name=decoder.name, **kwargs):
            lengths[_name].add(kwargs["self_attention_cache"].shape[3])
            return _call(*args, **kwargs)

        monkeypatch.setattr(decoder, "call", spy)
    tokens = generate(model, np.array([[3, 4, 5, 6]]), max_length=150)
    windowed, full = (lengths[d.name] for d in decoders)
    assert windowed == {64, 3} and full == {64, 128, 150}  # 64: the prompt's
    monkeypatch.undo()
    assert_greedy(to_numpy(model(tokens)), tokens, start=4)


def test_rolling_caches_in_beam_search_and_encoder_decoder_models():
    """Beam search of one beam equals greedy with a rolling cache; a windowed
    decoder with cross-attention decodes as its naive loop; a prompt as long
    as `max_length` returns unchanged."""
    model = llama_model(window=2)
    prompts = np.array([[0, 3, 4, 5], [6, 7, 8, 9]])
    greedy = generate(model, prompts, max_length=12)
    beam = generate(model, prompts, 12, method="beam", num_beams=1)
    np.testing.assert_array_equal(beam, greedy)
    np.testing.assert_array_equal(generate(model, prompts, 4), prompts)
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


def test_prompts_of_another_width_reuse_nothing_stale(gpt):
    """A second call with a wider prompt gets its own compiled loops."""
    short, wide = np.array([[3, 4, 5]]), np.array([[3, 4, 5, 6, 7]])
    generate(gpt, short, 10)
    tokens = generate(gpt, wide, 10)
    assert tokens[0, :5].tolist() == [3, 4, 5, 6, 7]
    assert_greedy(to_numpy(gpt(tokens)), tokens, start=5)


def test_beam_of_one_equals_greedy(gpt, translator):
    prompts = np.array([[3, 4, 5], [0, 7, 8]])
    np.testing.assert_array_equal(
        generate(gpt, prompts, 9, method="beam", num_beams=1), generate(gpt, prompts, 9)
    )
    sources, start = np.array([[3, 4, 0], [5, 6, 7]]), np.ones((2, 1), "int32")
    np.testing.assert_array_equal(
        generate(translator, [sources, start], 7, method="beam", num_beams=1),
        generate(translator, [sources, start], 7),
    )


def test_wide_beam_finds_the_most_likely_continuation(gpt):
    prompt = np.array([[3, 4, 5]])
    found = generate(gpt, prompt, 5, method="beam", num_beams=VOCAB, length_penalty=0)
    best, best_score = None, -np.inf

    def log_probs(prefix):
        logits = next_token_logits(gpt, prefix)
        return logits - np.log(np.exp(logits - logits.max()).sum()) - logits.max()

    first = log_probs([3, 4, 5])
    for a in range(VOCAB):
        second = log_probs([3, 4, 5, a])
        b = int(second.argmax())
        if first[a] + second[b] > best_score:
            best, best_score = [3, 4, 5, a, b], first[a] + second[b]
    assert found[0].tolist() == best


def test_sampling_is_seeded_and_respects_top_k(gpt):
    prompts = np.array([[3, 4, 5], [6, 7, 8]])
    a = generate(gpt, prompts, 12, method="sample", seed=5, top_k=3)
    b = generate(gpt, prompts, 12, method="sample", seed=5, top_k=3)
    c = generate(gpt, prompts, 12, method="sample", seed=6, top_k=3)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    logits = to_numpy(gpt(a))
    for row, row_logits in zip(a, logits, strict=True):
        for position in range(3, 12):
            top3 = np.argsort(row_logits[position - 1])[-3:]
            assert row[position] in top3
    np.testing.assert_array_equal(
        generate(gpt, prompts, 12, method="sample", seed=1, top_k=1),
        generate(gpt, prompts, 12),
    )
    nucleus = generate(gpt, prompts, 12, method="sample", seed=1, top_p=1e-6)
    np.testing.assert_array_equal(nucleus, generate(gpt, prompts, 12))


def test_end_token_stops_and_pads(gpt):
    prompts = np.array([[3, 4, 5], [6, 7, 8]])
    greedy = generate(gpt, prompts, 12)
    end = int(greedy[0, 5])
    stopped = generate(gpt, prompts, 12, end_token_id=end, pad_token_id=0)
    for row, full in zip(stopped, greedy, strict=True):
        hits = np.flatnonzero(full[3:] == end)
        if len(hits):
            cut = 3 + hits[0] + 1
            assert row[:cut].tolist() == full[:cut].tolist()
            assert np.all(row[cut:] == 0)
        else:
            assert row.tolist() == full.tolist()


# --- generate: bad arguments -------------------------------------------------
# Each row gives `generate(gpt, PROMPT, max_length=6)` one bad argument, which
# must raise an error naming it before anything changes. A callable value is
# called with the `gpt` fixture's model.

PROMPT = np.array([[3, 4, 5], [6, 7, 8]], "int32")


def conv_head_model():
    """A decoder whose logits come from a Conv1D, which mixes positions."""
    ids = keras.Input((None,), dtype="int32")
    x = keras_attn.SinusoidalEmbedding(vocabulary_size=VOCAB, embedding_dim=WIDTH)(ids)
    x = keras_attn.TransformerDecoder(32, 4)(x)
    return keras.Model(ids, keras.layers.Conv1D(VOCAB, 3, padding="same")(x))


def embedding_only_model():
    ids = keras.Input((None,), dtype="int32")
    x = keras.layers.Embedding(VOCAB, WIDTH)(ids)
    return keras.Model(ids, keras.layers.Dense(VOCAB)(x))


def generate_row(kwargs, error, match, id=None):
    def describe(value):
        if isinstance(value, np.ndarray):
            return f"array{value.shape}"
        return (
            repr(value) if np.isscalar(value) or value is None else type(value).__name__
        )

    name = id or "-".join(f"{k}={describe(v)}" for k, v in kwargs.items())
    return pytest.param(kwargs, error, match, id=name)


GENERATE_ROWS = [
    generate_row(
        {"model": lambda gpt: gpt.layers[2]},
        ValueError,
        r"functional keras.Model.*Received: TransformerDecoder",
        id="model=a-layer",
    ),
    generate_row({"model": None}, ValueError, r"Received: NoneType"),
    generate_row(
        {"model": lambda gpt: conv_head_model()},
        ValueError,
        r"Conv1D",
        id="model=Conv1D-head",
    ),
    generate_row(
        {"model": lambda gpt: embedding_only_model()},
        ValueError,
        r"no TransformerDecoder",
        id="model=no-decoder",
    ),
    generate_row(
        {"inputs": PROMPT.astype("float32")},
        ValueError,
        r"int token ids.*dtype=float32",
    ),
    generate_row({"inputs": PROMPT[0]}, ValueError, r"shape=\(3,\)"),
    generate_row({"inputs": PROMPT[..., None]}, ValueError, r"shape=\(2, 3, 1\)"),
    generate_row(
        {"inputs": PROMPT + VOCAB},
        ValueError,
        rf"token ids must be in \[0, vocabulary_size={VOCAB}\).*from 16 to 21",
    ),
    generate_row({"inputs": -PROMPT}, ValueError, r"from -8 to -3"),
    generate_row(
        {"inputs": np.array([[3, 4], [0, 0]])}, ValueError, r"empty rows: \[1\]"
    ),
    generate_row({"inputs": np.array([[3, 0, 4]])}, ValueError, r"on one side"),
    generate_row(
        {"inputs": np.array([[0, 3, 4], [3, 4, 0]])}, ValueError, r"not a mix"
    ),
    generate_row({"inputs": [PROMPT, PROMPT]}, ValueError, r"shape=\(2, 2, 3\)"),
    generate_row({"inputs": {"foo": PROMPT}}, ValueError, r"\['ids'\].*\['foo'\]"),
    generate_row({"max_length": 0}, ValueError, r"max_length=0"),
    generate_row({"max_length": 4.0}, TypeError, r"max_length=4.0 of type float"),
    generate_row({"max_length": 2}, ValueError, r"max_length=2, prompt length=3"),
    generate_row({"method": "topk"}, ValueError, r"`method` must be one of.*'topk'"),
    generate_row({"temperature": 0}, ValueError, r"temperature=0"),
    generate_row({"temperature": -1.0}, ValueError, r"temperature=-1.0"),
    generate_row({"temperature": "hot"}, TypeError, r"temperature='hot'"),
    generate_row({"top_k": 0}, ValueError, r"top_k=0"),
    generate_row({"top_k": 1.5}, TypeError, r"top_k=1.5 of type float"),
    generate_row({"top_p": 0}, ValueError, r"top_p=0"),
    generate_row({"top_p": 1.5}, ValueError, r"top_p=1.5"),
    generate_row({"top_p": "a"}, TypeError, r"top_p='a'"),
    generate_row({"seed": -1}, ValueError, r"seed=-1"),
    generate_row({"seed": 2**31}, ValueError, r"seed=2147483648"),
    generate_row({"seed": 1.5}, TypeError, r"seed=1.5 of type float"),
    generate_row({"num_beams": 0}, ValueError, r"num_beams=0"),
    generate_row({"num_beams": 2.0}, TypeError, r"num_beams=2.0 of type float"),
    generate_row({"length_penalty": "x"}, TypeError, r"`length_penalty`.*'x'"),
    generate_row({"length_penalty": float("nan")}, ValueError, r"length_penalty=nan"),
    generate_row({"end_token_id": -1}, ValueError, r"end_token_id=-1"),
    generate_row({"end_token_id": 1.0}, TypeError, r"end_token_id=1.0 of type"),
    generate_row({"end_token_id": VOCAB}, ValueError, rf"end_token_id={VOCAB}\b"),
    generate_row({"pad_token_id": -1}, ValueError, r"pad_token_id=-1"),
    generate_row({"pad_token_id": None}, TypeError, r"pad_token_id=None"),
    generate_row({"pad_token_id": VOCAB}, ValueError, rf"pad_token_id={VOCAB}\b"),
    generate_row({"seed": 1}, ValueError, r"seed=1 only apply to method='sample'"),
    generate_row({"length_penalty": 2.0}, ValueError, r"only applies to method='beam'"),
    generate_row({"jit_compile": "yes"}, ValueError, r"jit_compile='yes'"),
    generate_row(
        {"model": lambda gpt: [gpt, gpt]},
        TypeError,
        r"pair of functions.*\['Functional', 'Functional'\]",
        id="model=two-models",
    ),
    generate_row({"end_token_id": []}, ValueError, r"must not be an empty list"),
    generate_row({"end_token_id": [1, VOCAB]}, ValueError, rf"end_token_id={VOCAB}\b"),
    generate_row({"end_token_id": [1, "2"]}, TypeError, r"end_token_id='2'"),
    generate_row(
        {"max_new_tokens": 3}, ValueError, r"exactly one of.*max_length=6, max_new"
    ),
    generate_row({"max_length": None}, ValueError, r"exactly one of.*max_length=None"),
    generate_row(
        {"max_length": None, "max_new_tokens": 0}, ValueError, r"max_new_tokens=0"
    ),
    generate_row({"min_new_tokens": -1}, ValueError, r"min_new_tokens=-1"),
    generate_row({"min_new_tokens": 1.0}, TypeError, r"min_new_tokens=1.0 of type"),
    generate_row({"repetition_penalty": 0}, ValueError, r"repetition_penalty=0"),
    generate_row(
        {"repetition_penalty": float("nan")}, ValueError, r"repetition_penalty=nan"
    ),
    generate_row({"repetition_penalty": "x"}, TypeError, r"repetition_penalty='x'"),
    generate_row({"return_scores": 1}, TypeError, r"return_scores=1"),
    generate_row({"on_token": 3}, TypeError, r"on_token=3"),
    generate_row(
        {"method": "beam", "on_token": lambda gpt: print},
        ValueError,
        r"cannot stream beam search",
        id="method=beam-on_token=print",
    ),
    generate_row({"top_k": 3}, ValueError, r"top_k=3 only apply to method='sample'"),
    generate_row(
        {"method": "beam", "top_p": 0.9},
        ValueError,
        r"top_p=0.9 only apply to method='sample'.*method='beam'",
    ),
    generate_row(
        {"temperature": 0.5}, ValueError, r"temperature=0.5 only apply to method="
    ),
]


@pytest.mark.parametrize("kwargs, error, match", GENERATE_ROWS)
def test_bad_generate_argument_changes_nothing(gpt, kwargs, error, match):
    kwargs = {k: v(gpt) if callable(v) else v for k, v in kwargs.items()}
    call = {"model": gpt, "inputs": PROMPT, "max_length": 6, **kwargs}
    # The fixture's model, and any other model or layer the row passes.
    subjects = [gpt] + [
        m for m in (call["model"],) if isinstance(m, keras.Model) and m is not gpt
    ]
    weights = [[to_numpy(w).copy() for w in m.weights] for m in subjects]
    compiled = [dict(generation.api._GENERATORS.get(m, {})) for m in subjects]
    with pytest.raises(error, match=match):
        generate(**call)
    for subject, before, generators in zip(subjects, weights, compiled, strict=True):
        for old, new in zip(before, subject.weights, strict=True):
            np.testing.assert_array_equal(old, to_numpy(new))
        assert dict(generation.api._GENERATORS.get(subject, {})) == generators
