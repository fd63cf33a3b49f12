"""`generate` under a mixed dtype policy, its checks of the encoder inputs,
and its defined behaviour at the edges: `max_new_tokens=0`, ragged list
prompts and `end_token_id == pad_token_id` (issue 28); empty prompts,
`num_beams` and `top_k` past the vocabulary (issue 44)."""

import contextlib
import re

import keras
import numpy as np
import pytest

import keras_attn
from keras_attn import generation
from keras_attn.generation import generate, processors
from tests.helpers.backend import to_numpy
from tests.helpers.builders import GENERATION_VOCAB as VOCAB
from tests.helpers.builders import GENERATION_WIDTH as WIDTH
from tests.helpers.references import naive_greedy

PROMPTS = np.array([[3, 4, 5], [6, 7, 8]], "int32")
SOURCES = np.array([[3, 4, 5, 6], [8, 9, 0, 0]], "int32")
STARTS = np.ones((2, 1), "int32")
LENGTH = 8


def fresh_generate(model, inputs, *args, **kwargs):
    """`generate` with the model's compiled loops dropped first, so the loop
    is built anew under the current global dtype policy."""
    generation.api._GENERATORS.pop(model, None)
    return generate(model, inputs, *args, **kwargs)


@contextlib.contextmanager
def global_policy(name):
    keras.config.set_dtype_policy(name)
    try:
        yield
    finally:
        keras.config.set_dtype_policy("float32")


# --- 1. Mixed policies: generation's own numbers stay float32 ------------------

METHODS = {  # each of the three: sampling and the penalty in one loop
    "sample with repetition_penalty": {
        "method": "sample",
        "seed": 3,
        "temperature": 0.7,
        "top_p": 0.9,
        "repetition_penalty": 1.5,
    },
    "beam": {"method": "beam", "num_beams": 3},
}
# One mixed policy a method, each policy once (every loop compiles anew).
POLICY = {"sample with repetition_penalty": "mixed_bfloat16", "beam": "mixed_float16"}


@pytest.mark.parametrize("method", METHODS)
def test_a_mixed_global_policy_decodes_as_float32(gpt, translator, monkeypatch, method):
    """Models built in float32 give the same logits under a mixed global
    policy, so `generate` must give the same tokens and scores: the loop's
    numbers are float32 whatever the policy (issue 28, item 1)."""
    temperatures = []

    def spy(logits, value):
        temperatures.append((str(logits.dtype), str(value.dtype)))
        return original(logits, value)

    original = processors.temperature
    monkeypatch.setattr(processors, "temperature", spy)
    options = dict(METHODS[method], return_scores=True)
    for model, inputs in [(gpt, PROMPTS), (translator, [SOURCES, STARTS])]:
        tokens, scores = fresh_generate(model, inputs, LENGTH, **options)
        temperatures.clear()
        with global_policy(POLICY[method]):
            mixed_tokens, mixed_scores = fresh_generate(
                model, inputs, LENGTH, **options
            )
        np.testing.assert_array_equal(mixed_tokens, tokens)
        # A temperature of 0.7 in bfloat16 is 0.69921875: scores move by 1e-3.
        np.testing.assert_allclose(mixed_scores, scores, rtol=1e-6, atol=1e-6)
        assert mixed_scores.dtype == np.float32
        assert bool(temperatures) == ("temperature" in options)
        for logits_dtype, temperature_dtype in temperatures:
            assert "float32" in logits_dtype and "float32" in temperature_dtype


def test_the_temperature_applied_under_a_mixed_policy_is_float32_0_7(gpt, monkeypatch):
    """The temperature's value reaches the logits as float32 0.7, not as a
    bfloat16 0.6992 (read where the loop runs eagerly: from Python on every
    backend with `jit_compile=False`, and `predict_on_batch` on PyTorch)."""
    values = []

    def spy(logits, value):
        values.append(to_numpy(value))
        return original(logits, value)

    original = processors.temperature
    monkeypatch.setattr(processors, "temperature", spy)
    with global_policy("mixed_bfloat16"):
        fresh_generate(
            gpt, PROMPTS, 5, "sample", temperature=0.7, seed=1, jit_compile=False
        )
    assert values
    for value in values:
        assert value.dtype == np.float32
        np.testing.assert_array_equal(value, np.float32([0.7]))


# --- 2. Encoder inputs, checked at the call ----------------------------------------

