"""MixtureOfExperts: against a numpy loop over tokens and against
`transformers`' MoE blocks with copied weights; its losses, load, config
and errors; the blocks taking it as their feed-forward (fit, generate,
`decoder_lm`'s spec, `.keras`)."""

import keras
import numpy as np
import pytest

from keras_attn.generation import generate
from keras_attn.layers import MixtureOfExperts, TransformerDecoder, TransformerEncoder
from keras_attn.models import DecoderLMSpec, decoder_lm
from keras_attn.models.decoder_lm import spec_of
from tests.helpers.backend import to_numpy
from tests.helpers.builders import VOCAB, random_floats, random_ids

WIDTH = 12
MOE = MixtureOfExperts(3, 8, 2)


# --- The blocks with a MixtureOfExperts feed-forward. ---


def moe_decoder_lm(load_balancing_loss=0.01, router_z_loss=0.001):
    keras.utils.set_random_seed(0)
    moe = MixtureOfExperts(
        5,
        7,
        2,
        load_balancing_loss=load_balancing_loss,
        router_z_loss=router_z_loss,
    )
    block = dict(
        intermediate_dim=None,
        num_heads=2,
        normalize_first=True,
        normalization="rms_norm",
        use_bias=False,
        rope_max_wavelength=10000.0,
        feedforward=keras.saving.serialize_keras_object(moe),
    )
    spec = DecoderLMSpec(vocabulary_size=VOCAB, hidden_dim=WIDTH,
                         blocks=(block, block))  # fmt: skip
    return decoder_lm(spec)


@pytest.fixture(scope="module")
def lm():
    return moe_decoder_lm()


def test_each_block_owns_its_feedforward(lm):
    first, second = (b for b in lm.layers if "transformer_layer" in b.name)
    assert first.feedforward is not second.feedforward
    assert first.feedforward.name == "feedforward"
    assert first.feedforward_intermediate_dense is None
    paths = [w.path for w in first.weights]
    assert not any("feedforward_" in p and "dense" in p for p in paths)
    assert "transformer_layer_0/feedforward/gate_kernel" in paths


def test_generate_greedy_equals_the_full_forward(lm):
    prompts = np.array([[3, 4, 5, 6], [7, 8, 9, 10]])
    tokens = to_numpy(generate(lm, prompts, max_length=9))
    logits = to_numpy(lm(tokens))
    for row, row_logits in zip(tokens, logits, strict=True):
        for position in range(4, len(row)):
            chosen = row_logits[position - 1, row[position]]
            assert chosen >= row_logits[position - 1].max() - 1e-4, position


def test_spec_and_keras_round_trips(lm, tmp_path):
    tokens = np.array([[1, 2, 3, 4, 5]])
    expected = to_numpy(lm(tokens))
    again = decoder_lm(spec_of(lm))
    assert spec_of(again) == spec_of(lm)
    again.set_weights(lm.get_weights())
    np.testing.assert_allclose(to_numpy(again(tokens)), expected, atol=1e-6)
    path = str(tmp_path / "moe.keras")
    lm.save(path)
    loaded = keras.saving.load_model(path)
    np.testing.assert_allclose(to_numpy(loaded(tokens)), expected, atol=1e-6)


def test_fit_lowers_the_loss_and_records_the_load():
    model = moe_decoder_lm()
    model.compile(
        keras.optimizers.Adam(0.01),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    tokens = random_ids(12, 6, seed=4)
    history = model.fit(tokens, tokens, epochs=4, batch_size=4, verbose=0)
    losses = history.history["loss"]
    assert losses[-1] < losses[0]
    load = to_numpy(model.get_layer("transformer_layer_0").feedforward.expert_load)
    np.testing.assert_allclose(load.sum(), 4 * 6 * 2)  # the last batch's
    model(tokens, training=True)
    assert len(model.losses) == 4  # two losses in each of two blocks


def test_aux_losses_reach_the_training_loss():
    """The same weights with and without the losses: `train_on_batch`'s
    loss (before its update) differs by the blocks' added losses."""
    tokens = random_ids(4, 6, seed=5)
    with_losses = moe_decoder_lm(1.0, 1.0)
    with_losses(tokens, training=True)
    added = sum(float(to_numpy(loss)) for loss in with_losses.losses)
    results = []
    for model in (moe_decoder_lm(0.0, 0.0), with_losses):
        model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(True))
        results.append(model.train_on_batch(tokens, tokens))
    np.testing.assert_allclose(results[1] - results[0], added, rtol=1e-4)


def test_encoder_and_decoder_config_round_trip():
    x = random_floats(2, 5, WIDTH, seed=6)
    moe = MixtureOfExperts(3, 8, 2, router="top_k_softmax", use_bias=True)
    for cls in (TransformerEncoder, TransformerDecoder):
        block = cls(None, 2, feedforward=moe)
        expected = to_numpy(block(x))
        again = cls(**block.get_config())
        again.build(x.shape)
        again.set_weights(block.get_weights())
        np.testing.assert_allclose(to_numpy(again(x)), expected, atol=1e-6)
        assert block.get_config()["feedforward"]["class_name"] == "MixtureOfExperts"


def test_block_equals_moe_in_its_residual():
    """Pre-norm block: `x + attention` then `h + MoE(norm(h))`."""
    x = keras.ops.convert_to_tensor(random_floats(2, 5, WIDTH, seed=7))
    block = TransformerEncoder(
        None, 2, normalize_first=True, feedforward=MixtureOfExperts(3, 8, 2)
    )
    out = to_numpy(block(x))
    h, _, _ = block._attention_residual(
        x, block.self_attention, (block.self_attention_layer_norm, None), False, False
    )
    expected = h + block.feedforward(block.feedforward_layer_norm(h))
    np.testing.assert_allclose(out, to_numpy(expected), atol=1e-6)


def test_block_lora_adapts_the_attention_only():
    x = random_floats(2, 5, WIDTH, seed=8)
    block = TransformerDecoder(None, 2, feedforward=MixtureOfExperts(3, 8, 2))
    block(x)
    block.enable_lora(2)
    names = sorted(w.path for w in block.trainable_weights)
    assert len(names) == 8 and all("self_attention" in n for n in names)
    assert all("lora" in n for n in names)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(intermediate_dim=None), "intermediate_dim"),
        (dict(gated_feedforward=True, feedforward=MOE), "gated_feedforward=True"),
        (dict(use_feedforward_bias=False, feedforward=MOE), "use_feedforward_bias"),
    ],
)
def test_block_refuses(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TransformerDecoder(**{"intermediate_dim": 8, "num_heads": 2, **kwargs})


def test_block_refuses_another_layer():
    with pytest.raises(TypeError, match="feedforward.*Dense"):
        TransformerDecoder(8, 2, feedforward=keras.layers.Dense(4))


def test_block_checks_width_after_build():
    block = TransformerEncoder(None, 2, feedforward=MOE)
    block(random_floats(1, 3, WIDTH))
    with pytest.raises(ValueError, match="width"):
        block(random_floats(1, 3, WIDTH + 2))
