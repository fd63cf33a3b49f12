"""Bad input, `.keras` loading and numerical safety, systematically (issue #7).

1. A table-driven battery: every constructor and call argument of the four
   layers, of `keras_attn.generation.generate` and of
   `keras_attn.distribution.get_layout_map`, given a wrong type, an
   out-of-range value, a wrong rank or a wrong shape, raises a `ValueError` or
   `TypeError` that names the argument and what was received, before any state
   changes.
2. Loading: configs a newer or older keras_attn wrote, damaged files, exact
   weights after loading.
3. Numerical safety: fully masked rows, large activations in mixed precision,
   length 1 and batch 1, different query and key lengths, 4096 tokens on CPU,
   unknown batch and length, `jit_compile`.
"""

import json
import re
import resource
import zipfile

import keras
import numpy as np
import pytest

import keras_attn
from keras_attn import (
    MultiHeadAttention,
    SinusoidalEmbedding,
    TransformerDecoder,
    TransformerEncoder,
    generation,
)
from keras_attn.distribution import get_layout_map
from tests.helpers import BACKEND, random_floats, to_numpy
from tests.layers.test_multi_head_attention import numpy_reference
from tests.test_ops import reference_encoding
from tests.test_properties import masked_reference

# Key length 1 is a case like any other here.
pytestmark = pytest.mark.filterwarnings("ignore:You are using a softmax over axis -1")

# Distinct sizes, so that a swapped axis cannot pass: batch, query/target
# length, key/source length, width, value/source width.
B, T, S, W, VW = 2, 3, 5, 8, 6
VOCAB = 11


def ints(*shape, high=VOCAB):
    return np.random.default_rng(0).integers(1, high, shape).astype("int32")


def bools(*shape):
    return np.ones(shape, bool)


def snapshot(layer):
    return [(w.path, to_numpy(w).copy()) for w in layer.weights]


def assert_unchanged(before, after):
    assert [path for path, _ in after] == [path for path, _ in before]
    for (path, old), (_, new) in zip(before, after, strict=True):
        np.testing.assert_array_equal(old, new, err_msg=path)


# --- 1. The battery: constructors ---------------------------------------------

REQUIRED = {
    MultiHeadAttention: {"num_heads": 2},
    TransformerEncoder: {"intermediate_dim": 8, "num_heads": 2},
    TransformerDecoder: {"intermediate_dim": 8, "num_heads": 2},
    SinusoidalEmbedding: {},
}


def init_row(cls, kwargs, error, match):
    name = "-".join(f"{k}={v!r}" for k, v in kwargs.items())
    return pytest.param(cls, kwargs, error, match, id=f"{cls.__name__}-{name}")


def positive_int_rows(cls, name, **extra):
    return [
        init_row(cls, {name: 0, **extra}, ValueError, rf"`{name}`.*{name}=0\b"),
        init_row(cls, {name: -3, **extra}, ValueError, rf"{name}=-3\b"),
        init_row(cls, {name: 2.5, **extra}, TypeError, rf"{name}=2.5 of type float"),
        init_row(cls, {name: "4", **extra}, TypeError, rf"{name}='4' of type str"),
        init_row(cls, {name: True, **extra}, TypeError, rf"{name}=True of type bool"),
    ]


def rate_rows(cls):
    return [
        init_row(cls, {"dropout": -0.1}, ValueError, r"\[0, 1\).*dropout=-0.1"),
        init_row(cls, {"dropout": 1.0}, ValueError, r"\[0, 1\).*dropout=1.0"),
        init_row(cls, {"dropout": 1.5}, ValueError, r"dropout=1.5"),
        init_row(cls, {"dropout": "0.1"}, TypeError, r"dropout='0.1' of type str"),
        init_row(cls, {"dropout": None}, TypeError, r"dropout=None of type NoneType"),
    ]


def bool_rows(cls, name, allow_none=False):
    rows = [
        init_row(cls, {name: "yes"}, TypeError, rf"`{name}`.*{name}='yes' of type str"),
        init_row(cls, {name: 1}, TypeError, rf"{name}=1 of type int"),
    ]
    if not allow_none:
        rows.append(init_row(cls, {name: None}, TypeError, rf"{name}=None"))
    return rows


def keras_object_rows(cls, name):
    return [
        init_row(cls, {name: "nope"}, ValueError, rf"`{name}` must be.*{name}='nope'"),
        init_row(cls, {name: 3}, TypeError, rf"`{name}` must be.*{name}=3\."),
    ]


def common_rows(cls):
    """Arguments every layer has (or that `**kwargs` must reject)."""
    unknown = r"Unrecognized keyword arguments passed to \w+: \{'rope_theta': 1\}"
    return [init_row(cls, {"rope_theta": 1}, ValueError, unknown)]


def attention_rows(cls):
    """Arguments of MultiHeadAttention and of both blocks."""
    divide = r"`num_key_value_heads` must divide.*num_heads=4, num_key_value_heads=3"
    return [
        *positive_int_rows(cls, "num_heads"),
        init_row(cls, {"num_heads": None}, TypeError, r"num_heads=None"),
        *positive_int_rows(cls, "key_dim"),
        *positive_int_rows(cls, "num_key_value_heads", num_heads=4),
        init_row(cls, {"num_heads": 4, "num_key_value_heads": 3}, ValueError, divide),
        *rate_rows(cls),
        *bool_rows(cls, "flash_attention", allow_none=True),
        *keras_object_rows(cls, "kernel_initializer"),
        *keras_object_rows(cls, "bias_initializer"),
        *common_rows(cls),
    ]


def block_rows(cls):
    return [
        *attention_rows(cls),
        *positive_int_rows(cls, "intermediate_dim"),
        *keras_object_rows(cls, "activation"),
        init_row(cls, {"layer_norm_epsilon": 0}, ValueError, r"layer_norm_epsilon=0"),
        init_row(cls, {"layer_norm_epsilon": -1e-5}, ValueError, r"epsilon=-1e-05"),
        init_row(cls, {"layer_norm_epsilon": "1e-5"}, TypeError, r"epsilon='1e-5'"),
        *bool_rows(cls, "normalize_first"),
    ]