SOURCE_ROWS = [
    pytest.param(
        SOURCES + VOCAB,
        rf"encoder input 'source'.*\[0, vocabulary_size={VOCAB}\).*from 13 to 22",
        id="ids-past-the-vocabulary",
    ),
    pytest.param(-SOURCES, r"encoder input 'source'.*from -9 to 0", id="negative"),
    pytest.param(
        SOURCES[:1],
        r"encoder input 'source'.*shape \(2, None\).*batch=2.*shape=\(1, 4\)",
        id="batch-1-for-2-prompts",
    ),
    pytest.param(
        np.concatenate([SOURCES, SOURCES]),
        r"encoder input 'source'.*batch=2.*shape=\(4, 4\)",
        id="batch-4-for-2-prompts",
    ),
    pytest.param(
        SOURCES[0], r"encoder input 'source'.*shape=\(4,\)", id="one-dimensional"
    ),
    pytest.param(
        SOURCES.astype("float32"),
        r"encoder input 'source'.*int token ids.*dtype=float32",
        id="float-ids",
    ),
    pytest.param(
        [[3, 4, 5], [6]],
        r"encoder input 'source'.*rows of different lengths: pad them",
        id="ragged-lists",
    ),
]


@pytest.mark.parametrize("source", [None, "abc"], ids=repr)
def test_encoder_inputs_that_are_no_arrays_are_a_type_error(translator, source):
    with pytest.raises(TypeError, match=r"encoder input 'source'.*array of numbers"):
        generate(translator, [source, STARTS], max_new_tokens=2)


@pytest.mark.parametrize("as_dict", [False, True], ids=["list", "dict"])
@pytest.mark.parametrize("source, match", SOURCE_ROWS)
def test_bad_encoder_inputs_are_refused_before_anything_runs(
    translator, source, match, as_dict
):
    """Out-of-range ids gave NaN or garbage on JAX and TensorFlow, a batch
    that does not match the prompt's was broadcast on TensorFlow (issue 28,
    item 2); now each is a ValueError at the call, and nothing compiles."""
    inputs = {"source": source, "target": STARTS} if as_dict else [source, STARTS]
    compiled = dict(generation.api._GENERATORS.get(translator, {}))
    with pytest.raises(ValueError, match=match):
        generate(translator, inputs, max_new_tokens=4)
    assert dict(generation.api._GENERATORS.get(translator, {})) == compiled


def test_valid_encoder_inputs_of_any_array_form_decode_alike(translator):
    tokens = generate(translator, [SOURCES, STARTS], LENGTH)
    for sources in (SOURCES.tolist(), SOURCES.astype("int64")):
        np.testing.assert_array_equal(
            generate(translator, {"source": sources, "target": STARTS}, LENGTH),
            tokens,
        )


def test_float_encoder_inputs_are_checked_against_their_keras_input():
    """An encoder input of features, not ids: its shape is checked, its
    values are not (no token embedding reads it)."""
    features = keras.Input((None, 5), name="features")
    target = keras.Input((None,), dtype="int32", name="target")
    x = keras_attn.TransformerEncoder(32, 4)(keras.layers.Dense(WIDTH)(features))
    y = keras_attn.SinusoidalEmbedding(
        vocabulary_size=VOCAB, embedding_dim=WIDTH, mask_zero=True
    )(target)
    y = keras_attn.TransformerDecoder(32, 4)(y, x)
    model = keras.Model([features, target], keras.layers.Dense(VOCAB)(y))
    values = np.random.default_rng(0).normal(size=(2, 4, 5)) * 100
    assert generate(model, [values, STARTS], LENGTH).shape == (2, LENGTH)
    with pytest.raises(
        ValueError, match=r"'features'.*shape \(2, None, 5\).*shape=\(2, 4, 3\)"
    ):
        generate(model, [values[..., :3], STARTS], LENGTH)


# --- 9. max_new_tokens=0, ragged prompts, end_token_id == pad_token_id ------------


@pytest.mark.parametrize(
    "prompt",
    [PROMPTS, np.array([[0, 3, 4], [6, 7, 8]]), np.array([[3, 4, 0], [6, 7, 8]])],
    ids=["even", "left-padded", "right-padded"],
)
def test_max_new_tokens_0_returns_the_prompts_without_running_the_model(gpt, prompt):
    compiled = dict(generation.api._GENERATORS.get(gpt, {}))
    streamed = []
    tokens, scores = generate(
        gpt,
        prompt,
        max_new_tokens=0,
        return_scores=True,
        on_token=lambda *args: streamed.append(args),
    )
    np.testing.assert_array_equal(tokens, prompt)
    assert tokens.dtype == np.int32 and scores.dtype == np.float32
    np.testing.assert_array_equal(scores, np.zeros(prompt.shape))
    assert not streamed
    assert dict(generation.api._GENERATORS.get(gpt, {})) == compiled


def test_max_new_tokens_0_still_checks_the_call(gpt, translator):
    with pytest.raises(ValueError, match=r"from 13 to 18"):
        generate(gpt, PROMPTS + VOCAB - 3, max_new_tokens=0)
    with pytest.raises(ValueError, match=r"encoder input 'source'.*batch=2"):
        generate(translator, [SOURCES[:1], STARTS], max_new_tokens=0)
    with pytest.raises(ValueError, match=r"max_new_tokens=-1"):
        generate(gpt, PROMPTS, max_new_tokens=-1)


