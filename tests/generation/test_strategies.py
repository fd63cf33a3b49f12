"""`generate`'s strategies: beam search against greedy and against a search of
every continuation, seeded top-k and top-p sampling, an end token; and the
counter-based uniform draws, the same on every backend."""

import json
import os
import subprocess
import sys
import time

import keras
import numpy as np
import pytest
from keras import ops

from keras_attn.generation import generate
from keras_attn.generation.strategies import counter_uniform
from tests.helpers.backend import require, to_numpy
from tests.helpers.builders import GENERATION_VOCAB as VOCAB
from tests.helpers.builders import GENERATION_WIDTH as WIDTH
from tests.helpers.builders import one_decoder_model
from tests.helpers.processes import ROOT
from tests.helpers.references import counter_uniform_reference, next_token_logits

PROMPTS = np.array([[3, 4, 5], [6, 7, 8]], "int32")
LENGTH = 12


# --- Greedy, beam search, sampling ---------------------------------------------


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


# --- Counter-based sampling: the same draws on every backend -------------------


@pytest.mark.parametrize("seed", [0, 1, 7, 12345, 2**31 - 1])
def test_counter_uniform_equals_its_uint32_reference(seed):
    rows = np.arange(11, dtype="int32")
    for step in (0, 1, 5, 300, 2**20 + 3):
        actual = to_numpy(
            counter_uniform(
                ops.convert_to_tensor(np.int32([seed])),
                ops.convert_to_tensor(rows),
                ops.convert_to_tensor(np.int32(step)),
            )
        )
        np.testing.assert_array_equal(
            actual, counter_uniform_reference(seed, rows, step).astype("float32")
        )


def test_counter_uniform_looks_uniform():
    rows = ops.convert_to_tensor(np.arange(10_000, dtype="int32"))
    draws = to_numpy(counter_uniform(ops.convert_to_tensor(np.int32([3])), rows, 5))
    assert np.all((draws >= 0) & (draws < 1))
    assert abs(draws.mean() - 0.5) < 0.01
    assert len(np.unique(draws)) > 9_900  # distinct counters, distinct draws
    histogram, _ = np.histogram(draws, bins=10, range=(0, 1))
    assert histogram.min() > 900 and histogram.max() < 1100


SAMPLE = dict(method="sample", seed=7, top_k=5, temperature=0.8)
SAMPLE_SCRIPT = f"""
import json, sys
import keras, numpy as np
import keras_attn
from keras_attn.generation import generate
model, draft = (keras.models.load_model(path) for path in sys.argv[1:])
prompts = np.array({PROMPTS.tolist()}, "int32")
plain = generate(model, prompts, {LENGTH}, **{SAMPLE})
speculated = generate(model, prompts, {LENGTH}, draft_model=draft, **{SAMPLE})
print(json.dumps([plain.tolist(), speculated.tolist()]))
"""


@pytest.mark.processes
@pytest.mark.skipif(
    keras.config.backend() != "jax",
    reason="one run covers every backend: TensorFlow and PyTorch in subprocesses, "
    "from the JAX run",
)
def test_sampling_draws_the_same_tokens_on_every_backend(tmp_path):
    """A saved model samples the same tokens on JAX (here), TensorFlow and
    PyTorch (subprocesses, run meanwhile), alone and with a draft model
    (speculative rejection sampling draws from the same counters)."""
    require("tensorflow", "torch")
    paths = []
    for name, seed in (("tiny", 4), ("draft", 5)):
        paths.append(str(tmp_path / f"{name}.keras"))
        one_decoder_model(VOCAB, WIDTH, seed=seed)[0].save(paths[-1])
    processes = {
        backend: subprocess.Popen(
            [sys.executable, "-c", SAMPLE_SCRIPT, *paths],
            env={**os.environ, "KERAS_BACKEND": backend, "TF_CPP_MIN_LOG_LEVEL": "3"},
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for backend in ("tensorflow", "torch")
    }
    deadline = time.monotonic() + 300
    try:
        model, draft = (keras.models.load_model(path) for path in paths)
        results = {
            "jax": np.array(
                [
                    generate(model, PROMPTS, LENGTH, **SAMPLE),
                    generate(model, PROMPTS, LENGTH, draft_model=draft, **SAMPLE),
                ]
            )
        }
        for backend, process in processes.items():
            out, err = process.communicate(timeout=deadline - time.monotonic())
            assert process.returncode == 0, (backend, err[-3000:])
            results[backend] = np.array(json.loads(out.strip().splitlines()[-1]))
    finally:
        for process in processes.values():
            if process.poll() is None:
                process.kill()
                process.communicate()
    assert results["jax"].shape == (2, 2, LENGTH)
    assert not np.array_equal(*results["jax"])  # the draft's draws count too
    for backend in ("tensorflow", "torch"):
        np.testing.assert_array_equal(results[backend], results["jax"], backend)
