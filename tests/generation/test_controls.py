"""`generate`'s controls: end-token lists, new-token counts, the repetition
penalty, scores, streaming, the compiled-loop cache, `(prefill, step)`
functions, and the forms of prompts."""

import numpy as np
import pytest
from keras import ops

from keras_attn import generation
from keras_attn.generation import generate
from tests.helpers.builders import GENERATION_VOCAB as VOCAB
from tests.helpers.builders import GENERATION_WIDTH as WIDTH
from tests.helpers.builders import decoder_only_model, one_decoder_model
from tests.helpers.references import naive_greedy, reference_decode

# Most tests decode these rows to 12 (9 new tokens), so they share one
# compiled loop per method and end-token set.
PROMPTS = np.array([[3, 4, 5], [6, 7, 8]], "int32")
LENGTH = 12


def stopping_pair(new):
    """Two end ids on which the two rows of new tokens first stop, one each,
    within their first 6 new tokens: `([a, b], new-token index of each row's
    first end)`, or None."""
    best = None
    for a in range(1, VOCAB):  # never the pad id
        for b in range(1, VOCAB):
            hits = [np.flatnonzero(np.isin(row, [a, b])) for row in new]
            if a == b or not all(len(h) for h in hits):
                continue
            firsts = [int(h[0]) for h in hits]
            if [new[0, firsts[0]], new[1, firsts[1]]] != [a, b]:
                continue  # each id must end one of the rows
            if max(firsts) < 6 and (best is None or max(firsts) < max(best[1])):
                best = [a, b], firsts
    return best


@pytest.fixture(scope="module")
def decoding():
    """`(model, its naive greedy tokens, stopping_pair)`: the first seed whose
    rows stop on two end ids (untrained models often repeat one token)."""
    for seed in range(10):
        model = decoder_only_model(VOCAB, WIDTH, num_key_value_heads=2, seed=seed)
        greedy = np.array([naive_greedy(model, p, LENGTH) for p in PROMPTS])
        pair = stopping_pair(greedy[:, PROMPTS.shape[1] :])
        if pair is not None:
            return model, greedy, pair
    pytest.fail("no seed in range(10) gives rows that stop on two end ids")


@pytest.fixture(scope="module")
def gpt(decoding):
    """Here, the model of `decoding` (not tests/generation/conftest.py's)."""
    return decoding[0]


@pytest.fixture(scope="module")
def greedy(decoding):
    return decoding[1]


@pytest.fixture(scope="module")
def end_tokens(decoding):
    return decoding[2]


# --- End tokens, new-token counts ---------------------------------------------


def test_a_list_of_end_tokens_stops_each_row_at_its_first(gpt, greedy, end_tokens):
    ends, firsts = end_tokens
    stopped = generate(gpt, PROMPTS, LENGTH, end_token_id=ends)
    width = PROMPTS.shape[1]
    for row, full, first in zip(stopped, greedy, firsts, strict=True):
        cut = width + first + 1
        assert row[:cut].tolist() == full[:cut].tolist()
        assert np.all(row[cut:] == 0) and cut < LENGTH
    assert {stopped[0, width + firsts[0]], stopped[1, width + firsts[1]]} == set(ends)
    np.testing.assert_array_equal(
        generate(gpt, PROMPTS, LENGTH, end_token_id=tuple(ends)), stopped
    )


@pytest.mark.parametrize("side", ["left", "right"])
def test_max_new_tokens_gives_every_row_that_many(gpt, side):
    """Rows of 2 and 3 tokens, 9 new tokens each: 11 and 12 tokens; right-padded
    rows come back left-aligned and padded after."""
    rows = [[3, 4], [5, 6, 7]]
    padded = np.array([[0, 3, 4] if side == "left" else [3, 4, 0], [5, 6, 7]])
    tokens = generate(gpt, padded, max_new_tokens=9)
    assert tokens.shape == (2, 12) and tokens.dtype == np.int32
    first, second = (naive_greedy(gpt, row, len(row) + 9) for row in rows)
    assert tokens[0].tolist() == ([0] + first if side == "left" else first + [0])
    assert tokens[1].tolist() == second