def embedding_rows():
    cls = SinusoidalEmbedding
    ids = {"vocabulary_size": 10}
    needs_vocabulary = r"`mask_zero=True` needs `vocabulary_size`.*mask_zero=True"
    return [
        *positive_int_rows(cls, "embedding_dim"),
        *positive_int_rows(cls, "vocabulary_size", embedding_dim=4),
        init_row(cls, ids, ValueError, r"`embedding_dim` is required.*=None"),
        init_row(cls, {"max_wavelength": 0}, ValueError, r"max_wavelength=0\b"),
        init_row(cls, {"max_wavelength": -1.0}, ValueError, r"max_wavelength=-1.0"),
        init_row(cls, {"max_wavelength": float("nan")}, ValueError, r"=nan"),
        init_row(cls, {"max_wavelength": "big"}, TypeError, r"max_wavelength='big'"),
        init_row(cls, {"mask_zero": True}, ValueError, needs_vocabulary),
        *bool_rows(cls, "mask_zero"),
        *bool_rows(cls, "scale_embeddings"),
        *keras_object_rows(cls, "embeddings_initializer"),
        *common_rows(cls),
    ]


MHA_ONLY_ROWS = [
    *positive_int_rows(MultiHeadAttention, "value_dim"),
    *positive_int_rows(MultiHeadAttention, "output_dim"),
    *bool_rows(MultiHeadAttention, "use_bias"),
    *keras_object_rows(MultiHeadAttention, "kernel_regularizer"),
    *keras_object_rows(MultiHeadAttention, "bias_regularizer"),
    *keras_object_rows(MultiHeadAttention, "kernel_constraint"),
    *keras_object_rows(MultiHeadAttention, "bias_constraint"),
    init_row(MultiHeadAttention, {"seed": -1}, ValueError, r"`seed`.*seed=-1\b"),
    init_row(MultiHeadAttention, {"seed": 1.5}, TypeError, r"seed=1.5 of type float"),
    init_row(MultiHeadAttention, {"seed": "3"}, TypeError, r"seed='3' of type str"),
]

CONSTRUCTOR_ROWS = [
    *attention_rows(MultiHeadAttention),
    *MHA_ONLY_ROWS,
    *block_rows(TransformerEncoder),
    *block_rows(TransformerDecoder),
    *embedding_rows(),
]


@pytest.mark.parametrize("cls, kwargs, error, match", CONSTRUCTOR_ROWS)
def test_bad_constructor_argument(cls, kwargs, error, match):
    with pytest.raises(error, match=match) as info:
        cls(**{**REQUIRED[cls], **kwargs})
    assert type(info.value) is error  # not a subclass from deep inside


# --- 1. The battery: calls ----------------------------------------------------
# Each target returns a built layer (or an unbuilt one, for errors in `build`)
# and call arguments that work; a row overrides some of them.


def built(layer, *shapes):
    layer.build(*shapes)
    return layer


def mha_cross():
    layer = built(MultiHeadAttention(num_heads=2, key_dim=4), (B, T, W), (B, S, VW))
    return layer, {"query": random_floats(B, T, W), "value": random_floats(B, S, VW)}


def mha_cached():
    """Grouped-query self-attention, one step with a cache `(B, 2, 2, 6, 2)`."""
    layer = built(MultiHeadAttention(num_heads=4, num_key_value_heads=2), (B, T, W))
    cache = np.zeros((B, 2, 2, 6, 2), "float32")
    return layer, {
        "query": random_floats(B, T, W),
        "cache": cache,
        "cache_update_index": 0,
    }


def encoder():
    layer = built(TransformerEncoder(16, 2), (B, T, W))
    return layer, {"inputs": random_floats(B, T, W)}


def decoder():
    layer = built(TransformerDecoder(16, 2), (B, T, W), (B, S, VW))
    return layer, {
        "decoder_sequence": random_floats(B, T, W),
        "encoder_sequence": random_floats(B, S, VW),
    }


def decoder_cached():
    """One step with a self-attention cache `(B, 2, 2, 6, 4)`."""
    layer, kwargs = decoder()
    cache = np.zeros((B, 2, 2, 6, 4), "float32")
    return layer, {
        **kwargs,
        "self_attention_cache": cache,
        "self_attention_cache_update_index": 0,
    }


def decoder_only():
    layer = built(TransformerDecoder(16, 2), (B, T, W))
    return layer, {"decoder_sequence": random_floats(B, T, W)}


def token_embedding():
    layer = built(SinusoidalEmbedding(W, VOCAB), (B, T))
    return layer, {"inputs": ints(B, T)}


def float_embedding():
    layer = built(SinusoidalEmbedding(), (B, T, W))
    return layer, {"inputs": random_floats(B, T, W)}


TARGETS = (
    mha_cross,
    mha_cached,
    encoder,
    decoder,
    decoder_cached,
    decoder_only,
    token_embedding,
    float_embedding,
)


def unbuilt(cls, **kwargs):
    def target():
        return cls(**kwargs), {}

    target.__name__ = f"unbuilt_{cls.__name__}"
    return target


def call_row(target, kwargs, error, match):
    name = "-".join(kwargs) or "baseline"
    return pytest.param(target, kwargs, error, match, id=f"{target.__name__}-{name}")


def rank_row(target, name, array, description=r"\(batch, length, width\)"):
    """`array` has the right dtype and the wrong rank."""
    shape = re.escape(str(array.shape))
    match = rf"`{name}` must have rank \d, {description}.*{name}.shape={shape}"
    return call_row(target, {name: array}, ValueError, match)


def dtype_row(target, name, array):
    match = rf"`{name}` must be a float tensor.*{name}.dtype={array.dtype}"
    return call_row(target, {name: array}, TypeError, match)


