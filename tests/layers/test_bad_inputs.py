"""Bad inputs a newcomer still met after two rounds (issue 44), each refused
at the layer's door with the argument's name, or given one documented
answer where nothing can be read: token ids out of range or not whole
numbers (NaN rows inside compiled graphs and JAX's trainer steps), float
masks that are not 0/1, an encoder batch that is not the decoder's, caches
of impossible sizes."""

import keras
import numpy as np
import pytest

from keras_attn import MultiHeadAttention, SinusoidalEmbedding, TransformerDecoder
from keras_attn.cache import DenseCache, Int8Cache, LatentCache
from keras_attn.ops import dot_product_attention
from tests.helpers.backend import BACKEND, to_numpy
from tests.helpers.builders import VOCAB, random_floats

W = 4  # embedding width
BAD_IDS = {  # (ids, the (row, position) pairs that are no id)
    "int32": (np.array([[1, VOCAB, 3], [-1, 2, 5]], "int32"), [(0, 1), (1, 0)]),
    "float32": (
        np.array([[1.0, np.nan, 3.0], [2.0, 2.5, 5.0]], "float32"),
        [(0, 1), (1, 1)],
    ),
}


@pytest.fixture(scope="module")
def embedding_model():
    """ids -> SinusoidalEmbedding, for int32 and float32 ids."""
    models = {}
    for dtype in BAD_IDS:
        ids = keras.Input((None,), dtype=dtype)
        layer = SinusoidalEmbedding(vocabulary_size=VOCAB, embedding_dim=W)
        models[dtype] = keras.Model(ids, layer(ids))
    return models


def compiled_predict(model, inputs):
    """`predict` with `jit_compile=True` on JAX and TensorFlow; on PyTorch a
    `torch.compile` trace (Dynamo's eager backend: what makes the tensors
    valueless, without Inductor's minutes on a 2-core CPU)."""
    if BACKEND != "torch":
        model.compile(jit_compile=True)
        return model.predict(inputs, verbose=0)
    import torch

    return to_numpy(torch.compile(model, backend="eager")(inputs))


def _expected_rows(model, ids, bad):
    """The eager output of `ids` with each bad id replaced by 1, and a bool
    `(batch, length)` of where the rows must be NaN instead."""
    good = np.where(np.isnan(ids), 1, ids).astype("float64")
    nan = np.zeros(ids.shape, bool)
    for row, position in bad:
        good[row, position], nan[row, position] = 1, True
    return to_numpy(model(good.astype(ids.dtype))), nan


@pytest.mark.parametrize("dtype", list(BAD_IDS))
def test_ids_that_are_no_ids_give_nan_rows_where_they_cannot_be_checked(
    embedding_model, dtype
):
    """Compiled graphs: the same NaN rows on every backend, the others
    untouched."""
    model = embedding_model[dtype]
    ids, bad = BAD_IDS[dtype]
    expected, nan = _expected_rows(model, ids, bad)
    output = compiled_predict(model, ids)
    assert np.all(np.isnan(output[nan]))
    np.testing.assert_allclose(output[~nan], expected[~nan], atol=1e-6)


@pytest.mark.parametrize(
    "ids, match",
    [
        (np.array([[1.0, np.nan]]), r"whole numbers.*Received: an id of nan"),
        (np.array([[1.5, 2.0]]), r"whole numbers.*Received: an id of 1\.5"),
        (np.array([[1.0, -3.0]]), rf"\[0, {VOCAB}\)\. Received ids from -3 to 1"),
    ],
)
def test_float_ids_that_are_no_ids_are_refused_in_eager_calls(ids, match):
    layer = SinusoidalEmbedding(vocabulary_size=VOCAB, embedding_dim=W)
    with pytest.raises(ValueError, match=match):
        layer(ids)


def test_a_refused_predict_leaves_the_model_usable(embedding_model):
    """Uncompiled `predict`: JAX's trainer steps (a stateless scope, whose
    error would cost the model its weights) and TensorFlow's graph give NaN
    rows; PyTorch's eager step raises. Either way, the next `predict`
    works."""
    model = embedding_model["int32"]
    ids, bad = BAD_IDS["int32"]
    expected, nan = _expected_rows(model, ids, bad)
    model.compile(jit_compile=False)
    if BACKEND == "torch":
        with pytest.raises(ValueError, match=r"Token ids must be in"):
            model.predict(ids, verbose=0)
    else:
        assert np.all(np.isnan(model.predict(ids, verbose=0)[nan]))
    good = np.where(nan, 1, ids)
    np.testing.assert_allclose(model.predict(good, verbose=0), expected, atol=1e-6)


# --- Float masks ----------------------------------------------------------------


@pytest.fixture(scope="module")
def attention_layer():
    layer = MultiHeadAttention(num_heads=2, key_dim=3)
    layer(random_floats(2, 3, W), random_floats(2, 5, W))
    return layer


BOOL_MASK = np.random.default_rng(1).random((2, 3, 5)) > 0.4
BOOL_MASK[..., 0] = True  # every query sees a key


