"""`generate`'s bad arguments, each refused before anything changes, and the
models it refuses to decode, or decodes with a warning."""

import warnings

import keras
import numpy as np
import pytest

import keras_attn
from keras_attn import generation
from keras_attn.generation import generate
from tests.helpers.backend import to_numpy
from tests.helpers.builders import GENERATION_VOCAB as VOCAB
from tests.helpers.builders import GENERATION_WIDTH as WIDTH
from tests.helpers.builders import one_decoder_model

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
    generate_row({"cache_dtype": "int4"}, ValueError, r"`cache_dtype`.*'int4'"),
    generate_row({"cache_dtype": 8}, TypeError, r"cache_dtype=8 of type int"),
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
        {"max_length": None, "max_new_tokens": -1}, ValueError, r"max_new_tokens=-1"
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


# --- Models `generate` refuses, or warns about (reported bugs) -------------------

# PROMPT's rows (an array of their own), and the softmax head's length.
PROMPTS = np.array([[3, 4, 5], [6, 7, 8]], "int32")
LENGTH = 12


def test_a_decoder_called_without_its_causal_mask_is_refused():
    ids = keras.Input((None,), dtype="int32")
    x = keras_attn.SinusoidalEmbedding(vocabulary_size=VOCAB, embedding_dim=WIDTH)(ids)
    x = keras_attn.TransformerDecoder(32, 4, name="bidirectional")(
        x, use_causal_mask=False
    )
    model = keras.Model(ids, keras.layers.Dense(VOCAB)(x))
    with pytest.raises(ValueError, match="bidirectional.*use_causal_mask=False"):
        generate(model, PROMPTS, 6)


def test_a_head_wider_than_the_vocabulary_is_refused():
    """Decoding steps check no token id: `generate` refuses, from the shapes,
    a head that could choose ids the embedding does not have."""
    ids = keras.Input((None,), dtype="int32")
    x = keras_attn.SinusoidalEmbedding(vocabulary_size=VOCAB, embedding_dim=WIDTH)(ids)
    x = keras_attn.TransformerDecoder(32, 4)(x)
    model = keras.Model(ids, keras.layers.Dense(VOCAB + 3)(x))
    with pytest.raises(
        ValueError, match=rf"embeds {VOCAB} ids, but the model scores {VOCAB + 3}"
    ):
        generate(model, PROMPTS, 6)


def test_decoder_calls_and_heads_a_step_cannot_reproduce_are_refused():
    """A decoder given a bias or mask tensor (a step could not be given it),
    and a head that normalizes across positions."""
    ids = keras.Input((None,), dtype="int32")
    bias = keras.Input((None, None), name="bias")
    x = keras_attn.SinusoidalEmbedding(vocabulary_size=VOCAB, embedding_dim=WIDTH)(ids)
    y = keras_attn.TransformerDecoder(32, 4, name="biased")(
        x, decoder_attention_bias=bias
    )
    model = keras.Model([ids, bias], keras.layers.Dense(VOCAB)(y))
    with pytest.raises(ValueError, match=r"biased.*\['decoder_attention_bias'\]"):
        generate(model, [PROMPTS, np.zeros((2, 3, 3), "float32")], 6)
    y = keras_attn.TransformerDecoder(32, 4)(x)
    head = keras.layers.Softmax(axis=1, name="across_positions")
    model = keras.Model(ids, head(keras.layers.Dense(VOCAB)(y)))
    with pytest.raises(ValueError, match="across_positions"):
        generate(model, PROMPTS, 6)


def test_a_softmax_head_decodes_and_warns_once_before_sampling():
    """Greedy through the softmax equals greedy on the logits before it;
    sampling reads probabilities as logits, which warns, once per model."""
    model, ids, logits = one_decoder_model(
        VOCAB, WIDTH, seed=6, head=keras.layers.Softmax()
    )
    tokens = generate(model, PROMPTS, LENGTH)
    np.testing.assert_array_equal(
        tokens, generate(keras.Model(ids, logits), PROMPTS, LENGTH)
    )
    with pytest.warns(UserWarning, match="softmax"):
        generate(model, PROMPTS, LENGTH, "sample", seed=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        generate(model, PROMPTS, LENGTH, "sample", seed=2)
    assert not [w for w in caught if "softmax" in str(w.message)]


def add_of_positions_model():
    """Token embedding plus a sinusoid of it, summed by an `Add`."""
    ids = keras.Input((None,), dtype="int32")
    tokens = keras.layers.Embedding(VOCAB, WIDTH)(ids)
    positions = keras_attn.SinusoidalEmbedding()(tokens)
    return keras.layers.Add(name="token_plus_position")([tokens, positions]), ids


def keras_hub_model():
    keras_hub = pytest.importorskip("keras_hub")
    ids = keras.Input((None,), dtype="int32")
    embedding = keras_hub.layers.TokenAndPositionEmbedding(
        VOCAB, 16, WIDTH, name="token_and_position"
    )
    return embedding(ids), ids


@pytest.mark.parametrize(
    "build, name",
    [
        (add_of_positions_model, "token_plus_position"),
        (keras_hub_model, "token_and_position"),
    ],
    ids=["Add", "TokenAndPositionEmbedding"],
)
def test_unsupported_token_embeddings_are_named(build, name):
    x, ids = build()
    x = keras_attn.TransformerDecoder(32, 4)(x)
    model = keras.Model(ids, keras.layers.Dense(VOCAB)(x))
    with pytest.raises(ValueError, match=f"(?s){name}.*SinusoidalEmbedding"):
        generate(model, PROMPTS, 6)


def test_a_decoder_called_with_segment_ids_is_not_decoded():
    """Packed rows (`segment_ids`) are for training: a cached step cannot
    be given them, so `generate` refuses rather than ignore them."""
    ids = keras.Input((None,), dtype="int32")
    segments = keras.Input((None,), dtype="int32")
    x = keras.layers.Embedding(VOCAB, WIDTH)(ids)
    x = keras_attn.TransformerDecoder(16, 2)(x, segment_ids=segments)
    model = keras.Model([ids, segments], keras.layers.Dense(VOCAB)(x))
    with pytest.raises(ValueError, match=r"(?s)cannot decode.*'segment_ids'"):
        generate(model, PROMPTS, 6)
    # Ids the model was built with, a constant: refused too, not dropped.
    x = keras.layers.Embedding(VOCAB, WIDTH)(ids)
    x = keras_attn.TransformerDecoder(16, 2)(x, segment_ids=np.zeros((2, 3), "int32"))
    model = keras.Model(ids, keras.layers.Dense(VOCAB)(x))
    with pytest.raises(ValueError, match=r"(?s)cannot decode.*'segment_ids'"):
        generate(model, PROMPTS, 6)