def width_row(target, name, array, built_width):
    shape = re.escape(str(array.shape))
    match = rf"`{name}` must have the width.*{name}.shape={shape}, built width="
    return call_row(target, {name: array}, ValueError, match + str(built_width))


def mask_rows(target, name, good_shape, bad_shapes=None):
    """By default one axis too many, one too few, and one key too many."""
    if bad_shapes is None:
        longer = good_shape[:-1] + (good_shape[-1] + 1,)
        bad_shapes = (good_shape + (1,), good_shape[1:], longer)
    return [
        call_row(
            target,
            {name: bools(*shape)},
            ValueError,
            rf"`{name}`.*Received: " + re.escape(f"{name}.shape={shape}"),
        )
        for shape in bad_shapes
    ]


def flag_rows(target, *names):
    return [
        call_row(target, {name: "yes"}, TypeError, rf"`{name}` must be a bool.*'yes'")
        for name in names
    ]


def cache_rows(target, name, index_name, shape):
    """Caches of the wrong rank, shape or dtype; indices of the wrong type or range.

    `target` makes a call with a good cache of `shape` at index 0.
    """
    cache = np.zeros(shape, "float32")
    one_head = cache[:, :, :1]
    room = rf"`{index_name}` must leave room.*Received: {index_name}="
    return [
        call_row(
            target, {name: cache[..., 0]}, ValueError, rf"`{name}` must have rank 5"
        ),
        call_row(
            target,
            {name: one_head},
            ValueError,
            rf"`{name}` does not match.*" + re.escape(f"{name}.shape={one_head.shape}"),
        ),
        call_row(
            target,
            {name: np.zeros((B + 1, *shape[1:]), "float32")},
            ValueError,
            rf"{name}.shape=\({B + 1}, ",
        ),
        call_row(
            target,
            {name: cache.astype("int32")},
            TypeError,
            rf"`{name}` must be a float tensor.*{name}.dtype=int32",
        ),
        call_row(target, {index_name: -1}, ValueError, room + "-1"),
        call_row(target, {index_name: shape[3] - T + 1}, ValueError, room + "4"),
        call_row(target, {index_name: 1.5}, TypeError, rf"{index_name}=1.5 of type"),
        call_row(
            target,
            {index_name: np.array(1.0, "float32")},
            TypeError,
            rf"{index_name}.dtype=float32",
        ),
    ]


CROSS_ONLY = r"needs cross-attention, and this decoder-only block has none"
TOKEN_IDS = r"\(batch, length\) token ids"

