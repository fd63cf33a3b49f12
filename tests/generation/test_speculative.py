"""Speculative decoding: greedy with a draft is greedy (a draft that always
agrees, one that partly agrees; padding, end tokens);
the rejection rule keeps the target's distribution (alone, and end to end);
seeded sampling is reproducible and the compiled and Python loops agree; bad
input, each naming the argument."""

import keras
import numpy as np
import pytest
from keras import ops

from keras_attn.generation import generate
from keras_attn.generation.speculative import rejection_sample
from keras_attn.generation.strategies import counter_uniform
from keras_attn.layers import PositionEmbedding, TransformerDecoder
from tests.helpers.backend import BACKEND, to_numpy
from tests.helpers.builders import GENERATION_WIDTH as WIDTH
from tests.helpers.builders import one_decoder_model
from tests.helpers.references import reference_decode

LEFT_PADDED = np.array([[0, 0, 3, 4, 5], [6, 7, 8, 9, 10]], "int32")
RIGHT_PADDED = [[3, 5, 6], [6, 7, 8, 9, 10]]  # a list: right-padded


def first_block(gpt):
    """A draft that mostly agrees: the target without its second block (a
    model of its own, with the target's embedding, first block, norm and
    head weights)."""
    ids = keras.Input((None,), dtype="int32")
    layers = [gpt.layers[i] for i in (1, 2, 5, 6)]
    x = ids
    for layer in layers:
        x = layer.__class__.from_config(layer.get_config())(x)
    draft = keras.Model(ids, x)
    for copy, layer in zip(draft.layers[1:], layers, strict=True):
        copy.set_weights(layer.get_weights())
    return draft


def plain_greedy(model, prompt, new_tokens, end):
    """Greedy decoding of left-padded rows as Hugging Face runs it (the
    model on each whole prefix): `(tokens, scores)`, `generate`'s layout."""
    tokens, scores = [], []
    for row in prompt:
        pads = int(np.sum(row == 0))
        found = reference_decode(
            model, row[pads:], len(row) - pads + new_tokens, end_token_ids=(end,)
        )
        tokens.append([0] * pads + found[0])
        scores.append([0.0] * pads + found[1])
    return np.array(tokens), np.array(scores)


def test_greedy_with_a_draft_is_greedy(gpt):
    """Left padding, an end token that ends the second row at once (the
    others run on: every round keeps the fewest tokens they accepted),
    scores; a draft that partly agrees. (The target as its own draft, which
    accepts every token: `generate`'s docstring example.)"""
    prompt = np.concatenate([LEFT_PADDED, [[0, 9, 3, 8, 2]]])
    end = int(np.argmax(to_numpy(gpt(prompt))[1, -1]))  # row 1's first
    tokens, scores = plain_greedy(gpt, prompt, 7, end)
    assert (tokens[1, 6:] == 0).all()  # ended
    spec_tokens, spec_scores, acceptance = generate(
        gpt, prompt, max_new_tokens=7, end_token_id=end, return_scores=True,
        draft_model=first_block(gpt), num_speculative_tokens=3,
        return_acceptance=True,
    )  # fmt: skip
    np.testing.assert_array_equal(spec_tokens, tokens)
    np.testing.assert_allclose(spec_scores, scores, atol=1e-4)
    assert 0.0 < acceptance < 1.0  # the draft partly agrees


def test_sampling_python_loop_streams_what_the_compiled_loop_returns(gpt):
    """Right-padded rows, seeded, end tokens not before `min_new_tokens`,
    padding after them; on PyTorch both loops run from Python. On JAX, the
    compiled loop only (eager JAX compiles each op anew: 40 s; the Python
    rounds are the same ops on every backend), run twice: the seed's tokens.
    (Not compared with plain sampling: a draft token is drawn from a stream
    of its own, so the draws differ even with the target as its own draft.)"""
    ends = [1, 2, 3, 4, 5, 6]
    options = dict(
        max_new_tokens=5, method="sample", seed=5, top_k=6, end_token_id=ends,
        min_new_tokens=2, draft_model=first_block(gpt), num_speculative_tokens=2,
    )  # fmt: skip
    compiled = generate(gpt, RIGHT_PADDED, **options)
    new = np.stack([compiled[0, 3:8], compiled[1, 5:10]])  # (rows, new tokens)
    assert not np.isin(new[:, :2], ends).any()
    for row in new:
        stops = np.flatnonzero(np.isin(row, ends))
        assert stops.size == 0 or (row[stops[0] + 1 :] == 0).all()
    if BACKEND == "jax":
        np.testing.assert_array_equal(generate(gpt, RIGHT_PADDED, **options), compiled)
        return
    streamed = []
    python = generate(
        gpt, RIGHT_PADDED, jit_compile=False,
        on_token=lambda step, tokens: streamed.append((step, tokens)), **options,
    )  # fmt: skip
    np.testing.assert_array_equal(python, compiled)
    steps = len(streamed)  # fewer if every row ended
    assert [step for step, _ in streamed] == list(range(steps))
    np.testing.assert_array_equal(np.stack([t for _, t in streamed], 1), new[:, :steps])