def test_min_new_tokens_holds_the_end_tokens_back(gpt, end_tokens):
    ends, firsts = end_tokens
    least = max(firsts) + 2  # both rows would stop before
    tokens = generate(gpt, PROMPTS, LENGTH, end_token_id=ends, min_new_tokens=least)
    width = PROMPTS.shape[1]
    assert not np.isin(tokens[:, width : width + least], ends).any()
    for row, prompt in zip(tokens, PROMPTS, strict=True):
        expected, _ = reference_decode(
            gpt, prompt, LENGTH, end_token_ids=ends, min_new_tokens=least
        )
        assert row.tolist() == expected
    np.testing.assert_array_equal(
        generate(gpt, PROMPTS, LENGTH, end_token_id=ends, min_new_tokens=0),
        generate(gpt, PROMPTS, LENGTH, end_token_id=ends),
    )


# --- Repetition penalty, scores -----------------------------------------------


def test_repetition_penalty(gpt, greedy):
    """`inf`: no token twice (9 new tokens, 10 not in the prompt); `1.0`:
    greedy; `1.5`: Hugging Face's rule on the full-forward logits."""
    width = PROMPTS.shape[1]
    assert LENGTH - width < VOCAB - width
    unique = generate(gpt, PROMPTS, LENGTH, repetition_penalty=float("inf"))
    for row in unique:
        assert len(set(row.tolist())) == LENGTH, row
    assert not np.array_equal(unique, greedy)  # greedy repeats: a real test
    np.testing.assert_array_equal(
        generate(gpt, PROMPTS, LENGTH, repetition_penalty=1.0), greedy
    )
    penalized = generate(gpt, PROMPTS, LENGTH, repetition_penalty=1.5)
    for row, prompt in zip(penalized, PROMPTS, strict=True):
        expected, _ = reference_decode(gpt, prompt, LENGTH, repetition_penalty=1.5)
        assert row.tolist() == expected


def test_scores_are_the_log_probabilities_of_the_chosen_tokens(gpt, end_tokens):
    ends, _ = end_tokens
    tokens, scores = generate(
        gpt, PROMPTS, LENGTH, end_token_id=ends, return_scores=True
    )
    assert scores.shape == tokens.shape and scores.dtype == np.float32
    for row, row_scores, prompt in zip(tokens, scores, PROMPTS, strict=True):
        expected, expected_scores = reference_decode(
            gpt, prompt, LENGTH, end_token_ids=ends
        )
        assert row.tolist() == expected
        np.testing.assert_allclose(row_scores, expected_scores, atol=1e-4)
    beam_tokens, beam_scores = generate(
        gpt, PROMPTS, LENGTH, "beam", num_beams=1, end_token_id=ends, return_scores=True
    )
    np.testing.assert_array_equal(beam_tokens, tokens)
    np.testing.assert_allclose(beam_scores, scores, atol=1e-5)


# --- Streaming ----------------------------------------------------------------


@pytest.mark.parametrize("method", ["greedy", "sample"])
def test_on_token_streams_every_new_column(gpt, method):
    calls = []
    options = {"seed": 3, "top_k": 4} if method == "sample" else {}

    def on_token(step, tokens):
        assert isinstance(tokens, np.ndarray) and tokens.shape == (2,)
        calls.append((step, tokens.tolist()))

    tokens = generate(gpt, PROMPTS, LENGTH, method, on_token=on_token, **options)
    width = PROMPTS.shape[1]
    assert [step for step, _ in calls] == list(range(LENGTH - width))
    for step, new in calls:
        assert new == tokens[:, width + step].tolist()
    np.testing.assert_array_equal(
        tokens, generate(gpt, PROMPTS, LENGTH, method, **options)
    )


