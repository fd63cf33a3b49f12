"""`keras_attn.distribution` and training on several devices.

The layout rules are checked in this process, on every backend. Training on
several devices runs in subprocesses, so that this process keeps its one device:

- `python -m tests.integration.test_distribution jax OUT`: 8 virtual CPU
  devices, `keras.distribution` (which places arrays on JAX only), in the JAX
  run;
- `python -m tests.integration.test_distribution tensorflow OUT`: 2 logical
  CPU devices, `tf.distribute.MirroredStrategy`, in the TensorFlow run.

Each writes its numbers to OUT once per session; the tests check them.
"""

import json
import os
import re
import sys
from pathlib import Path

import keras
import numpy as np
import pytest

import keras_attn
from keras_attn.distribution import get_layout_map
from keras_attn.models import DecoderLMSpec, decoder_lm
from tests.helpers.backend import BACKEND
from tests.helpers.processes import ROOT, finish_process, start_process, stop_process

VOCAB, WIDTH, HEADS, INTERMEDIATE = 13, 16, 4, 24
SOURCE_LENGTH, TARGET_LENGTH, BATCH, STEPS = 7, 5, 8, 3
MESH = (2, 4)  # ("batch", "model")

# The layout of every keras_attn weight, by the end of its path, written out
# independently of keras_attn/distribution.py.
EXPECTED = {
    "query/kernel": (None, "model", None),
    "key/kernel": (None, "model", None),
    "value/kernel": (None, "model", None),
    "gate/kernel": (None, "model", None),
    "query/bias": ("model", None),
    "key/bias": ("model", None),
    "value/bias": ("model", None),
    "gate/bias": ("model", None),
    "attention_output/kernel": ("model", None, None),
    "attention_output/bias": (None,),
    "feedforward_intermediate_dense/kernel": (None, "model"),
    "feedforward_intermediate_dense/bias": ("model",),
    "feedforward_gate_dense/kernel": (None, "model"),
    "feedforward_gate_dense/bias": ("model",),
    "feedforward_output_dense/kernel": ("model", None),
    "feedforward_output_dense/bias": (None,),
    "embeddings": (None, "model"),
    **{
        f"{sublayer}_{norm}/{weight}": (None,)
        for sublayer in ("self_attention", "cross_attention", "feedforward")
        for norm in ("layer_norm", "output_norm")
        for weight in ("gamma", "beta", "scale")
    },
    "query_norm/scale": (None,),
    "key_norm/scale": (None,),
    # MixtureOfExperts: E stacked experts, each split over its F units.
    "intermediate_kernel": (None, None, "model"),  # (E, D, F)
    "gate_kernel": (None, None, "model"),
    "output_kernel": (None, "model", None),  # (E, F, D)
    "intermediate_bias": (None, "model"),  # (E, F)
    "gate_bias": (None, "model"),
    "output_bias": (None, None),  # (E, D)
    "router/kernel": (None, None),
    "router/bias": (None,),
    "score_correction_bias": (None,),
    "expert_load": (None,),
    "shared_intermediate_dense/kernel": (None, "model"),
    "shared_intermediate_dense/bias": ("model",),
    "shared_gate_dense/kernel": (None, "model"),
    "shared_gate_dense/bias": ("model",),
    "shared_output_dense/kernel": ("model", None),
    "shared_output_dense/bias": (None,),
}
# The stacked expert weights split over an expert axis: the model axis itself
# (whose F split it replaces), an axis of its own, or the batch axis.
EXPERTS_OVER = {
    "model": {
        "intermediate_kernel": ("model", None, None),
        "gate_kernel": ("model", None, None),
        "output_kernel": ("model", None, None),
        "intermediate_bias": ("model", None),
        "gate_bias": ("model", None),
        "output_bias": ("model", None),
    },
    "expert": {
        "intermediate_kernel": ("expert", None, "model"),
        "gate_kernel": ("expert", None, "model"),
        "output_kernel": ("expert", "model", None),
        "intermediate_bias": ("expert", "model"),
        "gate_bias": ("expert", "model"),
        "output_bias": ("expert", None),
    },
    "batch": {  # Fully sharded: the batch axis splits E, so D stays whole.
        "intermediate_kernel": ("batch", None, "model"),
        "gate_kernel": ("batch", None, "model"),
        "output_kernel": ("batch", "model", None),
        "intermediate_bias": ("batch", "model"),
        "gate_bias": ("batch", "model"),
        "output_bias": ("batch", None),
    },
}
KEY_VALUE = re.compile(r".*/(key|value)/(kernel|bias)")