@pytest.mark.skipif(BACKEND != "torch", reason="PyTorch's jit_compile=True")
def test_torch_compiled_rounds_replay_like_eager(gpt, cuda_graphs):
    """PyTorch, `jit_compile=True`: each round exported and compiled once
    (here replayed as CUDA graphs would be), the draft's weights and caches
    included; the tokens of the eager rounds."""
    options = dict(
        max_new_tokens=6, method="sample", seed=2, top_k=5,
        draft_model=first_block(gpt), num_speculative_tokens=2,
    )  # fmt: skip
    compiled = generate(gpt, LEFT_PADDED, jit_compile=True, **options)
    np.testing.assert_array_equal(compiled, generate(gpt, LEFT_PADDED, **options))
    assert len(cuda_graphs) == 1 and cuda_graphs[0].replays >= 2
    assert all(r.written for r in cuda_graphs)  # the caches, in place


def exact_histogram(p, q, grid=200):
    """`rejection_sample`'s output distribution for explicit `p`, `q`
    `(V,)`: every draft token (weighted by `q`) against a grid of
    acceptance and residual uniforms."""
    vocabulary = len(p)
    u = (np.arange(grid) + 0.5) / grid
    x = np.repeat(np.arange(vocabulary), grid)  # (V * grid,)
    u_accept, u_residual = np.tile(u, vocabulary), np.tile(u[::-1], vocabulary)
    rows = len(x)
    accepted, replacement = rejection_sample(
        ops.convert_to_tensor(np.tile(p, (rows, 1)), "float32"),
        ops.convert_to_tensor(np.tile(q, (rows, 1)), "float32"),
        ops.convert_to_tensor(x, "int32"),
        ops.convert_to_tensor(u_accept, "float32"),
        ops.convert_to_tensor(u_residual, "float32"),
    )
    accepted, replacement = to_numpy(accepted), to_numpy(replacement)
    accept_rate = accepted.reshape(vocabulary, grid).mean(1)  # (V,) per draft x
    residual = np.bincount(replacement[:grid], minlength=vocabulary) / grid
    return q * accept_rate + (1 - np.sum(q * accept_rate)) * residual, accepted


def test_rejection_sampling_keeps_the_target_distribution():
    p = np.array([0.5, 0.3, 0.15, 0.05, 0.0])
    q = np.array([0.2, 0.1, 0.3, 0.3, 0.1])
    found, _ = exact_histogram(p, q)
    np.testing.assert_allclose(found, p, atol=5e-3)
    _, accepted = exact_histogram(q, q)  # the same distribution: all accepted
    assert accepted.all()
    # With the hash's draws: draft tokens, acceptance and residual streams.
    rows = ops.arange(4000, dtype="int32")
    seed = ops.convert_to_tensor([11], "int32")
    draws = [to_numpy(counter_uniform(seed, rows, stream)) for stream in range(3)]
    x = np.searchsorted(np.cumsum(q), draws[0], side="right")
    accepted, replacement = rejection_sample(
        ops.convert_to_tensor(np.tile(p, (4000, 1)), "float32"),
        ops.convert_to_tensor(np.tile(q, (4000, 1)), "float32"),
        ops.convert_to_tensor(np.minimum(x, 4), "int32"),
        *(ops.convert_to_tensor(d, "float32") for d in draws[1:]),
    )
    tokens = np.where(to_numpy(accepted), np.minimum(x, 4), to_numpy(replacement))
    np.testing.assert_allclose(np.bincount(tokens, minlength=5) / 4000, p, atol=0.03)


def positions_draft(sequence_length):
    """A draft with a learned position table of `sequence_length` rows."""
    ids = keras.Input((None,), dtype="int32")
    x = keras.layers.Embedding(13, WIDTH)(ids)
    x = PositionEmbedding(sequence_length)(x)
    x = TransformerDecoder(32, 4)(x)
    return keras.Model(ids, keras.layers.Dense(13)(x))