@pytest.mark.parametrize(
    "lengths",
    [{"max_length": LENGTH}, {"max_new_tokens": 4}],
    ids=["max_length", "max_new_tokens"],
)
def test_ragged_list_prompts_are_right_padded(gpt, lengths):
    """A list of rows of different lengths decodes as its right-padded array:
    each row as it would alone, returned left-aligned."""
    ragged = [[3, 4, 5], [6, 7], [9]]
    padded = np.array([[3, 4, 5], [6, 7, 0], [9, 0, 0]])
    tokens = generate(gpt, ragged, **lengths)
    np.testing.assert_array_equal(tokens, generate(gpt, padded, **lengths))
    as_arrays = [np.array(row) for row in ragged]
    np.testing.assert_array_equal(generate(gpt, as_arrays, **lengths), tokens)
    for row, prompt in zip(tokens, ragged, strict=True):
        new = lengths.get("max_new_tokens")
        length = len(prompt) + new if new else LENGTH
        assert row[:length].tolist() == naive_greedy(gpt, prompt, length)
        assert not row[length:].any()  # pad_token_id=0 after the row


def test_ragged_list_prompts_pad_with_pad_token_id_and_keep_the_checks(gpt):
    tokens = generate(gpt, [[3, 4, 5], [6]], max_new_tokens=0, pad_token_id=12)
    assert tokens.tolist() == [[3, 4, 5], [6, 12, 12]]
    with pytest.raises(ValueError, match=r"empty rows: \[1\]"):
        generate(gpt, [[3, 4, 5], []], LENGTH)
    with pytest.raises(ValueError, match=r"int token ids.*dtype=float"):
        generate(gpt, [[3.0, 4.0], [5.0]], LENGTH)


def end_is_pad_case(model):
    """`(prompts, their greedy tokens, x)`: an id `x` that row 0 generates
    and no prompt holds, to serve as both end and pad id."""
    candidates = [PROMPTS, np.array([[9, 10, 11], [12, 1, 2]]), np.array([[1], [5]])]
    for prompts in candidates:
        tokens = generate(model, prompts, LENGTH)
        for x in tokens[0, prompts.shape[1] :]:
            if x != 0 and x not in prompts:
                return prompts, tokens, int(x)
    pytest.fail("no prompt makes row 0 generate an id no prompt holds")


def test_end_token_id_equal_to_pad_token_id_ends_rows_with_that_id(gpt):
    """Hugging Face's GPT-2 convention (pad = end): a row stops at its first
    end id, which fills it from there; in prompts the id is padding."""
    prompts, greedy, x = end_is_pad_case(gpt)
    width = prompts.shape[1]
    _, greedy_scores = generate(gpt, prompts, LENGTH, return_scores=True)
    tokens, scores = generate(
        gpt, prompts, LENGTH, end_token_id=x, pad_token_id=x, return_scores=True
    )
    rows = zip(tokens, scores, greedy, greedy_scores, strict=True)
    for row, row_scores, expected, expected_scores in rows:
        ends = np.flatnonzero(expected[width:] == x)
        end = width + ends[0] if len(ends) else LENGTH - 1
        expected = expected.copy()
        expected[end + 1 :] = x  # the end id, then the same id as padding
        np.testing.assert_array_equal(row, expected)
        np.testing.assert_allclose(
            row_scores[: end + 1], expected_scores[: end + 1], atol=1e-6
        )
        assert not row_scores[end + 1 :].any()
    assert len(np.flatnonzero(greedy[0, width:] == x))  # row 0 did end
    with pytest.raises(ValueError, match=rf"pad_token_id={x} on one side"):
        token = int(prompts[0, 0])  # not x
        generate(gpt, [[token, x, token]], LENGTH, end_token_id=x, pad_token_id=x)


# --- 4. Prompts with nothing in them, settings past the vocabulary (issue 44) --


@pytest.mark.parametrize(
    "prompt",
    [np.zeros((0, 3), "int32"), [[]], []],
    ids=["empty batch", "empty row", "empty list"],
)
def test_an_empty_prompt_is_refused_as_empty(gpt, prompt):
    shape = re.escape(str(np.asarray(prompt).shape))
    with pytest.raises(ValueError, match=rf"The prompt is empty.*shape={shape}"):
        generate(gpt, prompt, LENGTH)


def test_more_beams_than_the_vocabulary_are_refused(gpt):
    with pytest.raises(
        ValueError, match=rf"num_beams={VOCAB + 1}, vocabulary_size={VOCAB}"
    ):
        generate(gpt, PROMPTS, LENGTH, method="beam", num_beams=VOCAB + 1)


def test_a_top_k_past_the_vocabulary_keeps_every_token(gpt):
    """Documented (as Hugging Face clamps it): the same draws as no top_k."""
    kwargs = {"method": "sample", "seed": 5, "max_new_tokens": 3}
    np.testing.assert_array_equal(
        generate(gpt, PROMPTS, top_k=VOCAB + 7, **kwargs),
        generate(gpt, PROMPTS, **kwargs),
    )