@pytest.mark.parametrize(
    "value, shown", [(0.3, "0.3"), (-np.inf, "-inf"), (2.0, "2")], ids=str
)
def test_float_masks_that_are_not_0_or_1_are_refused(attention_layer, value, shown):
    mask = np.where(BOOL_MASK, 1.0, value).astype("float32")
    with pytest.raises(ValueError, match=rf"float attention_mask holding {shown}"):
        attention_layer(
            random_floats(2, 3, W), random_floats(2, 5, W), attention_mask=mask
        )


def test_float_masks_of_0_and_1_are_the_bool_mask(attention_layer):
    query, value = random_floats(2, 3, W), random_floats(2, 5, W)
    np.testing.assert_array_equal(
        to_numpy(attention_layer(query, value, attention_mask=BOOL_MASK)),
        to_numpy(
            attention_layer(query, value, attention_mask=BOOL_MASK.astype("float32"))
        ),
    )


def test_the_op_and_the_blocks_refuse_float_masks_too():
    q = random_floats(2, 3, 2, 4)
    k = random_floats(2, 5, 2, 4)
    with pytest.raises(ValueError, match=r"float mask holding 0.5"):
        dot_product_attention(q, k, k, mask=np.full((2, 3, 5), 0.5, "float32"))
    decoder = TransformerDecoder(intermediate_dim=8, num_heads=2)
    padding = np.array([[1.0, 1.0, 0.5], [1.0, 1.0, 1.0]], "float32")
    with pytest.raises(ValueError, match=r"float decoder_padding_mask holding 0.5"):
        decoder(random_floats(2, 3, W), decoder_padding_mask=padding)


def test_inside_compiled_graphs_a_float_mask_is_cast_as_keras_casts_it(
    attention_layer,
):
    """Documented: unchecked there, nonzero is True (Keras' cast)."""
    query, value = random_floats(2, 3, W), random_floats(2, 5, W)
    expected = to_numpy(attention_layer(query, value, attention_mask=BOOL_MASK))
    inputs = [keras.Input((3, W)), keras.Input((5, W)), keras.Input((3, 5))]
    model = keras.Model(
        inputs, attention_layer(inputs[0], inputs[1], attention_mask=inputs[2])
    )
    mask = np.where(BOOL_MASK, 0.3, 0.0).astype("float32")
    output = compiled_predict(model, [query, value, mask])
    np.testing.assert_allclose(output, expected, atol=1e-5)


# --- The decoder's encoder sequence -------------------------------------------


@pytest.mark.parametrize("built", [False, True], ids=["unbuilt", "built"])
def test_an_encoder_batch_other_than_the_decoders_is_refused(built):
    decoder = TransformerDecoder(intermediate_dim=8, num_heads=2)
    if built:
        decoder(random_floats(2, 3, W), random_floats(2, 5, W))
    with pytest.raises(
        ValueError,
        match=r"`encoder_sequence` must have the batch size of `decoder_sequence`.*"
        r"encoder_sequence.shape=\(3, 5, 4\), decoder_sequence.shape=\(2, 3, 4\)",
    ):
        decoder(random_floats(2, 3, W), random_floats(3, 5, W))
    assert decoder.built == built  # refused before any sublayer was built


# --- Caches of impossible sizes ---------------------------------------------------


@pytest.fixture(scope="module")
def decoder():
    layer = TransformerDecoder(intermediate_dim=8, num_heads=2)
    layer(random_floats(2, 3, W))
    return layer


@pytest.mark.parametrize(
    "make, error, match",
    [
        (
            lambda d: d.get_empty_self_attention_cache(2, -1),
            ValueError,
            "max_length=-1",
        ),
        (
            lambda d: d.get_empty_self_attention_cache(2.0, 4),
            TypeError,
            "batch_size=2.0",
        ),
        (lambda d: d.get_empty_self_attention_cache(0, 4), ValueError, "batch_size=0"),
        (lambda d: DenseCache.empty(2, 2, -1, 4), ValueError, "length=-1"),
        (lambda d: DenseCache.empty(2.0, 2, 3, 4), TypeError, "batch_size=2.0 of"),
        (lambda d: Int8Cache.empty(2, 0, 3, 4), ValueError, "num_heads=0"),
        (lambda d: LatentCache.empty(2, 3, -4), ValueError, "width=-4"),
    ],
    ids=["max_length", "float batch", "zero batch", "dense", "float", "int8", "latent"],
)
def test_caches_of_impossible_sizes_are_refused(decoder, make, error, match):
    with pytest.raises(error, match=match):
        make(decoder)


# --- LoRA on float8 -----------------------------------------------------------------


def test_lora_on_a_float8_layer_is_refused_before_any_adapter():
    layer = MultiHeadAttention(num_heads=2, key_dim=3)
    inputs = keras.Input((3, W))
    keras.Model(inputs, layer(inputs)).quantize("float8")
    with pytest.raises(ValueError, match=r"LoRA cannot train on a float8 kernel"):
        layer.enable_lora(2)
    assert not layer.query_dense.lora_enabled