CALL_ROWS = [
    *(call_row(target, {}, None, None) for target in TARGETS),
    # MultiHeadAttention.
    rank_row(mha_cross, "query", random_floats(B, W)),
    rank_row(mha_cross, "query", random_floats(B, T, W, 1)),
    rank_row(mha_cross, "value", random_floats(B, VW)),
    rank_row(mha_cross, "key", random_floats(B, S, VW, 1)),
    dtype_row(mha_cross, "query", ints(B, T, W)),
    dtype_row(mha_cross, "value", ints(B, S, VW)),
    dtype_row(mha_cross, "key", ints(B, S, VW)),
    width_row(mha_cross, "query", random_floats(B, T, W + 2), W),
    width_row(mha_cross, "value", random_floats(B, S, VW + 1), VW),
    width_row(mha_cross, "key", random_floats(B, S, VW + 1), VW),
    call_row(
        mha_cross,
        {"key": random_floats(B, S + 1, VW)},
        ValueError,
        r"`key` and `value` must have the same length.*key.shape=\(2, 6, 6\)",
    ),
    *mask_rows(mha_cross, "query_mask", (B, T)),
    *mask_rows(mha_cross, "mask", (B, T)),
    *mask_rows(mha_cross, "value_mask", (B, S)),
    *mask_rows(mha_cross, "key_mask", (B, S)),
    *mask_rows(
        mha_cross,
        "attention_mask",
        (B, T, S),
        [(S,), (B, 1, 1, T, S), (B, T + 1, S), (B, T, S + 1), (B, 3, T, S)],
    ),
    *flag_rows(mha_cross, "use_causal_mask", "return_attention_scores"),
    call_row(
        mha_cached,
        {"cache": None},
        ValueError,
        "`cache_update_index` needs a `cache`.*cache=None, cache_update_index=0",
    ),
    *cache_rows(mha_cached, "cache", "cache_update_index", (B, 2, 2, 6, 2)),
    # SinusoidalEmbedding.
    rank_row(token_embedding, "inputs", ints(B, T, 1), TOKEN_IDS),
    rank_row(token_embedding, "inputs", ints(B), TOKEN_IDS),
    call_row(
        token_embedding,
        {"inputs": random_floats(B, T)},
        TypeError,
        r"integer token ids.*inputs.dtype=float32",
    ),
    call_row(token_embedding, {"start_index": 1.5}, TypeError, "start_index=1.5"),
    call_row(token_embedding, {"start_index": "0"}, TypeError, "start_index='0'"),
    call_row(
        token_embedding,
        {"start_index": np.array([1.0, 2.0], "float32")},
        TypeError,
        "start_index.dtype=float32",
    ),
    call_row(
        token_embedding,
        {"start_index": np.zeros((B, 1), "int32")},
        ValueError,
        r"start_index.shape=\(2, 1\)",
    ),
    call_row(
        token_embedding,
        {"start_index": np.zeros((B + 1,), "int32")},
        ValueError,
        r"start_index.shape=\(3,\), batch=2",
    ),
    rank_row(float_embedding, "inputs", random_floats(B, T), r"\(batch, length, "),
    dtype_row(float_embedding, "inputs", ints(B, T, W)),
    width_row(float_embedding, "inputs", random_floats(B, T, W - 1), W),
    # TransformerEncoder.
    rank_row(encoder, "inputs", random_floats(B, W)),
    rank_row(encoder, "inputs", random_floats(B, T, W, 1)),
    dtype_row(encoder, "inputs", ints(B, T, W)),
    width_row(encoder, "inputs", random_floats(B, T, W + 4), W),
    *mask_rows(encoder, "padding_mask", (B, T)),
    *mask_rows(encoder, "attention_mask", (B, T, T)),
    *flag_rows(encoder, "return_attention_scores"),
    # TransformerDecoder.
    rank_row(decoder, "decoder_sequence", random_floats(B, W)),
    rank_row(decoder, "encoder_sequence", random_floats(B, VW)),
    dtype_row(decoder, "decoder_sequence", ints(B, T, W)),
    dtype_row(decoder, "encoder_sequence", ints(B, S, VW)),
    width_row(decoder, "decoder_sequence", random_floats(B, T, W + 2), W),
    width_row(decoder, "encoder_sequence", random_floats(B, S, VW + 1), VW),
    call_row(
        decoder,
        {"encoder_sequence": None},
        ValueError,
        r"built with cross-attention.*needs one.*Received: encoder_sequence=None",
    ),
    *mask_rows(decoder, "decoder_padding_mask", (B, T)),
    *mask_rows(decoder, "decoder_attention_mask", (B, T, T)),
    *mask_rows(decoder, "encoder_padding_mask", (B, S)),
    *mask_rows(decoder, "encoder_attention_mask", (B, T, S)),
    *flag_rows(decoder, "use_causal_mask", "return_attention_scores"),
    call_row(
        decoder,
        {"cross_attention_cache": np.zeros((B, 2, 2, S, 3), "float32")},
        ValueError,
        r"`cross_attention_cache` does not match.*shape=\(2, 2, 2, 5, 3\)",
    ),
    call_row(
        decoder,
        {"cross_attention_cache": np.zeros((B, 2, 2, S, 4), "int32")},
        TypeError,
        r"cross_attention_cache.dtype=int32",
    ),
    call_row(
        decoder_cached,
        {"self_attention_cache_update_index": None},
        ValueError,
        r"go together.*self_attention_cache_update_index=None",
    ),
    call_row(
        decoder_cached,
        {"self_attention_cache": None},
        ValueError,
        r"go together.*self_attention_cache=None",
    ),
    *cache_rows(
        decoder_cached,
        "self_attention_cache",
        "self_attention_cache_update_index",
        (B, 2, 2, 6, 4),
    ),
    call_row(
        decoder_only,
        {"encoder_sequence": random_floats(B, S, VW)},
        ValueError,
        r"built as a decoder-only block.*encoder_sequence.shape=\(2, 5, 6\)",
    ),
    *(
        call_row(decoder_only, {name: value}, ValueError, rf"`{name}` {CROSS_ONLY}")
        for name, value in (
            ("encoder_padding_mask", bools(B, S)),
            ("encoder_attention_mask", bools(B, T, S)),
            ("cross_attention_cache", np.zeros((B, 2, S, 2, 4), "float32")),
        )
    ),
    # Errors in `build`: no weight may be created.
    call_row(
        unbuilt(MultiHeadAttention, num_heads=3),
        {"query": random_floats(B, T, W)},
        ValueError,
        r"`num_heads` must divide.*num_heads=3, query width=8",
    ),
    call_row(
        unbuilt(MultiHeadAttention, num_heads=2),
        {"query": random_floats(B, W)},
        ValueError,
        r"`query` must have rank 3.*query.shape=\(2, 8\)",
    ),
    call_row(
        unbuilt(TransformerEncoder, intermediate_dim=8, num_heads=3),
        {"inputs": random_floats(B, T, W)},
        ValueError,
        r"`num_heads` must divide.*num_heads=3, input width=8",
    ),
    call_row(
        unbuilt(TransformerDecoder, intermediate_dim=8, num_heads=3),
        {"decoder_sequence": random_floats(B, T, W)},
        ValueError,
        r"`num_heads` must divide.*num_heads=3, input width=8",
    ),
    call_row(
        unbuilt(SinusoidalEmbedding, embedding_dim=W + 1),
        {"inputs": random_floats(B, T, W)},
        ValueError,
        r"`embedding_dim` must equal.*embedding_dim=9, input width=8",
    ),
    call_row(
        unbuilt(SinusoidalEmbedding, embedding_dim=W, vocabulary_size=VOCAB),
        {"inputs": ints(B, T, 1)},
        ValueError,
        r"`inputs` must have rank 2.*inputs.shape=\(2, 3, 1\)",
    ),
]


@pytest.mark.parametrize("target, kwargs, error, match", CALL_ROWS)
def test_bad_call_argument_changes_nothing(target, kwargs, error, match):
    layer, base = target()
    before, was_built = snapshot(layer), layer.built
    if error is None:  # The baseline the other rows break: it works.
        layer(**{**base, **kwargs})
        return
    with pytest.raises(error, match=match):
        layer(**{**base, **kwargs})
    assert layer.built == was_built
    assert_unchanged(before, snapshot(layer))


# --- 1. The battery: generate and get_layout_map ------------------------------


@pytest.fixture(scope="module")
def decoder_only_model():
    keras.utils.set_random_seed(0)
    ids = keras.Input((None,), dtype="int32", name="ids")
    x = SinusoidalEmbedding(16, VOCAB, mask_zero=True)(ids)
    x = TransformerDecoder(32, 2)(x)
    return keras.Model(ids, keras.layers.Dense(VOCAB)(x))


def generate_row(kwargs, error, match):
    def describe(value):
        if isinstance(value, np.ndarray):
            return f"array{value.shape}"
        return (
            repr(value) if np.isscalar(value) or value is None else type(value).__name__
        )

    name = "-".join(f"{k}={describe(v)}" for k, v in kwargs.items())
    return pytest.param(kwargs, error, match, id=name)


PROMPT = np.array([[3, 4, 5], [6, 7, 8]], "int32")