# --- The compiled-loop cache ----------------------------------------------------


def test_new_numbers_compile_nothing():
    """The compiled loop (on PyTorch, the exported step) is traced once: new
    numbers are inputs. It equals the eager loop, and sees new weights."""
    model, _, _ = one_decoder_model(VOCAB, WIDTH, seed=5)
    compiled = dict(method="sample", jit_compile=True)
    eager = dict(seed=1, temperature=0.7, top_k=3, repetition_penalty=1.1)
    first = generate(model, PROMPTS, LENGTH, **eager, **compiled)
    (generator,) = generation.api._GENERATORS[model].values()
    traces = generator.traces
    second = generate(
        model,
        PROMPTS,
        LENGTH,
        seed=2**31 - 1,
        temperature=1.3,
        top_p=0.9,
        repetition_penalty=1.2,
        **compiled,
    )
    assert not np.array_equal(first, second)  # the new numbers did arrive
    assert list(generation.api._GENERATORS[model].values()) == [generator]
    assert generator.traces == traces > 0
    eager.update(method="sample", jit_compile=False)
    np.testing.assert_array_equal(generate(model, PROMPTS, LENGTH, **eager), first)
    model.set_weights([w * 1.5 for w in model.get_weights()])
    np.testing.assert_array_equal(
        generate(model, PROMPTS, LENGTH, **{**eager, "jit_compile": True}),
        generate(model, PROMPTS, LENGTH, **eager),
    )
    assert generator.traces == traces
    one_row = {**eager, "jit_compile": True}  # another batch size: new shapes
    np.testing.assert_array_equal(
        generate(model, PROMPTS[1:], LENGTH, **one_row),
        generate(model, PROMPTS[1:], LENGTH, **eager),
    )


# --- `(prefill, step)` functions -------------------------------------------------


def cacheless(model):
    """`(prefill, step)` running `model` without a cache: the state is the
    token buffer `(B, length)`, which each step writes and runs whole."""

    def prefill(token_ids, length):
        width = token_ids.shape[1]
        buffer = ops.pad(token_ids, [[0, 0], [0, length - width]])
        return model(buffer)[:, width - 1], buffer

    def step(token_ids, index, buffer):
        buffer = ops.slice_update(buffer, [0, index], ops.cast(token_ids, "int32"))
        return ops.take(model(buffer), index, axis=1), buffer

    return prefill, step


@pytest.mark.parametrize("method", ["greedy", "beam"])
def test_prefill_and_step_functions_decode_any_model(gpt, method):
    tokens = generate(cacheless(gpt), PROMPTS, 10, method, num_beams=1)
    for row, prompt in zip(tokens, PROMPTS, strict=True):
        assert row.tolist() == naive_greedy(gpt, prompt, 10)


def test_prefill_and_step_closures_read_the_current_weights():
    """A closure over a model keeps its compiled loop and reads the weights
    as they are now, not as when it was compiled."""
    model = decoder_only_model(VOCAB, WIDTH, seed=1)
    functions = cacheless(model)
    before = generate(functions, PROMPTS, 8)
    model.set_weights([-1.3 * w for w in model.get_weights()])
    after = generate(functions, PROMPTS, 8)
    assert len(generation.api._GENERATORS[functions[0]]) == 1
    assert not np.array_equal(before, after)
    for row, prompt in zip(after, PROMPTS, strict=True):
        assert row.tolist() == naive_greedy(model, prompt, 8)


# --- Prompts ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "prompt",
    [[[3, 4, 5]], [np.array([[3, 4, 5]])], [np.array([3, 4, 5])]],
    ids=["lists", "[array]", "[row]"],
)
def test_nested_list_prompts(gpt, greedy, prompt):
    tokens = generate(gpt, prompt, LENGTH)
    assert tokens.shape == (1, LENGTH)
    np.testing.assert_array_equal(tokens[0], greedy[0])  # PROMPTS[0] == [3, 4, 5]