def expected_axes(path):
    """The layout of a keras_attn weight; `None` for the Dense head."""
    if path.startswith("logits/"):
        return None
    (end,) = [end for end in EXPECTED if path.endswith("/" + end)]
    return EXPECTED[end]


def fake_mesh(model_axis, data_axis=1, expert_axis=None):
    """A mesh for building layout maps (no array is placed on its devices):
    `(batch, model)`, or `(batch, expert, model)` with an `expert_axis`."""
    shape = (data_axis, model_axis)
    names = ["batch", "model"]
    if expert_axis is not None:
        shape, names = (
            (data_axis, expert_axis, model_axis),
            ["batch", "expert", "model"],
        )
    devices = [f"cpu:{i}" for i in range(int(np.prod(shape)))]
    return keras.distribution.DeviceMesh(shape, names, devices=devices)


def experts(num_experts=4, intermediate_dim=8):
    """A MixtureOfExperts with every kind of weight: biases, a router bias,
    DeepSeek's score correction, a shared expert."""
    return keras_attn.layers.MixtureOfExperts(
        num_experts,
        intermediate_dim,
        top_k=2,
        use_bias=True,
        router="sigmoid",
        use_router_bias=True,
        use_score_correction_bias=True,
        num_shared_experts=1,
        name="feedforward",
    )


def encoder_decoder(
    num_key_value_heads=None,
    heads=HEADS,
    width=WIDTH,
    names=(),
    use_gate=False,
    sparse=None,
):
    """Embeddings, an encoder, a cross-attending decoder, a Dense head; with
    `sparse` (a MixtureOfExperts), a decoder block with it as its feed-forward
    network before the head.

    The layers are named, so that every build has the same variable paths.
    """
    names = {
        "source": "source_embedding",
        "target": "target_embedding",
        "encoder": "encoder",
        "decoder": "decoder",
        **dict(names),
    }
    block = dict(
        intermediate_dim=INTERMEDIATE,
        num_heads=heads,
        num_key_value_heads=num_key_value_heads,
        use_gate=use_gate,
    )
    embedding = dict(embedding_dim=width, vocabulary_size=VOCAB, mask_zero=True)
    source = keras.Input((None,), dtype="int32", name="source")
    target = keras.Input((None,), dtype="int32", name="target")
    x = keras_attn.SinusoidalEmbedding(**embedding, name=names["source"])(source)
    x = keras_attn.TransformerEncoder(**block, name=names["encoder"])(x)
    y = keras_attn.SinusoidalEmbedding(**embedding, name=names["target"])(target)
    y = keras_attn.TransformerDecoder(**block, name=names["decoder"])(y, x)
    if sparse is not None:
        block.update(intermediate_dim=None, feedforward=sparse)
        y = keras_attn.TransformerDecoder(**block, name="sparse_decoder")(y)
    logits = keras.layers.Dense(VOCAB, name="logits")(y)
    return keras.Model([source, target], logits, name="translator")


def batch():
    """Fixed token ids, padded (id 0) at some ends, and next-token labels."""
    rng = np.random.default_rng(0)
    source = rng.integers(1, VOCAB, (BATCH, SOURCE_LENGTH)).astype("int32")
    target = rng.integers(1, VOCAB, (BATCH, TARGET_LENGTH + 1)).astype("int32")
    source[::2, -2:] = 0
    target[1::2, -2:] = 0
    return (source, target[:, :-1]), target[:, 1:]


def sparse_lm():
    """A decoder-only language model: one pre-norm block whose feed-forward
    network is `experts()`."""
    block = dict(
        intermediate_dim=None,
        num_heads=HEADS,
        normalization="rms_norm",
        normalize_first=True,
        rope_max_wavelength=10000.0,
        feedforward=keras.saving.serialize_keras_object(experts()),
    )
    spec = DecoderLMSpec(vocabulary_size=VOCAB, hidden_dim=WIDTH, blocks=(block,))
    return decoder_lm(spec, name="sparse_lm")


def lm_batch():
    """Fixed token ids and their next tokens."""
    tokens = np.random.default_rng(1).integers(1, VOCAB, (BATCH, TARGET_LENGTH + 1))
    return tokens[:, :-1].astype("int32"), tokens[:, 1:].astype("int32")