GENERATE_ROWS = [
    generate_row({"model": "decoder"}, ValueError, r"functional keras.Model.*Trans"),
    generate_row({"model": None}, ValueError, r"Received: NoneType"),
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
        rf"token ids must be in \[0, vocabulary_size={VOCAB}\).*from 14 to 19",
    ),
    generate_row({"inputs": -PROMPT}, ValueError, r"from -8 to -3"),
    generate_row(
        {"inputs": np.array([[3, 4], [0, 0]])}, ValueError, r"empty rows: \[1\]"
    ),
    generate_row({"inputs": np.array([[3, 0, 4]])}, ValueError, r"on one side"),
    generate_row(
        {"inputs": np.array([[0, 3, 4], [3, 4, 0]])}, ValueError, r"not a mix"
    ),
    generate_row({"inputs": [PROMPT, PROMPT]}, ValueError, r"1 inputs.*Received 2"),
    generate_row({"inputs": {"foo": PROMPT}}, ValueError, r"\['ids'\].*\['foo'\]"),
    generate_row({"max_length": 0}, ValueError, r"max_length=0"),
    generate_row({"max_length": 4.0}, TypeError, r"max_length=4.0 of type float"),
    generate_row({"max_length": 2}, ValueError, r"max_length=2, prompt length=3"),
    generate_row({"method": "topk"}, ValueError, r"`method` must be one of.*'topk'"),
    generate_row({"temperature": 0}, ValueError, r"temperature=0"),
    generate_row({"temperature": -1.0}, ValueError, r"temperature=-1.0"),
    generate_row({"temperature": "hot"}, ValueError, r"temperature='hot'"),
    generate_row({"top_k": 0}, ValueError, r"top_k=0"),
    generate_row({"top_k": 1.5}, TypeError, r"top_k=1.5 of type float"),
    generate_row({"top_p": 0}, ValueError, r"top_p=0"),
    generate_row({"top_p": 1.5}, ValueError, r"top_p=1.5"),
    generate_row({"top_p": "a"}, ValueError, r"top_p='a'"),
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
]


@pytest.mark.parametrize("kwargs, error, match", GENERATE_ROWS)
def test_bad_generate_argument_changes_nothing(
    decoder_only_model, kwargs, error, match
):
    model = decoder_only_model
    if kwargs.get("model") == "decoder":
        kwargs = {**kwargs, "model": model.layers[2]}
    before = [to_numpy(w).copy() for w in model.weights]
    compiled = dict(generation._GENERATORS.get(model, {}))
    call = {"model": model, "inputs": PROMPT, "max_length": 6, **kwargs}
    with pytest.raises(error, match=match):
        generation.generate(**call)
    for old, new in zip(before, model.weights, strict=True):
        np.testing.assert_array_equal(old, to_numpy(new))
    assert dict(generation._GENERATORS.get(model, {})) == compiled


def mesh(model_axis):
    devices = [f"cpu:{i}" for i in range(model_axis)]
    return keras.distribution.DeviceMesh(
        (1, model_axis), ["batch", "model"], devices=devices
    )


def two_head_encoder(build=True):
    layer = TransformerEncoder(16, 2, name="encoder")
    if build:
        layer.build((1, 3, 8))
    return layer


LAYOUT_ROWS = [
    pytest.param(
        {"device_mesh": (1, 2)},
        TypeError,
        r"`device_mesh` must be.*device_mesh=\(1, 2\) of type tuple",
        id="device_mesh",
    ),
    pytest.param(
        {"model_parallel_dim_name": "tensor"},
        ValueError,
        r"model_parallel_dim_name='tensor'",
        id="model_parallel_dim_name",
    ),
    pytest.param(
        {"model_parallel_dim_name": 3},
        ValueError,
        r"model_parallel_dim_name=3",
        id="model_parallel_dim_name-type",
    ),
    pytest.param(
        {"data_parallel_dim_name": "data"},
        ValueError,
        r"data_parallel_dim_name='data'",
        id="data_parallel_dim_name",
    ),
    pytest.param(
        {"data_parallel_dim_name": "model"},
        ValueError,
        r"data_parallel_dim_name='model'",
        id="data_parallel_dim_name-same-as-model",
    ),
    pytest.param(
        {"model": lambda: two_head_encoder(build=False)},
        ValueError,
        r"`model` must be built.*'encoder', not built",
        id="model-unbuilt",
    ),
    pytest.param(
        {"model": two_head_encoder, "device_mesh": lambda: mesh(4)},
        ValueError,
        r"\(size 4\) must divide the heads.*query_kernel' of shape \(8, 2, 4\)",
        id="model-indivisible",
    ),
]


@pytest.mark.parametrize("kwargs, error, match", LAYOUT_ROWS)
def test_bad_layout_map_argument(kwargs, error, match):
    kwargs = {k: v() if callable(v) else v for k, v in kwargs.items()}
    with pytest.raises(error, match=match):
        get_layout_map(**{"device_mesh": mesh(2), **kwargs})


# --- 2. Loading ---------------------------------------------------------------


def all_layers_model():
    """Every keras_attn layer, with Keras masks from `mask_zero` flowing through."""
    source = keras.Input((None,), dtype="int32", name="source")
    target = keras.Input((None,), dtype="int32", name="target")
    x = SinusoidalEmbedding(16, VOCAB, mask_zero=True, name="source_embedding")(source)
    x = TransformerEncoder(32, 4, num_key_value_heads=2, name="encoder")(x)
    y = SinusoidalEmbedding(16, VOCAB, mask_zero=True, name="target_embedding")(target)
    y = TransformerDecoder(32, 4, normalize_first=True, name="decoder")(y, x)
    y = MultiHeadAttention(num_heads=2, key_dim=5, name="attention")(y, x)
    return keras.Model([source, target], keras.layers.Dense(VOCAB, name="head")(y))


def eager_all_layers(model, source, target):
    """`all_layers_model` layer by layer, with explicit padding masks."""
    layer = {layer.name: layer for layer in model.layers}
    x = layer["source_embedding"](source)
    x = layer["encoder"](x, padding_mask=source != 0)
    y = layer["target_embedding"](target)
    y = layer["decoder"](
        y, x, decoder_padding_mask=target != 0, encoder_padding_mask=source != 0
    )
    y = layer["attention"](y, x, value_mask=source != 0)
    return to_numpy(layer["head"](y))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    keras.utils.set_random_seed(0)
    model = all_layers_model()
    path = tmp_path_factory.mktemp("saved") / "model.keras"
    model.save(path)
    return model, path


