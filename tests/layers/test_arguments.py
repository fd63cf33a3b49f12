"""Bad arguments, table-driven: every constructor and call argument of the four
layers, given a wrong type, an out-of-range value (token ids included), a wrong
rank or a wrong shape, or by position where it is keyword only, raises a
`ValueError` or `TypeError` that names the argument and what was received,
before any state changes."""

import re

import numpy as np
import pytest

from keras_attn import (
    MultiHeadAttention,
    SinusoidalEmbedding,
    TransformerDecoder,
    TransformerEncoder,
)
from tests.helpers.backend import to_numpy
from tests.helpers.builders import REQUIRED_ARGUMENTS, VOCAB, random_floats, random_ids

# Distinct sizes, so that a swapped axis cannot pass: batch, query/target
# length, key/source length, width, value/source width.
B, T, S, W, VW = 2, 3, 5, 8, 6


def bools(*shape):
    return np.ones(shape, bool)


def snapshot(layer):
    return [(w.path, to_numpy(w).copy()) for w in layer.weights]


def assert_unchanged(before, after):
    assert [path for path, _ in after] == [path for path, _ in before]
    for (path, old), (_, new) in zip(before, after, strict=True):
        np.testing.assert_array_equal(old, new, err_msg=path)


# --- 1. The battery: constructors ---------------------------------------------


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