def unreadable_draft():
    """A draft whose graph `generate` cannot read (no decoder)."""
    ids = keras.Input((None,), dtype="int32")
    return keras.Model(ids, keras.layers.Embedding(13, 13)(ids))


DRAFTS = {
    "vocabulary": lambda: one_decoder_model(7, WIDTH)[0],
    "logits": lambda: one_decoder_model(13, WIDTH, head=keras.layers.Dense(12))[0],
    "functions": lambda: (lambda *a: None, lambda *a: None),
    "positions": lambda: positions_draft(8),
    "unreadable": unreadable_draft,
}


SPARE = "(?s)`draft_model`, whose PositionEmbedding holds 8.*1 of them are spare"


@pytest.mark.parametrize(
    "options, error, match",
    [
        ({"method": "beam"}, ValueError, "method='beam'"),
        ({"repetition_penalty": 1.2}, ValueError, "repetition_penalty=1.2"),
        ({"num_speculative_tokens": 0}, ValueError, "num_speculative_tokens"),
        ({"draft_model": None, "num_speculative_tokens": 4}, ValueError,
         "num_speculative_tokens=4 and draft_model=None"),
        ({"draft_model": None, "return_acceptance": True}, ValueError,
         "return_acceptance"),
        ({"draft_model": "vocabulary"}, ValueError,
         "vocabulary_size=7; the target has 13"),
        ({"draft_model": "logits"}, ValueError, "score 12 tokens; the target's 13"),
        ({"draft_model": "functions"}, TypeError, "`draft_model` must be a"),
        ({"draft_model": "positions", "num_speculative_tokens": 2}, ValueError,
         SPARE),
        ({"draft_model": "unreadable"}, ValueError, "^`draft_model`: "),
    ],
)  # fmt: skip
def test_bad_speculative_input(gpt, options, error, match):
    options = {"draft_model": gpt, **options}
    if isinstance(options["draft_model"], str):
        options["draft_model"] = DRAFTS[options["draft_model"]]()
    with pytest.raises(error, match=match):
        generate(gpt, LEFT_PADDED, max_new_tokens=3, **options)


def test_a_draft_must_take_the_target_inputs(gpt, translator):
    with pytest.raises(ValueError, match="1 inputs, 0 of them encoder.*has 2, 1"):
        generate(translator, [LEFT_PADDED, LEFT_PADDED], 8, draft_model=gpt)
    # The same inputs in another order: the draft would read the ids as its
    # source (specs alike), and accept nothing, silently.
    swapped = keras.Model(translator.inputs[::-1], translator.outputs)
    with pytest.raises(ValueError, match=r"(?s)same order.*token ids at input"):
        generate(translator, [LEFT_PADDED, LEFT_PADDED], 8, draft_model=swapped)


@pytest.mark.skipif(BACKEND != "torch", reason="suite time: compiles elsewhere")
def test_an_encoder_decoder_draft_reads_the_encoder_inputs(translator):
    """The target as its own draft, with a padded source: every draft token
    is accepted, and the tokens are greedy's (eager rounds: the same ops on
    every backend)."""
    inputs = [np.array([[3, 4, 5, 6], [7, 8, 0, 0]]), np.ones((2, 1), "int32")]
    tokens, acceptance = generate(
        translator, inputs, 9, draft_model=translator, num_speculative_tokens=3,
        return_acceptance=True,
    )  # fmt: skip
    np.testing.assert_array_equal(tokens, generate(translator, inputs, 9))
    assert acceptance == 1.0


# Compiling the loop costs 7 s on JAX, 3 s on TensorFlow (suite time): the
# eager rounds are the same ops; PyTorch runs them in 0.1 s.
@pytest.mark.skipif(BACKEND != "torch", reason="suite time: compiles elsewhere")
def test_sampled_tokens_follow_the_target_distribution():
    """End to end, a 4-token vocabulary, one round per row (k=1) for 512
    rows: the first new token's frequencies are the target's probabilities,
    with a draft (another model) the target often rejects."""
    target, draft = (one_decoder_model(4, WIDTH, seed=seed)[0] for seed in (1, 2))
    prompt = np.tile(np.array([[1, 2, 3]], "int32"), (512, 1))
    tokens, acceptance = generate(
        target, prompt, max_new_tokens=1, method="sample", seed=3,
        draft_model=draft, num_speculative_tokens=1, return_acceptance=True,
    )  # fmt: skip
    logits = to_numpy(target(prompt[:1]))[0, -1]
    p = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
    found = np.bincount(tokens[:, 3], minlength=4) / len(prompt)
    np.testing.assert_allclose(found, p, atol=0.07)  # 3 sigma: 0.066
    assert acceptance < 0.9