def rewrite(path, out, edit_config=None, edit_files=None):
    """Copy the `.keras` zip at `path` to `out`, editing its config or files."""
    with zipfile.ZipFile(path) as archive:
        files = {name: archive.read(name) for name in archive.namelist()}
    if edit_config is not None:
        config = json.loads(files["config.json"])
        edit_config(config)
        files["config.json"] = json.dumps(config).encode()
    if edit_files is not None:
        edit_files(files)
    with zipfile.ZipFile(out, "w") as archive:
        for name, data in files.items():
            archive.writestr(name, data)
    return out


def layer_config(config, class_name):
    """The (first) config of a `class_name` layer in a functional model's config."""
    (first, *_) = [
        layer["config"]
        for layer in config["config"]["layers"]
        if layer["class_name"] == class_name
    ]
    return first


LAYER_CLASSES = [
    "MultiHeadAttention",
    "SinusoidalEmbedding",
    "TransformerEncoder",
    "TransformerDecoder",
]


@pytest.mark.parametrize("class_name", LAYER_CLASSES)
def test_config_from_a_newer_version_names_the_unknown_key(saved, tmp_path, class_name):
    _, path = saved
    newer = rewrite(
        path,
        tmp_path / "newer.keras",
        lambda config: layer_config(config, class_name).update(rope_theta=1e4),
    )
    version = re.escape(keras_attn.__version__)
    with pytest.raises(
        ValueError,
        match=rf"Cannot create {class_name} .* keras_attn {version}\. Received: "
        r"unknown arguments \['rope_theta'\]\. .*upgrade keras_attn",
    ):
        keras.models.load_model(newer)


@pytest.mark.parametrize(
    "class_name, key",
    [
        ("MultiHeadAttention", "num_heads"),
        ("TransformerEncoder", "intermediate_dim"),
        ("TransformerDecoder", "num_heads"),
    ],
)
def test_config_without_a_required_key_names_it(saved, tmp_path, class_name, key):
    _, path = saved
    older = rewrite(
        path,
        tmp_path / "older.keras",
        lambda config: layer_config(config, class_name).pop(key),
    )
    with pytest.raises(
        ValueError,
        match=rf"Cannot create {class_name} .*missing required arguments \['{key}'\]"
        r".*downgrade keras_attn",
    ):
        keras.models.load_model(older)


@pytest.mark.parametrize(
    "cls",
    [MultiHeadAttention, SinusoidalEmbedding, TransformerEncoder, TransformerDecoder],
)
def test_from_config_checks_keys_and_still_round_trips(cls):
    config = cls(**REQUIRED[cls]).get_config()
    assert cls.from_config(config).get_config() == config
    for key in REQUIRED[cls]:
        config.pop(key)
    config.update(rope_theta=1.0, use_rotary=True)
    missing = sorted(REQUIRED[cls])
    missing = re.escape(f" and missing required arguments {missing}") if missing else ""
    with pytest.raises(
        ValueError,
        match=rf"{cls.__name__} .*unknown arguments \['rope_theta', 'use_rotary'\]"
        + missing,
    ):
        cls.from_config(config)


def test_subclasses_that_take_their_own_kwargs_still_load():
    class Tagged(MultiHeadAttention):  # takes "tag" through **kwargs
        def __init__(self, **kwargs):
            self.tag = kwargs.pop("tag", None)
            super().__init__(**kwargs)

        def get_config(self):
            return {**super().get_config(), "tag": self.tag}

    config = Tagged(num_heads=2, tag="mine").get_config()
    assert Tagged.from_config(config).tag == "mine"


