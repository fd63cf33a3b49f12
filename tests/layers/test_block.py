"""What both Transformer blocks share (keras_attn/layers/_block.py): the same
numbers as keras-hub's blocks with keras-hub's weights, dropout on every
branch, gates, sliding windows and attention biases passed through, and the
biases of W_O and the feed-forward by their own options."""

import numpy as np
import pytest

import keras_attn
from keras_attn import TransformerDecoder, TransformerEncoder
from tests.helpers.backend import to_numpy
from tests.helpers.builders import random_floats
from tests.helpers.references import masking_bias

TOLERANCE = {"atol": 1e-5, "rtol": 1e-5}


HUB_BLOCK = {"intermediate_dim": 24, "num_heads": 4, "activation": "gelu"}


def hub_twins(name, normalize_first, *inputs):
    """keras-hub's block and ours with keras-hub's weights."""
    keras_hub = pytest.importorskip("keras_hub")
    kwargs = {**HUB_BLOCK, "normalize_first": normalize_first}
    theirs = getattr(keras_hub.layers, name)(**kwargs)
    ours = {
        "TransformerEncoder": TransformerEncoder,
        "TransformerDecoder": TransformerDecoder,
    }[name](**kwargs)
    theirs(*inputs)
    ours(*inputs)
    ours.set_weights(theirs.get_weights())
    return ours, theirs


@pytest.mark.parametrize("normalize_first", [False, True])
def test_encoder_same_numbers_as_keras_hub(normalize_first):
    x = random_floats(3, 5, 12, seed=1)
    padding = np.arange(5)[None] < np.array([[5], [3], [1]])
    ours, theirs = hub_twins("TransformerEncoder", normalize_first, x)
    expected = to_numpy(theirs(x, padding_mask=padding))
    np.testing.assert_allclose(
        to_numpy(ours(x, padding_mask=padding)), expected, **TOLERANCE
    )


@pytest.mark.parametrize("normalize_first", [False, True])
@pytest.mark.parametrize("cross", [False, True], ids=["decoder-only", "cross"])
def test_decoder_same_numbers_as_keras_hub(normalize_first, cross):
    x, memory = random_floats(3, 5, 12, seed=1), random_floats(3, 7, 12, seed=2)
    inputs = (x, memory) if cross else (x,)
    ours, theirs = hub_twins("TransformerDecoder", normalize_first, *inputs)
    masks = {"decoder_padding_mask": np.arange(5)[None] < np.array([[5], [3], [1]])}
    if cross:
        masks["encoder_padding_mask"] = np.arange(7)[None] < np.array([[7], [4], [2]])
    expected = to_numpy(theirs(*inputs, **masks))
    np.testing.assert_allclose(to_numpy(ours(*inputs, **masks)), expected, **TOLERANCE)


@pytest.mark.parametrize("block", [TransformerEncoder, TransformerDecoder])
def test_dropout_in_training_reaches_every_branch(block):
    """keras-hub's `test_training_propagation`: with dropout ~1, each residual
    branch vanishes and post-norm leaves the layer norms of the input."""
    layer = block(4, 2, dropout=0.99999)
    x = random_floats(1, 4, 6)
    output = to_numpy(layer(x, training=True))
    expected = layer.feedforward_layer_norm(layer.self_attention_layer_norm(x))
    np.testing.assert_allclose(output, to_numpy(expected), atol=1e-5)


@pytest.mark.parametrize("block", [TransformerEncoder, TransformerDecoder])
@pytest.mark.parametrize(
    ("dropout", "training", "called"),
    [(0.0, True, False), (0.5, False, False), (0.5, True, True)],
)
def test_dropout_layer_is_called_only_where_it_drops(
    block, dropout, training, called, monkeypatch
):
    """A Keras layer call is ~0.1 ms of Python in eager steps, so the blocks
    call their `Dropout` only in training with a rate > 0."""
    layer = block(4, 2, dropout=dropout)
    x = random_floats(1, 4, 6)
    layer(x)
    calls = []
    call = layer._dropout_layer.call
    monkeypatch.setattr(
        layer._dropout_layer, "call", lambda *a, **k: calls.append(1) or call(*a, **k)
    )
    layer(x, training=training)
    assert bool(calls) == called


def block_twins(block, inputs, **options):
    """`block` with `options` and a plain twin with the same weights."""
    special, plain = block(16, 4, **options), block(16, 4)
    special(*inputs)
    plain(*inputs)
    if not options.get("use_gate"):
        plain.set_weights(special.get_weights())
    return special, plain


@pytest.mark.parametrize("block", [TransformerEncoder, TransformerDecoder])
def test_sliding_window_in_the_blocks_equals_its_band_mask(block):
    x = random_floats(2, 6, 8)
    windowed, plain = block_twins(block, (x,), sliding_window=2)
    band = np.broadcast_to(
        to_numpy(keras_attn.ops.sliding_window_mask(6, 6, 2)), (2, 6, 6)
    )
    mask = {
        TransformerEncoder: "attention_mask",
        TransformerDecoder: "decoder_attention_mask",
    }
    np.testing.assert_allclose(
        to_numpy(windowed(x)), to_numpy(plain(x, **{mask[block]: band})), **TOLERANCE
    )
    assert windowed.get_config()["sliding_window"] == 2