def positive_float_rows(cls, name, allow_none=False):
    rows = [
        init_row(cls, {name: 0.0}, ValueError, rf"`{name}` must be positive.*{name}=0"),
        init_row(cls, {name: -2}, ValueError, rf"{name}=-2\b"),
        init_row(cls, {name: "5"}, TypeError, rf"{name}='5' of type str"),
        init_row(cls, {name: True}, TypeError, rf"{name}=True of type bool"),
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
        init_row(
            cls,
            {"flash_attention": True, "dropout": 0.1},
            ValueError,
            r"`flash_attention=True` needs.*dropout.*flash_attention=True, "
            r"dropout=0.1",
        ),
        *bool_rows(cls, "use_gate"),
        *positive_int_rows(cls, "sliding_window"),
        *bool_rows(cls, "use_bias"),
        *bool_rows(cls, "use_output_bias", allow_none=True),
        *bool_rows(cls, "normalize_qk"),
        *positive_float_rows(cls, "logit_soft_cap", allow_none=True),
        *positive_float_rows(cls, "rope_max_wavelength", allow_none=True),
        *positive_float_rows(cls, "rope_scaling_factor"),
        init_row(
            cls,
            {"rope_scaling_factor": 2.0},
            ValueError,
            r"`rope_scaling_factor` scales rotary positions.*rope_scaling_factor=2.0, "
            r"rope_max_wavelength=None",
        ),
        init_row(
            cls,
            {"flash_attention": True, "logit_soft_cap": 30.0},
            ValueError,
            r"`flash_attention=True` needs.*soft-cap.*logit_soft_cap=30.0",
        ),
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
        *bool_rows(cls, "gated_feedforward"),
        *bool_rows(cls, "use_feedforward_bias", allow_none=True),
        init_row(
            cls,
            {"normalization": "batch_norm"},
            ValueError,
            r"`normalization` must be one of \['layer_norm', 'rms_norm'\].*"
            r"normalization='batch_norm'",
        ),
        init_row(cls, {"normalization": None}, TypeError, r"normalization=None"),
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
    init_row(MultiHeadAttention, {"output_shape": 0}, ValueError, r"output_shape=0"),
    init_row(MultiHeadAttention, {"output_shape": "8"}, TypeError, r"output_shape='8'"),
    init_row(
        MultiHeadAttention,
        {"output_shape": 8.0},
        TypeError,
        r"`output_shape` must be None, an int or a tuple.*8.0",
    ),
    init_row(
        MultiHeadAttention,
        {"output_shape": (8, 0)},
        ValueError,
        r"`output_shape` must hold positive ints.*\(8, 0\)",
    ),
    init_row(
        MultiHeadAttention,
        {"output_shape": 4, "output_dim": 8},
        ValueError,
        r"`output_dim` is another name.*output_shape=\(4,\), output_dim=8",
    ),
    init_row(
        MultiHeadAttention,
        {"attention_axes": "2"},
        TypeError,
        r"`attention_axes` must be None, an int or.*attention_axes='2'",
    ),
    init_row(MultiHeadAttention, {"attention_axes": ()}, TypeError, r"axes=\(\)"),
    init_row(MultiHeadAttention, {"attention_axes": (1.5,)}, TypeError, r"=\(1.5,\)"),
    init_row(MultiHeadAttention, {"attention_axes": True}, TypeError, r"axes=True"),
    init_row(
        MultiHeadAttention,
        {"key_dim": 4, "value_dim": 3, "flash_attention": True},
        ValueError,
        r"`flash_attention=True` needs.*keys' width.*key_dim=4, value_dim=3",
    ),
    *positive_float_rows(MultiHeadAttention, "qk_norm_epsilon"),
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
        cls(**{**REQUIRED_ARGUMENTS[cls], **kwargs})
    assert type(info.value) is error  # not a subclass from deep inside


# Keras' (or keras-hub's) arguments in their order, then one more: the first
# keyword-only argument (keras_attn's own), which must not be taken by position.
MHA_POSITIONAL = (2, None, None, 0.0, True, None, None, None, None)
MHA_POSITIONAL += ("glorot_uniform", "zeros", None, None, None, None, None, False, None)
BLOCK_POSITIONAL = (8, 2, 0.0, "relu", 1e-5, "glorot_uniform", "zeros", False)
TOO_MANY = r"positional arguments but \d+ were given"
KEYWORD_ONLY_ROWS = [
    (MultiHeadAttention, MHA_POSITIONAL, "num_key_value_heads", 1, {}, TOO_MANY),
    (TransformerEncoder, BLOCK_POSITIONAL, "key_dim", 4, {}, TOO_MANY),
    (TransformerDecoder, BLOCK_POSITIONAL, "key_dim", 4, {}, TOO_MANY),
    (
        SinusoidalEmbedding,
        (),
        "vocabulary_size",
        11,
        {"embedding_dim": 8},
        r"SinusoidalEmbedding takes keyword arguments only.*vocabulary_size=\.\.\."
        r".*Received positional arguments \(11,\)",
    ),
]


@pytest.mark.parametrize(
    "cls, positional, name, value, kwargs, match",
    KEYWORD_ONLY_ROWS,
    ids=[row[0].__name__ for row in KEYWORD_ONLY_ROWS],
)
def test_keyword_only_arguments_refuse_a_position(
    cls, positional, name, value, kwargs, match
):
    with pytest.raises(TypeError, match=match):
        cls(*positional, value, **kwargs)
    layer = cls(*positional, **{name: value}, **kwargs)
    assert getattr(layer, name) == value


# --- 1. The battery: calls ----------------------------------------------------
# Each target returns a built layer (or an unbuilt one, for errors in `build`)
# and call arguments that work; a row overrides some of them.


def built(layer, *shapes):
    layer.build(*shapes)
    return layer


def mha_cross():
    layer = built(MultiHeadAttention(num_heads=2, key_dim=4), (B, T, W), (B, S, VW))
    return layer, {"query": random_floats(B, T, W), "value": random_floats(B, S, VW)}


def mha_rotary():
    layer = built(MultiHeadAttention(num_heads=2, rope_max_wavelength=100.0), (B, T, W))
    return layer, {"query": random_floats(B, T, W)}


def mha_rotary_cached():
    """Cross-attention with rotary positions into a precomputed cache."""
    layer, kwargs = mha_rotary()
    cache = layer.compute_cache(random_floats(B, S, W))
    return layer, {**kwargs, "cache": cache, "positions": np.arange(T)}


def decoder_rotary():
    layer = built(TransformerDecoder(16, 2, rope_max_wavelength=100.0), (B, T, W))
    return layer, {"decoder_sequence": random_floats(B, T, W)}


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
    layer = built(SinusoidalEmbedding(vocabulary_size=VOCAB, embedding_dim=W), (B, T))
    return layer, {"inputs": random_ids(B, T)}


def float_embedding():
    layer = built(SinusoidalEmbedding(), (B, T, W))
    return layer, {"inputs": random_floats(B, T, W)}


TARGETS = (
    mha_cross,
    mha_rotary,
    mha_rotary_cached,
    decoder_rotary,
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


def call_row(target, kwargs, error, match, what=None):
    name = "-".join(kwargs) or "baseline"
    name += f"-{what}" if what else ""
    return pytest.param(target, kwargs, error, match, id=f"{target.__name__}-{name}")


def positions_rows(target, name):
    """Rotary positions: `(T,)` or `(B, T)` of ints or floats."""
    return [
        call_row(
            target,
            {name: np.arange(T + 1)},
            ValueError,
            rf"`{name}` does not match.*{name}.shape=\(4,\)",
        ),
        call_row(
            target,
            {name: np.zeros((1, B, T), "int32")},
            ValueError,
            rf"`{name}` must have rank 1 or 2.*{name}.shape=\(1, 2, 3\)",
        ),
        call_row(target, {name: bools(B, T)}, TypeError, rf"{name}.dtype=bool"),
    ]


def rank_row(target, name, array, description=r"\(batch, length, width\)"):
    """`array` has the right dtype and the wrong rank."""
    shape = re.escape(str(array.shape))
    match = (
        rf"`{name}` must have rank \d( or more)?, {description}.*{name}.shape={shape}"
    )
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
    dtype_row(mha_cross, "query", random_ids(B, T, W)),
    dtype_row(mha_cross, "value", random_ids(B, S, VW)),
    dtype_row(mha_cross, "key", random_ids(B, S, VW)),
    width_row(mha_cross, "query", random_floats(B, T, W + 2), W),
    width_row(mha_cross, "value", random_floats(B, S, VW + 1), VW),
    width_row(mha_cross, "key", random_floats(B, S, VW + 1), VW),
    call_row(
        mha_cross,
        {"key": random_floats(B, S + 1, VW)},
        ValueError,
        r"`key` and `value` must have the same length.*key.shape=\(2, 6, 6\)",
    ),
    # Issue 28, item 4: batches that differ, ours to say, not the backend's.
    call_row(
        mha_cross,
        {"value": random_floats(B + 1, S, VW)},
        ValueError,
        r"`query` and `value` must have the same batch size.*"
        r"query.shape=\(2, 3, 8\), value.shape=\(3, 5, 6\)",
        what="batch",
    ),
    call_row(
        mha_cross,
        {"key": random_floats(B + 1, S, VW)},
        ValueError,
        r"`key` and `value` must have the same length and batch size.*"
        r"key.shape=\(3, 5, 6\)",
        what="batch",
    ),
    call_row(
        unbuilt(MultiHeadAttention, num_heads=2),
        {"query": random_floats(B, T, W), "value": random_floats(B + 1, S, VW)},
        ValueError,
        r"`query` and `value` must have the same batch size.*value.shape=\(3, 5, 6\)",
        what="batch",
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
        mha_cross,
        {"attention_bias": np.zeros((B, 2, T, S + 1), "float32")},
        ValueError,
        r"`attention_bias` must be broadcastable to \(batch, num_heads, "
        r"query_length, key_length\) = \(2, 2, 3, 5\)\. "
        r"Received: attention_bias.shape=\(2, 2, 3, 6\)",
    ),
    call_row(
        mha_cross,
        {"attention_bias": np.zeros((1, B, 2, T, S), "float32")},
        ValueError,
        r"attention_bias.shape=\(1, 2, 2, 3, 5\)",
    ),
    dtype_row(mha_cross, "attention_bias", np.zeros((T, S), "int32")),
    *positions_rows(mha_rotary, "positions"),
    call_row(
        mha_rotary_cached,
        {"positions": None},
        ValueError,
        r"precomputed `cache` \(no `cache_update_index`\) needs the queries' "
        r"`positions`",
    ),
    call_row(
        mha_cross,
        {"positions": np.arange(T)},
        ValueError,
        r"`positions` are rotary positions.*rope_max_wavelength=None",
    ),
    call_row(
        mha_rotary,
        {"value": random_floats(B, T, W), "positions": np.arange(T)},
        ValueError,
        r"`positions` are the rotary positions of a self-attention",
    ),
    call_row(
        mha_cached,
        {"cache": None},
        ValueError,
        "`cache_update_index` needs a `cache`.*cache=None, cache_update_index=0",
    ),
    *cache_rows(mha_cached, "cache", "cache_update_index", (B, 2, 2, 6, 2)),
    # SinusoidalEmbedding.
    rank_row(token_embedding, "inputs", random_ids(B), TOKEN_IDS),
    *(
        call_row(
            token_embedding,
            {"inputs": np.array(ids, "int32")},
            ValueError,
            rf"Token ids must be in \[0, vocabulary_size\) = \[0, {VOCAB}\)\. "
            rf"Received ids from {low} to {high}\.",
        )
        for ids, low, high in (
            ([[1, 2, VOCAB], [0, 3, 4]], 0, VOCAB),
            ([[-2, 3, 1], [1, 1, 1]], -2, 3),
        )
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
    rank_row(
        float_embedding,
        "inputs",
        random_floats(B, T),
        r"\(batch, length, width\) floats",
    ),
    dtype_row(float_embedding, "inputs", random_ids(B, T, W)),
    width_row(float_embedding, "inputs", random_floats(B, T, W - 1), W),
    # TransformerEncoder.
    rank_row(encoder, "inputs", random_floats(B, W)),
    rank_row(encoder, "inputs", random_floats(B, T, W, 1)),
    dtype_row(encoder, "inputs", random_ids(B, T, W)),
    width_row(encoder, "inputs", random_floats(B, T, W + 4), W),
    *mask_rows(encoder, "padding_mask", (B, T)),
    *mask_rows(encoder, "attention_mask", (B, T, T)),
    call_row(
        encoder,
        {"attention_bias": np.zeros((B, 2, T, T + 1), "float32")},
        ValueError,
        r"`attention_bias` must be broadcastable.*attention_bias.shape=\(2, 2, 3, 4\)",
    ),
    *flag_rows(encoder, "return_attention_scores"),
    # TransformerDecoder.
    rank_row(decoder, "decoder_sequence", random_floats(B, W)),
    rank_row(decoder, "encoder_sequence", random_floats(B, VW)),
    dtype_row(decoder, "decoder_sequence", random_ids(B, T, W)),
    dtype_row(decoder, "encoder_sequence", random_ids(B, S, VW)),
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
    call_row(
        decoder,
        {"encoder_attention_bias": np.zeros((B, 2, T, T), "float32")},
        ValueError,
        r"`encoder_attention_bias` must be broadcastable.*shape=\(2, 2, 3, 3\)",
    ),
    call_row(
        decoder,
        {"decoder_attention_bias": np.zeros((B, 2, T, S), "float32")},
        ValueError,
        r"`decoder_attention_bias` must be broadcastable.*shape=\(2, 2, 3, 5\)",
    ),
    *positions_rows(decoder_rotary, "positions"),
    call_row(
        decoder,
        {"positions": np.arange(T)},
        ValueError,
        r"`positions` are rotary positions.*rope_max_wavelength=None",
    ),
    call_row(
        decoder,
        {"cross_attention_cache_update_index": 0},
        ValueError,
        r"`cross_attention_cache_update_index` needs a `cross_attention_cache`",
    ),
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
        unbuilt(MultiHeadAttention, num_heads=2, key_dim=3, rope_max_wavelength=1e4),
        {"query": random_floats(B, T, W)},
        ValueError,
        r"Rotary position embeddings.*even `key_dim`.*rank 3, key_dim=3",
    ),
    call_row(
        unbuilt(MultiHeadAttention, num_heads=2, rope_max_wavelength=1e4),
        {"query": random_floats(B, T, 2, W)},
        ValueError,
        r"Rotary position embeddings.*inputs of rank 4, key_dim=4",
    ),
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
    *(
        call_row(
            unbuilt(MultiHeadAttention, num_heads=2, key_dim=2, attention_axes=axes),
            {"query": random_floats(B, T, S, W)},
            ValueError,
            rf"`attention_axes` must name distinct axes.*{match}",
        )
        for axes, match in (
            ((3,), r"in \[1, 2\] or \[-3, -2\].*attention_axes=\(3,\)"),
            ((0,), r"attention_axes=\(0,\)"),
            ((-1,), r"attention_axes=\(-1,\)"),
            ((2, -2), r"attention_axes=\(2, -2\)"),
        )
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
        {"inputs": random_ids(B)},
        ValueError,
        r"`inputs` must have rank 2 or more.*inputs.shape=\(2,\)",
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