def train(model, initial_weights, fit=False, data=None):
    """`STEPS` SGD steps on `data` (`batch()` by default) from
    `initial_weights`; the losses.

    `train_on_batch`, or `fit` (one batch per epoch), which is what splits the
    batch over the replicas of a `tf.distribute` strategy.
    """
    model.set_weights(initial_weights)
    model.compile(
        optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    inputs, labels = data or batch()
    if fit:
        history = model.fit(
            inputs, labels, batch_size=BATCH, epochs=STEPS, shuffle=False, verbose=0
        )
        return history.history["loss"]
    return [float(model.train_on_batch(inputs, labels)) for _ in range(STEPS)]


def to_numpy(weights):
    return [keras.ops.convert_to_numpy(w) for w in weights]


def keras_attn_weights(model):
    return [w for w in model.weights if not w.path.startswith("logits/")]


# In this process, on every backend: the rules.


def test_every_keras_attn_weight_matches_exactly_one_rule():
    model = encoder_decoder(use_gate=True, sparse=experts())
    layout_map = get_layout_map(fake_mesh(4))
    for weight in model.weights:
        matches = [key for key in layout_map if re.fullmatch(key, weight.path)]
        # Older Keras matched keys with `re.search`: the same matches.
        assert matches == [key for key in layout_map if re.search(key, weight.path)]
        layout = layout_map[weight.path]  # Raises if several keys match.
        if weight.path.startswith("logits/"):  # Keras' Dense: replicated.
            assert matches == [] and layout is None
            continue
        assert len(matches) == 1, (weight.path, matches)
        assert layout.axes == expected_axes(weight.path), weight.path
        assert len(layout.axes) == len(weight.shape), weight.path


def modern_decoder(use_bias=True):
    """A cross-attending decoder with RMS norms, a gated network, QK-norms and
    sublayer output norms."""
    decoder = keras_attn.TransformerDecoder(
        INTERMEDIATE,
        HEADS,
        normalization="rms_norm",
        gated_feedforward=True,
        normalize_qk=True,
        normalize_sublayer_outputs=True,
        use_bias=use_bias,
        name="decoder",
    )
    decoder(np.zeros((1, 3, WIDTH)), np.zeros((1, 4, WIDTH)))
    return decoder


def test_every_rule_matches_one_kind_of_weights():
    weights = keras_attn_weights(encoder_decoder(use_gate=True, sparse=experts()))
    weights += modern_decoder().weights
    output_norms = keras_attn.TransformerDecoder(
        INTERMEDIATE, HEADS, normalize_sublayer_outputs=True, name="output_norms"
    )  # layer norms: gamma and beta
    output_norms(np.zeros((1, 3, WIDTH)), np.zeros((1, 4, WIDTH)))
    weights += output_norms.weights
    layout_map = get_layout_map(fake_mesh(4))
    for key in layout_map:
        ends = {
            next(e for e in EXPECTED if w.path.endswith("/" + e))
            for w in weights
            if re.fullmatch(key, w.path)
        }
        assert len(ends) == 1, (key, ends)


def test_rules_match_whatever_the_layers_are_called():
    layout_map = get_layout_map(fake_mesh(4))
    names = {"source": "a", "target": "query", "encoder": "x-1", "decoder": "key"}
    for weight in keras_attn_weights(encoder_decoder(names=names)):
        assert layout_map[weight.path].axes == expected_axes(weight.path)


@pytest.mark.parametrize("use_bias", [False, True])
def test_rules_for_the_options_of_modern_families(use_bias):
    """RMS norms, a gated feed-forward network, QK-norms and output norms
    (LLaMA, Gemma 2 and 3)."""
    layout_map = get_layout_map(fake_mesh(4))
    for weight in modern_decoder(use_bias).weights:
        matches = [key for key in layout_map if re.fullmatch(key, weight.path)]
        assert len(matches) == 1, (weight.path, matches)
        assert layout_map[weight.path].axes == expected_axes(weight.path)


@pytest.mark.parametrize("layer_cls", ["keras_attn", "keras"])
def test_gated_attention_without_biases_and_keras_own_layer(layer_cls):
    """A gate, no biases; Keras' layer has the same sublayers, so the same rules."""
    layout_map = get_layout_map(fake_mesh(4))
    cls = {
        "keras_attn": keras_attn.MultiHeadAttention,
        "keras": keras.layers.MultiHeadAttention,
    }[layer_cls]
    attention = cls(4, key_dim=2, use_bias=False, use_gate=True, name="attention")
    attention(np.zeros((1, 3, 8)), np.zeros((1, 3, 8)))
    assert [(w.path, layout_map[w.path].axes) for w in attention.weights] == [
        ("attention/query/kernel", (None, "model", None)),
        ("attention/key/kernel", (None, "model", None)),
        ("attention/gate/kernel", (None, "model", None)),
        ("attention/value/kernel", (None, "model", None)),
        ("attention/attention_output/kernel", ("model", None, None)),
    ]


def test_model_rules_are_the_exact_paths_of_its_keras_attn_weights():
    model = encoder_decoder()
    layout_map = get_layout_map(fake_mesh(4), model=model)
    assert sorted(layout_map) == sorted(w.path for w in keras_attn_weights(model))
    for weight in model.weights:
        layout = layout_map[weight.path]
        assert (layout and layout.axes) == expected_axes(weight.path), weight.path


def test_model_rules_escape_regex_characters_in_names():
    # (Not `.`, which PyTorch does not allow in parameter names.)
    names = {"source": "s+", "target": "t*", "encoder": "e(1)", "decoder": "d[0]"}
    layout_map = get_layout_map(fake_mesh(2), model=encoder_decoder(names=names))
    for weight in keras_attn_weights(encoder_decoder(names=names)):
        assert layout_map[weight.path].axes == expected_axes(weight.path)
    assert layout_map["ss/token_embedding/embeddings"] is None
    assert layout_map["ttt/token_embedding/embeddings"] is None


def test_grouped_query_key_values_are_replicated_when_heads_do_not_divide():
    model = encoder_decoder(num_key_value_heads=2)  # 4 query heads.
    layout_map = get_layout_map(fake_mesh(4), model=model)
    replicated = []
    for weight in keras_attn_weights(model):
        axes = layout_map[weight.path].axes
        if KEY_VALUE.fullmatch(weight.path):
            assert axes == (None,) * len(weight.shape), weight.path
            replicated.append(weight.path)
        else:
            assert axes == expected_axes(weight.path), weight.path
    assert len(replicated) == 12  # 3 attention layers, 2 kernels, 2 biases.
    # A model axis of 2 divides the 2 key/value heads: they are split.
    layout_map = get_layout_map(fake_mesh(2), model=model)
    for path in replicated:
        assert layout_map[path].axes == expected_axes(path), path


def intermediate_units_of_10():
    encoder = keras_attn.TransformerEncoder(10, 4, name="encoder")
    encoder(np.zeros((1, 3, 8)))
    return encoder


# Each row gives `get_layout_map(fake_mesh(2))` one bad argument, which must
# raise an error naming it and what was received. Callables are called first.
LAYOUT_ROWS = [
    pytest.param(
        {"device_mesh": (1, 2)},
        TypeError,
        r"`device_mesh` must be.*Received: device_mesh=\(1, 2\) of type tuple",
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
        {"shard_weights_over_batch": "yes"},
        TypeError,
        r"`shard_weights_over_batch` must be a bool. Received: "
        r"shard_weights_over_batch='yes'",
        id="shard_weights_over_batch-type",
    ),
    pytest.param(
        {"shard_weights_over_batch": True, "data_parallel_dim_name": None},
        ValueError,
        r"`shard_weights_over_batch=True` .* `data_parallel_dim_name` must name "
        r"it. Received: data_parallel_dim_name=None",
        id="shard_weights_over_batch-without-batch-axis",
    ),
    pytest.param(
        {"model": lambda: keras_attn.TransformerEncoder(8, 2, name="encoder")},
        ValueError,
        r"`model` must be built.*'encoder', not built",
        id="model-unbuilt",
    ),
    pytest.param(
        {
            "model": lambda: encoder_decoder(heads=2),
            "device_mesh": lambda: fake_mesh(4),
        },
        ValueError,
        r"The model axis 'model' \(size 4\) must divide the heads of every "
        r"keras_attn layer: .* Received: weight "
        r"'encoder/self_attention/query/kernel' of shape \(16, 2, 8\), whose "
        r"dimension 1 \(heads\) is 2\. Use a model axis whose size divides 2",
        id="model-heads-indivisible",
    ),
    pytest.param(
        {
            "model": lambda: encoder_decoder(width=20),
            "device_mesh": lambda: fake_mesh(8),
        },
        ValueError,
        r"\(size 8\) .* Received: weight "
        r"'source_embedding/token_embedding/embeddings' of shape \(13, 20\), "
        r"whose dimension 1 \(embedding width\) is 20",
        id="model-embedding-width-indivisible",  # 4 heads of 5.
    ),
    pytest.param(
        {"model": intermediate_units_of_10, "device_mesh": lambda: fake_mesh(4)},
        ValueError,
        r"'encoder/feedforward_intermediate_dense/kernel' of shape \(8, 10\), "
        r"whose dimension 1 \(intermediate units\) is 10",
        id="model-intermediate-units-indivisible",
    ),
    pytest.param(
        {"expert_parallel_dim_name": "expert"},
        ValueError,
        r"`expert_parallel_dim_name` must name an axis of `device_mesh`.*"
        r"Received: expert_parallel_dim_name='expert', "
        r"device_mesh.axis_names=\['batch', 'model'\]",
        id="expert_parallel_dim_name",
    ),
    pytest.param(
        {
            "model": lambda: encoder_decoder(sparse=experts(num_experts=6)),
            "device_mesh": lambda: fake_mesh(4),
            "expert_parallel_dim_name": "model",
        },
        ValueError,
        r"`expert_parallel_dim_name` 'model' \(size 4\) must divide the "
        r"experts .* Received: weight "
        r"'sparse_decoder/feedforward/intermediate_kernel' of shape "
        r"\(6, 16, 8\), whose dimension 0 \(experts\) is 6\. Use an "
        r"expert axis whose size divides 6, or `expert_parallel_dim_name=None`",
        id="model-experts-indivisible",
    ),
    pytest.param(
        {
            "model": lambda: encoder_decoder(sparse=experts(intermediate_dim=6)),
            "device_mesh": lambda: fake_mesh(4),
        },
        ValueError,
        r"The model axis 'model' \(size 4\) .* Received: weight "
        r"'sparse_decoder/feedforward/intermediate_kernel' of shape "
        r"\(4, 16, 6\), whose dimension 2 \(intermediate units\) is 6",
        id="model-expert-intermediate-units-indivisible",
    ),
]


@pytest.mark.parametrize("kwargs, error, match", LAYOUT_ROWS)
def test_bad_layout_map_argument(kwargs, error, match):
    kwargs = {k: v() if callable(v) else v for k, v in kwargs.items()}
    with pytest.raises(error, match=match):
        get_layout_map(**{"device_mesh": fake_mesh(2), **kwargs})


def test_mesh_with_a_model_axis_only():
    mesh = keras.distribution.DeviceMesh((2,), ["tensor"], devices=["cpu:0", "cpu:1"])
    layout_map = get_layout_map(
        mesh, model_parallel_dim_name="tensor", data_parallel_dim_name=None
    )
    layout = layout_map["encoder/self_attention/attention_output/kernel"]
    assert layout.axes == ("tensor", None, None)


# Expert parallelism: the stacked expert weights split over an expert axis.
# name: (mesh, expert axis, fully sharded).
EXPERT_MESHES = {
    "model": (lambda: fake_mesh(2, 2), "model", False),
    "expert": (lambda: fake_mesh(2, 2, expert_axis=2), "expert", False),
    "batch": (lambda: fake_mesh(2, 2), "batch", True),
}


@pytest.mark.parametrize("axis", EXPERT_MESHES)
@pytest.mark.parametrize("exact", [False, True], ids=["regex", "model"])
def test_experts_split_over_an_expert_axis(axis, exact):
    make_mesh, expert_axis, fully_sharded = EXPERT_MESHES[axis]
    model = encoder_decoder(use_gate=True, sparse=experts())
    layout_map = get_layout_map(
        make_mesh(),
        model=model if exact else None,
        shard_weights_over_batch=fully_sharded,
        expert_parallel_dim_name=expert_axis,
    )
    split = 0
    for weight in keras_attn_weights(model):
        end = weight.path.split("/")[-1]
        if end in EXPERTS_OVER[axis]:
            expected = EXPERTS_OVER[axis][end]
            split += 1
        elif fully_sharded:
            expected = fully_sharded_axes(weight.path)
            if exact and end == "embeddings":  # 13 rows stay whole.
                expected = (None, "model")
        else:
            expected = expected_axes(weight.path)
        assert layout_map[weight.path].axes == expected, weight.path
    assert split == 6


# Fully sharded (`shard_weights_over_batch=True`): the batch axis also splits
# the model width, or the head size of projection biases and the rows of
# token embeddings; written out independently of keras_attn/distribution.py.
FULLY_SHARDED = {
    **{f"{p}/kernel": ("batch", "model", None) for p in ("query", "key", "value")},
    "gate/kernel": ("batch", "model", None),
    **{f"{p}/bias": ("model", "batch") for p in ("query", "key", "value", "gate")},
    "attention_output/kernel": ("model", None, "batch"),
    "attention_output/bias": ("batch",),
    "feedforward_intermediate_dense/kernel": ("batch", "model"),
    "feedforward_intermediate_dense/bias": ("model",),
    "feedforward_gate_dense/kernel": ("batch", "model"),
    "feedforward_gate_dense/bias": ("model",),
    "feedforward_output_dense/kernel": ("model", "batch"),
    "feedforward_output_dense/bias": ("batch",),
    "embeddings": ("batch", "model"),
    **{end: ("batch",) for end, axes in EXPECTED.items() if axes == (None,)},
    # The experts' model width; their own E-sized weights stay whole.
    "intermediate_kernel": (None, "batch", "model"),
    "gate_kernel": (None, "batch", "model"),
    "output_kernel": (None, "model", "batch"),
    "intermediate_bias": (None, "model"),
    "gate_bias": (None, "model"),
    "output_bias": (None, "batch"),
    "router/kernel": ("batch", None),
    "router/bias": (None,),
    "score_correction_bias": (None,),
    "expert_load": (None,),
    "shared_intermediate_dense/kernel": ("batch", "model"),
    "shared_intermediate_dense/bias": ("model",),
    "shared_gate_dense/kernel": ("batch", "model"),
    "shared_gate_dense/bias": ("model",),
    "shared_output_dense/kernel": ("model", "batch"),
}


def fully_sharded_axes(path):
    (end,) = [end for end in FULLY_SHARDED if path.endswith("/" + end)]
    return FULLY_SHARDED[end]


def test_fully_sharded_rules_split_every_weight_over_the_batch_axis_too():
    layout_map = get_layout_map(fake_mesh(2, 2), shard_weights_over_batch=True)
    weights = keras_attn_weights(encoder_decoder(use_gate=True, sparse=experts()))
    for weight in weights + modern_decoder().weights:
        assert layout_map[weight.path].axes == fully_sharded_axes(weight.path)
    assert layout_map["translator/logits/kernel"] is None  # Not keras_attn's.


def test_fully_sharded_model_rules_cover_other_layers_and_odd_sizes():
    model = encoder_decoder()  # A vocabulary of 13: odd embedding rows.
    layout_map = get_layout_map(
        fake_mesh(2, 2), model=model, shard_weights_over_batch=True
    )
    assert sorted(layout_map) == sorted(w.path for w in model.weights)
    for weight in keras_attn_weights(model):
        expected = fully_sharded_axes(weight.path)
        if weight.path.endswith("embeddings"):  # 13 rows stay whole.
            expected = (None, "model")
        assert layout_map[weight.path].axes == expected, weight.path
    # The Dense head, `(16, 13)` and `(13,)`: its largest even dimension.
    assert layout_map["logits/kernel"].axes == ("batch", None)
    assert layout_map["logits/bias"].axes == (None,)
    # A batch axis of 1 divides everything; a model axis of 1 too.
    layout_map = get_layout_map(
        fake_mesh(1, 1), model=model, shard_weights_over_batch=True
    )
    assert layout_map["logits/bias"].axes == ("batch",)


# Subprocesses: training on several devices.

JAX_ONLY = pytest.mark.skipif(
    BACKEND != "jax",
    reason="keras.distribution places arrays on JAX only: the multi-device "
    "subprocesses run once, in the JAX run of the suite",
)


def start(args, **env):
    """A Python subprocess in the repository root, on CPU devices only."""
    return start_process(args, cwd=ROOT, **env)


def finish(process):
    return finish_process(process, timeout=600)


def results_in(out):
    return json.loads((out / "results.json").read_text()), np.load(out / "arrays.npz")


@pytest.fixture(scope="module")
def jax_processes(tmp_path_factory):
    """The 8-device checks, started when the first of their tests needs them."""
    out = tmp_path_factory.mktemp("jax_8_devices")
    flags = os.environ.get("XLA_FLAGS", "")
    checks = start(
        ["-m", "tests.integration.test_distribution", "jax", out],
        KERAS_BACKEND="jax",
        XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count=8",
    )
    yield {"out": out, "checks": checks}
    if checks.poll() is None:  # Its tests were deselected.
        stop_process(checks)


@pytest.fixture(scope="module")
def jax_run(jax_processes):
    finish(jax_processes["checks"])
    out = jax_processes["out"]
    return (out, *results_in(out))


def assert_same_training(results, arrays, name, reference="single"):
    np.testing.assert_allclose(
        results[name]["losses"], results[reference]["losses"], rtol=1e-5, atol=1e-5
    )
    for i, path in enumerate(results["paths"]):
        np.testing.assert_allclose(
            arrays[f"{name}/{i}"],
            arrays[f"{reference}/{i}"],
            rtol=1e-5,
            atol=1e-5,
            err_msg=path,
        )


@pytest.mark.processes
@JAX_ONLY
def test_data_parallel_on_8_devices_trains_like_one_device(jax_run):
    _, results, arrays = jax_run
    assert_same_training(results, arrays, "data")
    assert results["losses_decrease"]
    for path, spec in results["data"]["specs"].items():
        assert spec == [None] * len(spec), path  # Replicated.


@pytest.mark.processes
@JAX_ONLY
def test_model_parallel_on_2x4_devices_trains_like_one_device(jax_run):
    _, results, arrays = jax_run
    assert_same_training(results, arrays, "model")


@pytest.mark.processes
@JAX_ONLY
def test_model_parallel_shards_weights_and_optimizer_variables(jax_run):
    _, results, _ = jax_run
    specs = results["model"]["specs"]
    assert set(specs) == set(results["paths"])
    for path, spec in specs.items():
        expected = expected_axes(path) or (None,) * len(spec)
        assert spec == list(expected), path
    momentums = results["model"]["momentum_specs"]
    assert momentums and all(momentums[path] == specs[path] for path in momentums)


@pytest.mark.processes
@JAX_ONLY
def test_grouped_query_model_rules_on_2x4_devices(jax_run):
    _, results, _ = jax_run
    grouped = results["grouped_query"]
    for path, spec in grouped["specs"].items():
        if KEY_VALUE.fullmatch(path):
            assert spec == [None] * len(spec), path  # 2 key/value heads, 4 devices.
        else:
            assert spec == list(expected_axes(path) or (None,) * len(spec)), path
    assert grouped["max_difference"] < 1e-5


@pytest.mark.processes
@JAX_ONLY
def test_model_trained_in_parallel_loads_on_one_device(jax_run):
    out, _, arrays = jax_run
    assert keras.distribution.distribution() is None
    model = keras.models.load_model(out / "model_parallel.keras")
    for i, weight in enumerate(model.weights):
        np.testing.assert_array_equal(
            keras.ops.convert_to_numpy(weight), arrays[f"model/{i}"]
        )
    inputs, _ = batch()
    np.testing.assert_allclose(
        model.predict(inputs, batch_size=BATCH, verbose=0),
        arrays["model/predictions"],
        rtol=1e-5,
        atol=1e-5,
    )


# Experts over 8 devices: name: (mesh shape, axis names, expert axis).
SPARSE_RUNS = {
    "experts_over_model": ((2, 4), ["batch", "model"], "model"),
    "experts_and_units": ((2, 2, 2), ["batch", "expert", "model"], "expert"),
}


@pytest.mark.processes
@JAX_ONLY
@pytest.mark.parametrize("name", SPARSE_RUNS)
def test_experts_split_over_devices_train_like_one_device(jax_run, name):
    """`fit` with `expert_parallel_dim_name`: each device holds its experts
    (and, on a mesh of 3 axes, its share of their units), and training gives
    the numbers of one device."""
    _, results, arrays = jax_run
    sparse = results["sparse"]
    assert_same_training(sparse, arrays, name, reference="sparse_single")
    losses = sparse["sparse_single"]["losses"]
    assert losses[-1] < losses[0]
    expected = EXPERTS_OVER[SPARSE_RUNS[name][2]]
    split = 0
    for path, spec in sparse[name]["specs"].items():
        end = path.split("/")[-1]
        if end in expected:
            assert spec == list(expected[end]), path
            split += 1
        elif "/router/" in path:
            assert spec == [None] * len(spec), path
    assert split == 6  # The stacked weights.


@pytest.mark.processes
@pytest.mark.skipif(
    BACKEND != "tensorflow",
    reason="tf.distribute needs the TensorFlow backend; runs in its run of the suite",
)
def test_mirrored_strategy_on_2_devices_trains_like_one_device(tmp_path):
    process = start(
        ["-m", "tests.integration.test_distribution", "tensorflow", tmp_path]
    )
    finish(process)
    results, arrays = results_in(tmp_path)
    assert results["mirrored"]["replicas"] == 2
    assert "Mirrored" in results["mirrored"]["variable_type"]
    assert_same_training(results, arrays, "mirrored")


# The subprocesses:
# `python -m tests.integration.test_distribution jax|tensorflow OUT`.


def spec(variable):
    """A JAX variable's sharding spec as a list; `None` on a single device."""
    sharding = variable.value.sharding
    return list(sharding.spec) if hasattr(sharding, "spec") else None


def jax_on_8_devices(out):
    """One device, `DataParallel` on 8, `ModelParallel` on 2 x 4 devices."""
    assert len(keras.distribution.list_devices()) == 8
    keras.utils.set_random_seed(0)
    initial = to_numpy(encoder_decoder().weights)
    mesh = keras.distribution.DeviceMesh(MESH, ["batch", "model"])
    runs = {
        "single": None,
        "data": keras.distribution.DataParallel(),
        "model": keras.distribution.ModelParallel(
            layout_map=get_layout_map(mesh), batch_dim_name="batch"
        ),
    }
    results, arrays = {}, {}
    inputs, _ = batch()
    for name, distribution in runs.items():
        keras.distribution.set_distribution(distribution)
        model = encoder_decoder()
        results[name] = {"losses": train(model, initial)}
        arrays.update({f"{name}/{i}": w for i, w in enumerate(to_numpy(model.weights))})
        results[name]["specs"] = {w.path: spec(w) for w in model.weights}
        results[name]["momentum_specs"] = {
            w.path: spec(m)
            for w, m in zip(
                model.trainable_weights, model.optimizer.momentums, strict=True
            )
        }
    # Trained under `ModelParallel`: its predictions, and the file.
    arrays["model/predictions"] = model.predict(inputs, batch_size=BATCH, verbose=0)
    model.save(out / "model_parallel.keras")
    results["paths"] = [w.path for w in model.weights]
    results["losses_decrease"] = (
        results["single"]["losses"][-1] < results["single"]["losses"][0]
    )
    results["grouped_query"] = grouped_query_on(mesh)
    results["sparse"], sparse_arrays = sparse_on_8_devices()
    arrays.update(sparse_arrays)
    (out / "results.json").write_text(json.dumps(results))
    np.savez(out / "arrays.npz", **arrays)


def grouped_query_on(mesh):
    """Rules from `model=`: 2 key/value heads on a model axis of 4."""
    keras.distribution.set_distribution(None)
    keras.utils.set_random_seed(1)
    single = encoder_decoder(num_key_value_heads=2)
    inputs, _ = batch()
    expected = single.predict(inputs, batch_size=BATCH, verbose=0)
    layout_map = get_layout_map(mesh, model=single)
    distribution = keras.distribution.ModelParallel(
        layout_map=layout_map, batch_dim_name="batch"
    )
    with distribution.scope():
        model = encoder_decoder(num_key_value_heads=2)
        model.set_weights(single.get_weights())
        predictions = model.predict(inputs, batch_size=BATCH, verbose=0)
    return {
        "specs": {w.path: spec(w) for w in model.weights},
        "max_difference": float(np.max(np.abs(predictions - expected))),
    }


def sparse_on_8_devices():
    """`sparse_lm` trained by `fit` on one device, then with its experts split
    over each mesh of `SPARSE_RUNS`."""
    keras.distribution.set_distribution(None)
    keras.utils.set_random_seed(2)
    initial = to_numpy(sparse_lm().weights)
    results, arrays = {}, {}
    for name in ["sparse_single", *SPARSE_RUNS]:
        distribution = None
        if name in SPARSE_RUNS:
            shape, axes, expert_axis = SPARSE_RUNS[name]
            mesh = keras.distribution.DeviceMesh(shape, axes)
            layout_map = get_layout_map(mesh, expert_parallel_dim_name=expert_axis)
            distribution = keras.distribution.ModelParallel(
                layout_map=layout_map, batch_dim_name="batch"
            )
        keras.distribution.set_distribution(distribution)
        model = sparse_lm()
        results[name] = {
            "losses": train(model, initial, fit=True, data=lm_batch()),
            "specs": {w.path: spec(w) for w in model.weights},
        }
        arrays.update({f"{name}/{i}": w for i, w in enumerate(to_numpy(model.weights))})
    results["paths"] = [w.path for w in model.weights]
    keras.distribution.set_distribution(None)
    return results, arrays


def tensorflow_on_2_devices(out):
    """One device, then `MirroredStrategy` on 2 logical CPU devices."""
    import tensorflow as tf

    # Before TensorFlow initializes its devices (no op has run yet).
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * 2
    )
    keras.utils.set_random_seed(0)
    single = encoder_decoder()
    initial = to_numpy(single.weights)
    results = {"single": {"losses": train(single, initial, fit=True)}}
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
        mirrored = encoder_decoder()
        results["mirrored"] = {
            "losses": train(mirrored, initial, fit=True),
            "replicas": strategy.num_replicas_in_sync,
            "variable_type": type(mirrored.weights[0].value).__name__,
        }
    results["paths"] = [w.path for w in single.weights]
    arrays = {}
    for name, model in (("single", single), ("mirrored", mirrored)):
        arrays.update({f"{name}/{i}": w for i, w in enumerate(to_numpy(model.weights))})
    (out / "results.json").write_text(json.dumps(results))
    np.savez(out / "arrays.npz", **arrays)


if __name__ == "__main__":
    kind, out = sys.argv[1], Path(sys.argv[2])
    {"jax": jax_on_8_devices, "tensorflow": tensorflow_on_2_devices}[kind](out)