def test_truncated_file_is_not_a_keras_archive(saved, tmp_path):
    # Keras (3.15) says "File not found" for any `.keras` path that is not a
    # zip file, then "Please ensure the file is an accessible `.keras` zip file".
    _, path = saved
    data = path.read_bytes()
    for size in (0, 100, len(data) // 2, len(data) - 10):
        truncated = tmp_path / f"truncated_{size}.keras"
        truncated.write_bytes(data[:size])
        with pytest.raises(ValueError, match=r"an accessible `\.keras` zip file"):
            keras.models.load_model(truncated)


def test_truncated_weights_inside_the_archive(saved, tmp_path):
    _, path = saved

    def cut_weights(files):
        files["model.weights.h5"] = files["model.weights.h5"][:-1000]

    damaged = rewrite(path, tmp_path / "damaged.keras", edit_files=cut_weights)
    with pytest.raises(OSError, match="truncated file"):
        keras.models.load_model(damaged)


def test_loading_restores_every_weight_exactly(saved):
    model, path = saved
    loaded = keras.models.load_model(path)
    original = {w.path: to_numpy(w) for w in model.weights}
    restored = {w.path: to_numpy(w) for w in loaded.weights}
    assert sorted(restored) == sorted(original)
    assert len(original) == len(model.weights)  # paths are unique
    for name, value in original.items():
        np.testing.assert_array_equal(restored[name], value, err_msg=name)
    source, target = ints(2, 5), ints(2, 4)
    np.testing.assert_array_equal(
        to_numpy(loaded([source, target])), to_numpy(model([source, target]))
    )


# --- 3. Numerical safety ------------------------------------------------------


@pytest.mark.parametrize("flash_attention", [None, False])
def test_rows_with_nothing_to_attend_give_the_output_bias(flash_attention):
    layer = MultiHeadAttention(
        num_heads=2,
        key_dim=3,
        flash_attention=flash_attention,
        bias_initializer=keras.initializers.RandomNormal(seed=1),
    )
    query, value = random_floats(B, 4, W, seed=1), random_floats(B, S, VW, seed=2)
    value_mask = np.array([[False] * S, [True, True, True, False, False]])
    attention_mask = np.ones((B, 4, S), bool)
    attention_mask[1, 2] = False  # one more empty row
    output, scores = layer(
        query,
        value,
        value_mask=value_mask,
        attention_mask=attention_mask,
        return_attention_scores=True,
    )
    allowed = value_mask[:, None, None, :] & attention_mask[:, None]
    expected = masked_reference(layer, query, value, allowed)
    bias = to_numpy(layer.output_bias)
    np.testing.assert_allclose(expected[0], np.broadcast_to(bias, (4, W)))
    np.testing.assert_allclose(to_numpy(output), expected, atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(to_numpy(scores)[0], 0.0)
    np.testing.assert_array_equal(to_numpy(scores)[1, :, 2], 0.0)
    fused = layer(query, value, value_mask=value_mask, attention_mask=attention_mask)
    np.testing.assert_allclose(to_numpy(fused), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("flash_attention", [None, False])
def test_fully_padded_sequences_stay_finite_in_the_blocks(flash_attention):
    """A sequence that is all padding attends to nothing: each position's output
    then depends on that position alone, and every number stays finite."""
    x, memory = random_floats(B, 4, W), random_floats(B, S, VW, seed=1)
    padding = np.array([[False] * 4, [False, True, True, True]])
    memory_padding = np.array([[False] * S, [True] * S])
    changed, changed_memory = x.copy(), memory.copy()
    changed[0, 1:] += 5.0
    changed_memory[0] -= 5.0
    encoder = TransformerEncoder(16, 2, flash_attention=flash_attention)
    decoder = TransformerDecoder(16, 2, flash_attention=flash_attention)
    outputs = []
    for inputs, source in ((x, memory), (changed, changed_memory)):
        encoded = to_numpy(encoder(inputs, padding_mask=padding))
        decoded = to_numpy(
            decoder(
                inputs,
                source,
                decoder_padding_mask=padding,  # row 1 left-padded: causal row 0 empty
                encoder_padding_mask=memory_padding,
            )
        )
        assert np.all(np.isfinite(encoded)) and np.all(np.isfinite(decoded))
        outputs.append((encoded, decoded))
    (encoded, decoded), (encoded_changed, decoded_changed) = outputs
    np.testing.assert_allclose(encoded[0, 0], encoded_changed[0, 0], atol=1e-5)
    np.testing.assert_allclose(decoded[0, 0], decoded_changed[0, 0], atol=1e-5)
    np.testing.assert_allclose(encoded[1], encoded_changed[1], atol=1e-5)


def assert_mostly_close(output, reference, tolerance):
    """Finite, and 95% of the entries within `tolerance` of the reference's
    largest magnitude: rounding in half precision may flip an argmax between
    nearly tied keys of a saturated softmax, which changes a few rows."""
    output = to_numpy(keras.ops.cast(output, "float32"))
    reference = to_numpy(reference)
    assert np.all(np.isfinite(output))
    close = np.abs(output - reference) <= tolerance * np.abs(reference).max()
    assert close.mean() >= 0.95, (close.mean(), tolerance)


TOLERANCE = {"mixed_float16": 0.01, "mixed_bfloat16": 0.05}


def twins(cls, kwargs, policy, *inputs):
    """`cls(**kwargs)` in `policy` and a float32 copy with the same weights."""
    layer, reference = cls(**kwargs, dtype=policy), cls(**kwargs, dtype="float32")
    layer(*inputs)
    reference(*inputs)
    reference.set_weights(layer.get_weights())
    return layer, reference


@pytest.mark.parametrize("scale", [300.0, 3000.0])
@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_large_activations_in_mixed_precision(policy, scale):
    """Inputs whose squares overflow float16: the float32 softmax (and layer
    norms) keep every layer finite and close to float32."""
    x = random_floats(B, 16, W, scale=scale, seed=1)
    memory = random_floats(B, S, VW, scale=scale, seed=2)
    tolerance = TOLERANCE[policy]
    for flash_attention in (None, False):
        kwargs = {"num_heads": 2, "flash_attention": flash_attention}
        for args in ((x, memory), (x,)):  # cross- and causal self-attention
            layer, reference = twins(MultiHeadAttention, kwargs, policy, *args)
            causal = len(args) == 1
            assert_mostly_close(
                layer(*args, use_causal_mask=causal),
                reference(*args, use_causal_mask=causal),
                tolerance,
            )
    for normalize_first in (False, True):
        kwargs = {"intermediate_dim": 16, "num_heads": 2}
        kwargs["normalize_first"] = normalize_first
        encoder, reference = twins(TransformerEncoder, kwargs, policy, x)
        assert_mostly_close(encoder(x), reference(x), tolerance)
        decoder, reference = twins(TransformerDecoder, kwargs, policy, x, memory)
        assert_mostly_close(decoder(x, memory), reference(x, memory), tolerance)
    far = 60_000  # positions far beyond float16's integers
    ids = ints(B, 6)
    initializer = keras.initializers.RandomNormal(stddev=scale, seed=3)
    kwargs = {"embedding_dim": 16, "vocabulary_size": VOCAB}
    kwargs["embeddings_initializer"] = initializer
    embedding, reference = twins(SinusoidalEmbedding, kwargs, policy, ids)
    assert_mostly_close(
        embedding(ids, start_index=far), reference(ids, start_index=far), tolerance
    )
    embedding, reference = twins(SinusoidalEmbedding, {}, policy, x)
    assert_mostly_close(
        embedding(x, start_index=far), reference(x, start_index=far), tolerance
    )


@pytest.mark.parametrize("flash_attention", [None, False])
def test_length_one_and_batch_one(flash_attention):
    query, value = random_floats(1, 1, W), random_floats(1, 1, VW, seed=1)
    attention = MultiHeadAttention(2, key_dim=3, flash_attention=flash_attention)
    attention.build(query.shape, value.shape)
    expected = numpy_reference(attention, query, value)
    for kwargs in ({}, {"use_causal_mask": True}):
        output = to_numpy(attention(query, value, **kwargs))
        np.testing.assert_allclose(output, expected, atol=1e-5, rtol=1e-5)
    encoder = TransformerEncoder(16, 2, flash_attention=flash_attention)
    encoded = to_numpy(encoder(query))
    assert encoded.shape == (1, 1, W) and np.all(np.isfinite(encoded))
    decoder = TransformerDecoder(16, 2, flash_attention=flash_attention)
    causal = to_numpy(decoder(query, value))
    assert causal.shape == (1, 1, W) and np.all(np.isfinite(causal))
    # One position sees itself, causal or not.
    unmasked = to_numpy(decoder(query, value, use_causal_mask=False))
    np.testing.assert_allclose(unmasked, causal, atol=1e-6)
    embedding = SinusoidalEmbedding(W, VOCAB)
    ids = np.array([[7]], "int32")
    embedded = to_numpy(embedding(ids))
    table = to_numpy(embedding.embeddings)
    expected = table[ids] * np.sqrt(W) + reference_encoding(1, W)[0]
    np.testing.assert_allclose(embedded, expected, atol=1e-5)


@pytest.mark.parametrize("query_length, key_length", [(1, 7), (7, 1), (2, 5), (5, 2)])
def test_query_and_key_lengths_that_differ(query_length, key_length):
    query = random_floats(B, query_length, W, seed=1)
    value = random_floats(B, key_length, VW, seed=2)
    padding = np.ones((B, key_length), bool)
    padding[1, -1] = False  # with one key, batch row 1 attends to nothing
    layer = MultiHeadAttention(
        4, num_key_value_heads=2, key_dim=3, bias_initializer="ones"
    )
    layer.build(query.shape, value.shape)
    for flash_attention in (None, False):
        layer.flash_attention = flash_attention  # same weights, other path
        for causal in (False, True):
            allowed = padding[:, None, None, :]
            if causal:  # Aligned at the first position: query i sees keys <= i.
                allowed = allowed & np.tril(np.ones((query_length, key_length), bool))
            output = layer(query, value, value_mask=padding, use_causal_mask=causal)
            expected = masked_reference(layer, query, value, allowed)
            np.testing.assert_allclose(to_numpy(output), expected, atol=1e-5, rtol=1e-5)
    decoder = TransformerDecoder(16, 2)
    output, self_scores, cross_scores = decoder(
        query, value, encoder_padding_mask=padding, return_attention_scores=True
    )
    assert tuple(cross_scores.shape) == (B, 2, query_length, key_length)
    assert tuple(self_scores.shape) == (B, 2, query_length, query_length)
    assert np.all(np.isfinite(to_numpy(output)))
    sums = to_numpy(cross_scores).sum(-1)
    expected = np.broadcast_to(padding.any(-1)[:, None, None], sums.shape)
    np.testing.assert_allclose(sums, expected.astype("float32"), atol=1e-5)


@pytest.mark.parametrize("flash_attention", [None, False])
def test_4096_tokens_on_cpu(flash_attention):
    """Batch 1, 4096 tokens, width 16: correct and bounded memory (measured:
    0.1-1.5 s and 0.1-0.6 GB, the (1, 2, 4096, 4096) float32 weights)."""
    length = 4096
    x = random_floats(1, length, 16)
    padding = np.ones((1, length), bool)
    padding[0, -100:] = False
    attention = MultiHeadAttention(2, flash_attention=flash_attention)
    attention.build(x.shape)
    encoder = TransformerEncoder(32, 2, flash_attention=flash_attention)
    encoder.build(x.shape)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    output = to_numpy(attention(x, value_mask=padding, use_causal_mask=True))
    encoded = to_numpy(encoder(x, padding_mask=padding))
    growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak
    assert growth < 2 * 1024**2, f"peak memory grew by {growth / 1024:.0f} MiB"
    assert output.shape == (1, length, 16) and np.all(np.isfinite(output))
    assert encoded.shape == (1, length, 16) and np.all(np.isfinite(encoded))
    rows = np.r_[0:4, length - 104 : length - 100, length - 4 : length]
    allowed = np.tril(np.ones((length, length), bool))[rows] & padding[0]
    expected = numpy_reference(attention, x[:, rows], x, allowed[None, None])
    np.testing.assert_allclose(output[:, rows], expected, atol=1e-5, rtol=1e-4)


def all_layers_inputs(batch, source_length, target_length, seed=0):
    """Token ids with right padding, a fully padded source and target row."""
    rng = np.random.default_rng(seed)
    source = rng.integers(1, VOCAB, (batch, source_length)).astype("int32")
    target = rng.integers(1, VOCAB, (batch, target_length)).astype("int32")
    source[0, source_length // 2 + 1 :] = 0
    if batch > 1:
        source[-1] = 0
        target[-1, 1:] = 0
        target[-2] = 0
    return source, target


SHAPES = [(1, 1, 1), (3, 7, 4)]  # (batch, source length, target length)


def test_unknown_batch_and_length(saved):
    model, _ = saved
    for shape in SHAPES:
        source, target = all_layers_inputs(*shape)
        expected = eager_all_layers(model, source, target)
        assert np.all(np.isfinite(expected))
        predicted = model.predict([source, target], verbose=0, batch_size=shape[0])
        np.testing.assert_allclose(predicted, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(
    BACKEND == "torch",
    reason="jit_compile=True on torch means torch.compile (Keras: experimental); "
    "keras_attn checks XLA compilation on jax and tensorflow only",
)
def test_jit_compile(saved):
    model, path = saved
    compiled = keras.models.load_model(path)
    compiled.compile(jit_compile=True)
    for shape in SHAPES:
        source, target = all_layers_inputs(*shape)
        expected = eager_all_layers(model, source, target)
        predicted = compiled.predict([source, target], verbose=0, batch_size=shape[0])
        np.testing.assert_allclose(predicted, expected, atol=1e-5, rtol=1e-5)
