"""`generate(cache_dtype=...)`: the self-attention caches in int8
(`keras_attn.cache.Int8Cache`) or another float dtype, with the float
cache's tokens; `benchmarks/int8_cache.py` measures memory, agreement on a
trained model and speed."""

import keras
import numpy as np
import pytest

from keras_attn.cache import Int8Cache
from keras_attn.generation import generate
from keras_attn.generation.adapter import ModelAdapter
from keras_attn.generation.graph import GraphPlan
from keras_attn.layers._lean_call import SublayerCalls
from tests.helpers.backend import to_numpy
from tests.helpers.builders import GENERATION_VOCAB as VOCAB
from tests.helpers.builders import decoder_only_model, llama_model

PROMPTS = np.array([[0, 3, 4, 5], [6, 7, 8, 9]])


def test_int8_logits_stay_within_2_percent_of_the_float_caches():
    """The float and the int8 caches run in lockstep on the same tokens
    (teacher-forced on the float path's argmax): every step's logits within
    2% of the float ones' largest (a key or value is off by at most half a
    step of 1/127 of its largest element). Whether a greedy token flips
    depends on the model's margins: `benchmarks/int8_cache.py` measures the
    agreement on a trained model."""
    plan = GraphPlan(decoder_only_model(VOCAB, 32, num_key_value_heads=2))
    prompt = keras.ops.convert_to_tensor(PROMPTS, "int32")
    pads = keras.ops.convert_to_tensor([1, 0], "int32")
    runs = {}
    for dtype in (None, "int8"):
        adapter, calls = ModelAdapter(plan, 12, cache_dtype=dtype), SublayerCalls()
        runs[dtype] = (adapter, calls, *adapter.prefill(prompt, pads, [], 12, calls))
    for index in range(4, 12):
        logits = {dtype: to_numpy(run[2]) for dtype, run in runs.items()}
        error = np.abs(logits["int8"] - logits[None]).max()
        assert 0 < error <= 2e-2 * np.abs(logits[None]).max(), (index, error)
        token = keras.ops.convert_to_tensor(logits[None].argmax(-1), "int32")
        at = keras.ops.convert_to_tensor(index, "int32")
        for dtype, (adapter, calls, _, state) in list(runs.items()):
            runs[dtype] = (adapter, calls, *adapter.step(token, at, state, calls))


def test_rolling_int8_caches_past_the_window():
    """A windowed decoder keeps a rolling cache of int8 slots, and decodes
    past its window as with float slots."""
    model = llama_model(VOCAB, 16, windows=(3, None), tied=False)
    np.testing.assert_array_equal(
        generate(model, PROMPTS, 24, cache_dtype="int8"), generate(model, PROMPTS, 24)
    )


def test_the_adapter_makes_int8_caches_of_a_quarter_of_the_memory():
    """Each decoder's cache is an `Int8Cache`: `head_dim + 4` bytes a key or
    value vector where float32 takes `4 * head_dim`."""
    plan = GraphPlan(decoder_only_model(VOCAB, 32))
    caches = {}
    for dtype in (None, "int8"):
        adapter = ModelAdapter(plan, 8, cache_dtype=dtype)
        prompt = keras.ops.convert_to_tensor(PROMPTS, "int32")
        pads = keras.ops.convert_to_tensor([1, 0], "int32")
        _, state = adapter.prefill(prompt, pads, [], 8, SublayerCalls())
        caches[dtype] = state["caches"]
    assert all(isinstance(cache, Int8Cache) for cache in caches["int8"])
    head_dim = caches["int8"][0].kv.shape[-1]
    ratio = sum(c.nbytes for c in caches["int8"]) / sum(c.nbytes for c in caches[None])
    assert ratio == pytest.approx((head_dim + 4) / (4 * head_dim))


def test_a_float_cache_dtype_keeps_the_caches_in_it():
    """`cache_dtype="float16"` for a float32 model: its tokens stay those of
    the float32 caches here."""
    model = decoder_only_model(VOCAB, 32)
    np.testing.assert_array_equal(
        generate(model, PROMPTS, 12, cache_dtype="float16"),
        generate(model, PROMPTS, 12),
    )


def test_functions_keep_their_own_caches():
    def prefill(ids, length):
        return np.zeros((2, VOCAB), "float32"), {}

    with pytest.raises(ValueError, match="cache_dtype='int8'.*functions"):
        generate((prefill, prefill), PROMPTS, 6, cache_dtype="int8")
