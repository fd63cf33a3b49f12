"""`generate(cache_dtype=...)`: the self-attention caches in int8
(`keras_attn.cache.Int8Cache`, dense or as a rolling cache's slots) or in
another float dtype, close to the float caches; `benchmarks/int8_cache.py`
measures memory, greedy agreement on a trained model and speed."""

import keras
import numpy as np
import pytest

from keras_attn.cache import DenseCache, Int8Cache, RollingCache
from keras_attn.generation import generate
from keras_attn.generation.adapter import ModelAdapter
from keras_attn.generation.graph import GraphPlan
from keras_attn.layers._lean_call import SublayerCalls as Calls
from tests.helpers.backend import to_numpy
from tests.helpers.builders import GENERATION_VOCAB as VOCAB
from tests.helpers.builders import decoder_only_model, llama_model

PROMPTS = np.array([[0, 3, 4, 5], [6, 7, 8, 9]])


def lockstep(model, dtype, steps):
    """The model's caches in `dtype` and in its own float dtype, decoded in
    lockstep on the same tokens (teacher-forced on the float path's argmax):
    `(the worst logits error over the float logits' largest, the caches)`."""
    plan = GraphPlan(model)
    prompt = keras.ops.convert_to_tensor(PROMPTS, "int32")
    pads = keras.ops.convert_to_tensor([1, 0], "int32")
    length, runs, worst = 4 + steps, {}, 0.0
    for kind in (None, dtype):
        adapter = ModelAdapter(plan, length, cache_dtype=kind)
        prefill = traced(lambda *a, m=adapter.prefill: m(*a, [], length, Calls()))
        step = traced(lambda *a, m=adapter.step: m(*a, Calls()))
        runs[kind] = (step, *prefill(prompt, pads))
    for index in range(4, length):
        logits = {kind: to_numpy(run[1]) for kind, run in runs.items()}
        error = np.abs(logits[dtype] - logits[None]).max()
        worst = max(worst, error / np.abs(logits[None]).max())
        token = keras.ops.convert_to_tensor(logits[None].argmax(-1), "int32")
        at = keras.ops.convert_to_tensor(index, "int32")
        for kind, (step, _, state) in list(runs.items()):
            runs[kind] = (step, *step(token, at, state))
    return worst, runs[dtype][2]["caches"]


def traced(function):
    """On JAX, `function` compiled whole: eagerly each op compiles alone,
    which was most of these tests' time (the numbers are the same). Each
    trace binds its own sublayer calls (`Calls`: they memoize tensors)."""
    if keras.config.backend() != "jax":
        return function
    import jax

    return jax.jit(function)


def test_int8_logits_stay_within_2_percent_of_the_float_caches():
    """A key or value is off by at most half a step of 1/127 of its largest
    element: the logits stay within 2% of the float caches' largest (not
    equal: int8 ran). Whether a greedy token flips depends on the model's
    margins (`benchmarks/int8_cache.py` measures it on a trained model)."""
    model = decoder_only_model(VOCAB, 32, num_key_value_heads=2)
    worst, caches = lockstep(model, "int8", steps=3)
    assert 0 < worst <= 2e-2
    assert all(isinstance(cache, Int8Cache) for cache in caches)


def test_a_windowed_decoder_rolls_int8_slots_past_its_window():
    """A window of 3: its rolling cache's slots are int8 (the other
    decoder's dense cache too), and the logits stay close past the window."""
    model = llama_model(VOCAB, 16, windows=(3, None), tied=False)
    worst, (windowed, full) = lockstep(model, "int8", steps=3)
    assert 0 < worst <= 2e-2
    assert isinstance(windowed, RollingCache) and windowed.length == 3
    assert isinstance(windowed.slots, Int8Cache) and isinstance(full, Int8Cache)


def test_a_float_cache_dtype_keeps_the_caches_in_it():
    """`cache_dtype="float16"` for a float32 model: float16 caches, read
    back in float32, the logits close to the float32 caches'."""
    model = decoder_only_model(VOCAB, 32)
    worst, caches = lockstep(model, "float16", steps=3)
    assert worst <= 1e-2
    assert all(isinstance(cache, DenseCache) for cache in caches)
    assert all("float16" in str(cache.kv.dtype) for cache in caches)


def test_generate_decodes_with_the_cache_dtype(monkeypatch):
    """`generate` hands its `cache_dtype` to the adapter whose caches it
    decodes with (above)."""
    dtypes, adapter = [], ModelAdapter.__init__

    def spy(self, *arguments, cache_dtype=None, **kwargs):
        dtypes.append(cache_dtype)
        adapter(self, *arguments, cache_dtype=cache_dtype, **kwargs)

    monkeypatch.setattr(ModelAdapter, "__init__", spy)
    tokens = generate(decoder_only_model(VOCAB, 32), PROMPTS, 8, cache_dtype="int8")
    assert dtypes == ["int8"] and (tokens[:, :4] == PROMPTS).all()


def test_functions_keep_their_own_caches():
    def prefill(ids, length):
        return np.zeros((2, VOCAB), "float32"), {}

    with pytest.raises(ValueError, match="cache_dtype='int8'.*functions"):
        generate((prefill, prefill), PROMPTS, 6, cache_dtype="int8")