def test_use_gate_gives_every_attention_sublayer_a_gate():
    x, memory = random_floats(2, 3, 8), random_floats(2, 5, 8)
    decoder = TransformerDecoder(16, 2, use_gate=True)
    decoder(x, memory)
    assert decoder.self_attention.gate_dense is not None
    assert decoder.cross_attention.gate_dense is not None
    assert len(decoder.weights) == 26 + 4  # keras-hub's 26, and two gates


def test_attention_biases_reach_each_attention_sublayer():
    x, memory = random_floats(2, 5, 8, seed=1), random_floats(2, 7, 8, seed=2)
    rng = np.random.default_rng(0)
    self_mask = rng.random((2, 1, 5, 5)) > 0.3
    cross_mask = rng.random((2, 1, 5, 7)) > 0.3
    self_mask[..., 0] = cross_mask[..., 0] = True
    encoder = TransformerEncoder(16, 4)
    np.testing.assert_allclose(
        to_numpy(encoder(x, attention_bias=masking_bias(self_mask))),
        to_numpy(encoder(x, attention_mask=self_mask[:, 0])),
        **TOLERANCE,
    )
    decoder = TransformerDecoder(16, 4)
    biased = decoder(
        x,
        memory,
        decoder_attention_bias=masking_bias(self_mask),
        encoder_attention_bias=masking_bias(cross_mask),
    )
    masked = decoder(
        x,
        memory,
        decoder_attention_mask=self_mask[:, 0],
        encoder_attention_mask=cross_mask[:, 0],
    )
    np.testing.assert_allclose(to_numpy(biased), to_numpy(masked), **TOLERANCE)


# --- Biases by sublayer: use_output_bias, use_feedforward_bias ----------------

FEEDFORWARD = ("intermediate", "gate", "output")
QKV = ("query", "key", "value")


def bias_paths(block):
    """The paths below `block` of its biases and norm offsets."""
    paths = [w.path.split("/", 1)[1] for w in block.weights]
    return {p for p in paths if p.endswith(("/bias", "/beta"))}


@pytest.mark.parametrize("block", [TransformerEncoder, TransformerDecoder])
def test_output_and_feedforward_biases_follow_their_own_options(block):
    """Qwen2's layout (`use_output_bias=False, use_feedforward_bias=False`):
    query, key and value biases, none on W_O or the feed-forward matrices,
    the layer norms' offsets kept; Llama's `mlp_bias=True` (`use_bias=False,
    use_feedforward_bias=True`): the feed-forward biases alone."""
    x, memory = random_floats(2, 3, 8), random_floats(2, 5, 8, seed=1)
    inputs = (x,) if block is TransformerEncoder else (x, memory)
    attentions = ("self_attention",) + (("cross_attention",) if len(inputs) > 1 else ())
    norms = {f"{a}_layer_norm/beta" for a in attentions}
    norms.add("feedforward_layer_norm/beta")
    projections = {f"{a}/{p}/bias" for a in attentions for p in QKV}
    feedforward = {f"feedforward_{d}_dense/bias" for d in FEEDFORWARD}
    options = dict(gated_feedforward=True)
    qwen = block(16, 4, use_output_bias=False, use_feedforward_bias=False, **options)
    qwen(*inputs)
    assert bias_paths(qwen) == projections | norms
    assert qwen.self_attention.output_dense.bias is None
    mlp_bias = block(16, 4, use_bias=False, use_feedforward_bias=True, **options)
    mlp_bias(*inputs)
    assert bias_paths(mlp_bias) == feedforward
    full = block(16, 4, **options)
    full(*inputs)
    outputs = {f"{a}/attention_output/bias" for a in attentions}
    assert bias_paths(full) == projections | norms | feedforward | outputs
    assert len(full.weights) == len(qwen.weights) + len(outputs) + len(feedforward)


BIAS_LAYOUTS = {
    "qwen2": dict(use_output_bias=False, use_feedforward_bias=False),
    "llama-attention-bias": dict(use_feedforward_bias=False),
    "llama-mlp-bias": dict(use_bias=False, use_feedforward_bias=True),
    "output-bias-only": dict(use_bias=False, use_output_bias=True),
}


@pytest.mark.parametrize("layout", list(BIAS_LAYOUTS))
@pytest.mark.parametrize("block", [TransformerEncoder, TransformerDecoder])
def test_a_missing_bias_computes_as_a_zero_one(block, layout):
    """A block with `layout` gives the outputs of a block with every bias
    (random weights) whose extra biases and norm offsets are zeroed, and
    the biases they share copied: each bias is where its options say and
    nowhere else."""
    x, memory = random_floats(2, 5, 8), random_floats(2, 7, 8, seed=1)
    inputs = (x,) if block is TransformerEncoder else (x, memory)
    options = dict(gated_feedforward=True, num_key_value_heads=2)
    special = block(16, 4, **options, **BIAS_LAYOUTS[layout])
    full = block(16, 4, **options)
    special(*inputs)
    full(*inputs)
    kept = {w.path.split("/", 1)[1]: w for w in special.weights}
    zeroed = []
    for seed, weight in enumerate(full.weights):
        name = weight.path.split("/", 1)[1]
        value = random_floats(*weight.shape, seed=seed, scale=0.5)
        if name in kept:
            kept.pop(name).assign(value)
        else:  # a bias or an offset the layout leaves out
            assert name.endswith(("/bias", "/beta")), name
            value = np.zeros(weight.shape, "float32")
            zeroed.append(name)
        weight.assign(value)
    assert zeroed and not kept  # the layout drops some; every weight has a twin
    np.testing.assert_allclose(
        to_numpy(special(*inputs)), to_numpy(full(*inputs)), **TOLERANCE
    )
