"""MultiHeadAttention in every configuration, under CUDA's rules for torch's
SDPA (`cuda_sdpa`: a mask never with `is_causal`, `enable_gqa` only in half
precision), on a CPU: each call is one a GPU accepts, and the numbers are the
explicit path's."""

import keras
import numpy as np
import pytest

import keras_attn
from tests.helpers.backend import BACKEND

pytestmark = pytest.mark.skipif(BACKEND != "torch", reason="PyTorch's SDPA rules")

B, T, S, WIDTH = 2, 5, 7, 16
PADDING = np.array([[1] * S, [1] * (S - 3) + [0] * 3], bool)

# name: (layer arguments, call arguments: the query `x`, a `source`, ...)
CONFIGURATIONS = {
    "causal": ({}, dict(use_causal_mask=True)),
    "padding": ({}, dict(value="source", value_mask=PADDING)),
    "causal with padding": ({}, dict(use_causal_mask=True, query_mask=PADDING[:, :T])),
    "ALiBi, causal": ({}, dict(use_causal_mask=True, attention_bias="alibi")),
    "ALiBi, padding": ({}, dict(attention_bias="alibi", query_mask=PADDING[:, :T])),
    "sliding window, causal": (dict(sliding_window=2), dict(use_causal_mask=True)),
    "grouped heads, causal": (dict(num_key_value_heads=2), dict(use_causal_mask=True)),
    "one key/value head": (dict(num_key_value_heads=1), {}),
    "cross-attention": (
        dict(num_key_value_heads=2),
        dict(value="source", value_mask=PADDING),
    ),
    "cache decoding": (dict(num_key_value_heads=2), dict(cache="cache")),
}
TOLERANCE = {"float32": 1e-5, "bfloat16": 3e-2}


def call_arguments(kwargs, x, source, layer):
    resolved = dict(kwargs)
    if resolved.get("value") == "source":
        resolved["value"] = source
    if resolved.get("attention_bias") == "alibi":
        resolved["attention_bias"] = keras_attn.ops.alibi_bias(4, T, T)
    if resolved.get("cache") == "cache":
        resolved.update(
            cache=layer.get_empty_cache(B, T + 2),
            cache_update_index=1,
            use_causal_mask=True,
        )
    return resolved


def run(layer, x, source, kwargs):
    outputs = layer(x, **call_arguments(kwargs, x, source, layer))
    output = outputs[0] if isinstance(outputs, tuple) else outputs
    return keras.ops.convert_to_numpy(keras.ops.cast(output, "float32"))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", CONFIGURATIONS)
def test_every_configuration_is_one_cuda_accepts(cuda_sdpa, name, dtype):
    layer_kwargs, kwargs = CONFIGURATIONS[name]
    rng = np.random.default_rng(0)
    x = rng.normal(size=(B, T, WIDTH)).astype("float32")
    source = rng.normal(size=(B, S, WIDTH)).astype("float32")
    arguments = dict(num_heads=4, key_dim=4, dtype=dtype, **layer_kwargs)
    explicit = keras_attn.MultiHeadAttention(flash_attention=False, **arguments)
    fused = keras_attn.MultiHeadAttention(**arguments)
    for layer in (explicit, fused):
        layer.build(x.shape, source.shape if "value" in kwargs else None)
    fused.set_weights(explicit.get_weights())
    expected = run(explicit, x, source, kwargs)
    assert not cuda_sdpa  # the explicit path calls no kernel
    np.testing.assert_allclose(
        run(fused, x, source, kwargs),
        expected,
        rtol=TOLERANCE[dtype],
        atol=TOLERANCE[dtype],
    )
    assert len(cuda_sdpa) == 1
