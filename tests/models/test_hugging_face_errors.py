"""`from_hugging_face` on bad or unusual folders: a missing or unreadable file,
an unknown family, a config entry nobody computes, a tensor that does not match
the config each raise a clear error before any weight is read; the layouts
transformers also reads (transformers 4's `rope_scaling`, sharded files, a tied
head's stored copy, GPT-2's original hub names) load to transformers' logits.

Each tiny folder is written once per module and copied per test."""

import json
import os
import shutil

import keras
import numpy as np
import pytest

from keras_attn.models import from_hugging_face
from keras_attn.models.hugging_face import _files
from tests.helpers.backend import BACKEND, to_numpy
from tests.helpers.hugging_face import (
    assert_same_logits,
    tiny_causal_lm,
    transformers_logits,
)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_numpy = pytest.importorskip("safetensors.numpy")

VOCABULARY = 61
LLAMA = dict(
    vocab_size=VOCABULARY,
    hidden_size=24,
    intermediate_size=40,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
GPT2 = dict(vocab_size=VOCABULARY, n_embd=16, n_layer=2, n_head=2, n_positions=48)
GEMMA2 = dict(
    LLAMA,
    hidden_size=16,
    head_dim=8,
    sliding_window=4,
    attn_logit_softcapping=3.0,
    final_logit_softcapping=5.0,
    query_pre_attn_scalar=12,
)
TOKENS = np.random.default_rng(2).integers(1, VOCABULARY, (2, 11)).astype("int32")
LINEAR_ROPE = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
FAMILIES_WE_LOAD = (
    "gemma", "gemma2", "gemma3_text", "gpt2", "llama",
    "mistral", "phi3", "qwen2", "qwen3", "smollm3",
)  # fmt: skip


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """name: (folder, transformers model), each written once."""
    models = {
        "llama": tiny_causal_lm("LlamaConfig", **LLAMA),
        "gpt2": tiny_causal_lm("GPT2Config", **GPT2),
        "gemma2": tiny_causal_lm("Gemma2Config", **GEMMA2),
    }
    written = {}
    for name, model in models.items():
        folder = tmp_path_factory.mktemp(name)
        model.save_pretrained(folder)
        written[name] = str(folder), model
    return written


@pytest.fixture
def copy(saved, tmp_path):
    """`copy(name)`: a fresh copy of the saved folder `name` to alter."""

    def make(name, to="copy"):
        return shutil.copytree(saved[name][0], tmp_path / to)

    return make


@pytest.fixture
def no_weight_reads(monkeypatch):
    """Fail the test if any tensor's data is read: errors come first."""

    def read(self, name):
        pytest.fail(f"read the weight {name} before the error")

    monkeypatch.setattr(_files.Checkpoint, "read", read)


DELETE = object()


def edit_config(folder, **changes):
    """Set config.json's entries; a value of `DELETE` deletes the entry
    (`None` writes null: transformers reads the two differently)."""
    file = os.path.join(folder, "config.json")
    with open(file) as handle:
        config = json.load(handle)
    for key, value in changes.items():
        if value is DELETE:
            config.pop(key, None)
        else:
            config[key] = value
    with open(file, "w") as handle:
        json.dump(config, handle)
    return folder


def edit_tensors(folder, edit):
    """Rewrite model.safetensors with `edit(tensors)` (a dict, in place)."""
    file = os.path.join(folder, "model.safetensors")
    tensors = safetensors_numpy.load_file(file)
    edit(tensors)
    safetensors_numpy.save_file(tensors, file, metadata={"format": "pt"})
    return folder


def their_logits(folder):
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    return transformers_logits(model, TOKENS)


def our_logits(folder):
    model = from_hugging_face(folder, dtype="float32")
    if BACKEND == "jax":  # one compiled call beats compiling each op (2.5x)
        return model.predict(TOKENS, verbose=0)
    return to_numpy(model(TOKENS))


# --- Files ----------------------------------------------------------------------


def test_the_no_read_guard_catches_a_load(saved, no_weight_reads):
    """The guard the error tests use does see a load's reads."""
    with pytest.raises(pytest.fail.Exception, match="read the weight"):
        from_hugging_face(saved["llama"][0])


@pytest.mark.parametrize(
    "where, error, message",
    [
        ("nowhere", FileNotFoundError, "does not exist. Nothing is download"),
        ("hub/name", FileNotFoundError, "does not exist. Nothing is download"),
        ("a_file", ValueError, "the checkpoint folder, not a file"),
    ],
)
def test_a_path_that_is_not_a_folder(where, error, message, tmp_path, no_weight_reads):
    (tmp_path / "a_file").write_text("{}")
    path = str(tmp_path / where) if where != "hub/name" else "meta-llama/Llama-2-7b"
    with pytest.raises(error, match=message):
        from_hugging_face(path)


@pytest.mark.parametrize("path", [3, None, b"/tmp", ["folder"]])
def test_a_path_of_another_type(path):
    with pytest.raises(TypeError, match=r"`path` must be a local folder .* of type"):
        from_hugging_face(path)


def test_a_folder_without_config(copy, no_weight_reads):
    folder = copy("llama")
    os.remove(folder / "config.json")
    with pytest.raises(FileNotFoundError, match=r"has no config.json.*model.safet"):
        from_hugging_face(folder)


@pytest.mark.parametrize(
    "text, match",
    [
        ("{not json", "Cannot read .*config.json as JSON"),
        ("[1, 2]", "config.json must hold a JSON object"),
    ],
)
def test_a_config_that_is_not_a_json_object(text, match, copy, no_weight_reads):
    folder = copy("llama")
    (folder / "config.json").write_text(text)
    with pytest.raises(ValueError, match=match):
        from_hugging_face(folder)


def test_a_folder_without_weights(copy, no_weight_reads):
    folder = copy("llama")
    os.rename(folder / "model.safetensors", folder / "pytorch_model.bin")
    with pytest.raises(
        FileNotFoundError,
        match=r"lacks the weights file\(s\) \['model.safetensors'\].*pytorch_model",
    ):
        from_hugging_face(folder)


@pytest.mark.parametrize("damage", ["garbage", "truncated", "empty"])
def test_a_corrupt_safetensors_file(damage, copy, no_weight_reads):
    folder = copy("llama")
    file = folder / "model.safetensors"
    data = file.read_bytes()
    damaged = {
        "garbage": b"\x07not a safetensors file" * 8,
        "truncated": data[: len(data) // 2],
        "empty": b"",
    }[damage]
    file.write_bytes(damaged)
    with pytest.raises(ValueError, match="Cannot read .*model.safetensors as safet"):
        from_hugging_face(folder)


@pytest.fixture(scope="module")
def sharded(saved, tmp_path_factory):
    """The tiny Llama written in shards of at most 20 KB."""
    folder = tmp_path_factory.mktemp("sharded")
    saved["llama"][1].save_pretrained(folder, max_shard_size="20KB")
    shards = sorted(f for f in os.listdir(folder) if f.startswith("model-"))
    assert len(shards) > 2 and not os.path.exists(folder / "model.safetensors")
    return folder, shards


def test_a_sharded_checkpoint_loads_as_the_single_file(saved, sharded):
    folder, _ = sharded
    single = our_logits(saved["llama"][0])
    np.testing.assert_array_equal(our_logits(folder), single)
    assert_same_logits(single, their_logits(saved["llama"][0]))


def test_an_index_naming_a_missing_shard(sharded, tmp_path, no_weight_reads):
    folder, shards = sharded
    folder = shutil.copytree(folder, tmp_path / "copy")
    os.remove(folder / shards[1])
    with pytest.raises(FileNotFoundError, match=rf"lacks .*\['{shards[1]}'\]"):
        from_hugging_face(folder)


@pytest.mark.parametrize(
    "index, match",
    [
        ("{oops", "Cannot read .*index.json as JSON"),
        ('{"metadata": {}}', "index.json has no `weight_map`"),
    ],
)
def test_an_unreadable_index(index, match, sharded, tmp_path, no_weight_reads):
    folder = shutil.copytree(sharded[0], tmp_path / "copy")
    (folder / "model.safetensors.index.json").write_text(index)
    with pytest.raises(ValueError, match=match):
        from_hugging_face(folder)


# --- Families and config entries ------------------------------------------------


@pytest.mark.parametrize("model_type", ["bert", None])
def test_an_unknown_model_type_lists_ours(model_type, copy, no_weight_reads):
    folder = edit_config(copy("llama"), model_type=model_type)
    with pytest.raises(ValueError, match=f"Received: model_type={model_type!r}") as e:
        from_hugging_face(folder)
    for family in FAMILIES_WE_LOAD:
        assert repr(family) in str(e.value)


def test_a_config_entry_nobody_reads(copy, no_weight_reads):
    folder = edit_config(copy("llama"), new_option=3)
    with pytest.raises(ValueError, match=r"entries \['new_option'\] \(values \[3\]"):
        from_hugging_face(folder)


# (folder, config changes, the error's words)
REFUSED = {
    "dynamic rope": (
        "llama",
        dict(rope_parameters={**LINEAR_ROPE, "rope_type": "dynamic"}),
        r"rope_parameters=\{'rope_type': 'dynamic'.*dynamic NTK",
    ),
    "longrope": (
        "llama",
        dict(
            rope_parameters=dict(
                rope_type="longrope",
                rope_theta=1e4,
                short_factor=[1.0] * 3,
                long_factor=[2.0] * 3,
                original_max_position_embeddings=16,
            )
        ),
        r"rope_type': 'longrope'.*no per-channel factors",
    ),
    "an unknown rope type": (
        "llama",
        dict(rope_parameters={**LINEAR_ROPE, "rope_type": "su"}),
        "rope_type 'su' is not one of",
    ),
    "partial rotary factor in rope_parameters": (
        "llama",
        dict(rope_parameters={**LINEAR_ROPE, "partial_rotary_factor": 0.5}),
        "partial_rotary_factor=0.5: keras_attn rotates every channel",
    ),
    "partial rotary factor at the top": (
        "llama",
        dict(partial_rotary_factor=0.5),
        "partial_rotary_factor=0.5: keras_attn rotates every channel",
    ),
    "DeepSeek's yarn mscale ratio": (
        "llama",
        dict(
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=1e4,
                factor=4.0,
                original_max_position_embeddings=16,
                mscale=1.0,
                mscale_all_dim=1.0,
            )
        ),
        r"YaRN scales cos and sin by 0.1 ln\(factor\) \+ 1 .* asks for 1.0 with",
    ),
    "a yarn attention factor of its own": (
        "llama",
        dict(
            rope_parameters=dict(
                rope_type="yarn", rope_theta=1e4, factor=4.0, attention_factor=1.5
            )
        ),
        "asks for 1.5 with factor 4.0",
    ),
    "an unknown rope key": (
        "llama",
        dict(rope_parameters={**LINEAR_ROPE, "low_freq_factor": 1.0}),
        r"its entries \['low_freq_factor'\] are not computed here",
    ),
    "rope_parameters and rope_scaling": (
        "llama",
        dict(rope_scaling={"type": "linear", "factor": 2.0}),
        "rope_scaling=.*the config also has `rope_parameters`",
    ),
    "an unknown hidden_act": (
        "llama",
        dict(hidden_act="mish"),
        r"hidden_act='mish': the activations loaded are \[",
    ),
    "an unknown GPT-2 activation": (
        "gpt2",
        dict(activation_function="quick_gelu"),
        "activation_function='quick_gelu'",
    ),
    "GPT-2 scaled by the inverse layer index": (
        "gpt2",
        dict(scale_attn_by_inverse_layer_idx=True),
        "scale_attn_by_inverse_layer_idx=True: keras_attn's GPT-2 has "
        "scale_attn_by_inverse_layer_idx=False",
    ),
    "GPT-2 unscaled attention": (
        "gpt2",
        dict(scale_attn_weights=False),
        "scale_attn_weights=False",
    ),
    "GPT-2 with cross-attention": (
        "gpt2",
        dict(add_cross_attention=True),
        "add_cross_attention=True",
    ),
    "GPT-2 with its own head": (
        "gpt2",
        dict(tie_word_embeddings=False),
        "tie_word_embeddings=False: GPT-2's head is its token table",
    ),
    "GPT-2 dropping residuals at another rate": (
        "gpt2",
        dict(resid_pdrop=0.3),
        r"resid_pdrop=0.3: our blocks drop at one rate \(0.1\)",
    ),
    "Gemma attending both ways": (
        "gemma2",
        dict(use_bidirectional_attention=True),
        "use_bidirectional_attention=True: a causal LM attends causally",
    ),
    "Gemma 2 with a hidden_act it does not read": (
        "gemma2",
        dict(hidden_act="silu"),
        "hidden_act='silu': the gemma2 model reads `hidden_activation` alone",
    ),
    "layer types of the wrong count": (
        "gemma2",
        dict(layer_types=["full_attention"]),
        "layer_types=.*expected 2 of 'full_attention'/'sliding_attention'",
    ),
    "sliding layers without a window": (
        "gemma2",
        dict(sliding_window=None, layer_types=["sliding_attention"] * 2),
        "sliding layers need a `sliding_window`",
    ),
}


@pytest.mark.parametrize("case", REFUSED)
def test_a_config_entry_we_cannot_compute_is_refused(case, copy, no_weight_reads):
    name, changes, match = REFUSED[case]
    folder = edit_config(copy(name), **changes)
    with pytest.raises(ValueError, match=f"cannot load .*{match}"):
        from_hugging_face(folder)


def test_transformers_4_rope_scaling_is_honoured(copy, saved):
    """`rope_theta` + `rope_scaling={"type": ...}` computes what transformers
    5's `rope_parameters` computes, and the scaling does change the logits."""
    old = edit_config(
        copy("llama", "old"),
        rope_parameters=DELETE,
        rope_theta=10000.0,
        rope_scaling={"type": "linear", "factor": 2.0},
    )
    new = edit_config(copy("llama", "new"), rope_parameters=LINEAR_ROPE)
    logits = our_logits(old)
    np.testing.assert_array_equal(logits, our_logits(new))
    assert_same_logits(logits, their_logits(old))
    unscaled = our_logits(saved["llama"][0])
    assert np.abs(logits - unscaled).max() > 1e-2 * np.abs(unscaled).max()


SCALED_ROPE = {
    "yarn": dict(
        rope_parameters=dict(
            rope_type="yarn", rope_theta=1e4, factor=4.0,
            original_max_position_embeddings=8, beta_fast=8.0, beta_slow=1.0,
        ),
    ),
    # Phi-3's layout: transformers prefers the length beside the dict.
    "llama3 with the pretraining length at the top": dict(
        original_max_position_embeddings=16,
        rope_parameters=dict(
            rope_type="llama3", rope_theta=1e4, factor=4.0,
            original_max_position_embeddings=8,
            low_freq_factor=1.0, high_freq_factor=4.0,
        ),
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", SCALED_ROPE)
def test_scaled_rope_is_honoured(case, copy):
    folder = edit_config(copy("llama"), **SCALED_ROPE[case])
    assert_same_logits(our_logits(folder), their_logits(folder))


def test_gemma_in_bfloat16_variables_is_refused(saved, no_weight_reads):
    with pytest.raises(ValueError, match="Received: dtype='bfloat16'. Pass dtype="):
        from_hugging_face(saved["gemma2"][0], dtype="bfloat16")


def test_gemma_in_mixed_bfloat16_loads(saved):
    """float32 variables keep `1 + w` whole; the arithmetic is bfloat16."""
    folder = saved["gemma2"][0]
    model = from_hugging_face(folder, dtype="mixed_bfloat16")
    layers = [layer for layer in model.layers if layer.weights]
    assert {layer.dtype_policy.name for layer in layers} == {"mixed_bfloat16"}
    assert {keras.backend.standardize_dtype(v.dtype) for v in model.weights} == {
        "float32"
    }
    w = safetensors_numpy.load_file(os.path.join(folder, "model.safetensors"))
    w = w["model.layers.1.post_feedforward_layernorm.weight"]
    variables = {v.path: v for v in model.weights}
    scale = variables["transformer_layer_1/feedforward_output_norm/scale"]
    np.testing.assert_array_equal(to_numpy(scale), w + np.float32(1.0))


# --- Tensors against the config -------------------------------------------------


def _drop(name):
    return lambda tensors: tensors.pop(name)


def _put(name, value):
    return lambda tensors: tensors.__setitem__(name, value)


Q = "model.layers.0.self_attn.q_proj.weight"
BAD_TENSORS = {
    "missing": (_drop(Q), rf"missing {Q} of shape \(24, 24\)"),
    "extra": (
        _put("model.layers.0.self_attn.rotary.weight", np.ones(3, "float32")),
        r"tensors the config does not use: \['model.layers.0.self_attn.rotary",
    ),
    "wrong shape": (
        _put(Q, np.ones((24, 23), "float32")),
        rf"{Q} has shape \(24, 23\), the config implies \(24, 24\)",
    ),
    "int": (_put(Q, np.ones((24, 24), "int32")), f"{Q} is I32, not a float tensor"),
}


@pytest.mark.parametrize("case", BAD_TENSORS)
def test_a_tensor_that_does_not_match_the_config(case, copy, no_weight_reads):
    edit, match = BAD_TENSORS[case]
    folder = edit_tensors(copy("llama"), edit)
    with pytest.raises(ValueError, match=f"do not match its config.json: .*{match}"):
        from_hugging_face(folder)


def test_a_config_that_does_not_match_the_tensors(copy, no_weight_reads):
    """Every tensor the config resizes is named."""
    folder = edit_config(copy("llama"), intermediate_size=48)
    with pytest.raises(ValueError, match=r"config implies \(48, 24\)") as error:
        from_hugging_face(folder)
    for layer in range(2):
        for part in ("gate", "up", "down"):
            assert f"model.layers.{layer}.mlp.{part}_proj.weight" in str(error.value)


def test_a_tied_head_with_its_copy_stored(copy):
    """transformers ties the head to the token table when a stored
    `lm_head.weight` equals it (`.bin` conversions keep both)."""
    folder = edit_config(copy("llama"), tie_word_embeddings=True)

    def copy_the_table(tensors):
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()

    edit_tensors(folder, copy_the_table)
    tied = our_logits(folder)
    assert_same_logits(tied, their_logits(folder))
    edit_tensors(folder, _drop("lm_head.weight"))
    np.testing.assert_array_equal(our_logits(folder), tied)


def test_a_tied_head_with_another_head_stored(copy):
    """transformers keeps a stored head that differs from the table (it
    warns that the config is wrong): refused, with the fix."""
    folder = edit_config(copy("llama"), tie_word_embeddings=True)
    head = np.random.default_rng(3).standard_normal((VOCABULARY, 24))
    edit_tensors(folder, _put("lm_head.weight", head.astype("float32")))
    with pytest.raises(
        ValueError,
        match="tie_word_embeddings=True, but its lm_head.weight differs from "
        "model.embed_tokens.weight: transformers then keeps both. Set",
    ):
        from_hugging_face(folder)
    untied = edit_config(folder, tie_word_embeddings=False)
    assert_same_logits(our_logits(untied), their_logits(folder))


def test_gpt2_in_the_original_hub_layout(copy, saved):
    """Names without `transformer.` and the causal-mask buffers, as in the
    `gpt2` repository's model.safetensors."""
    positions = GPT2["n_positions"]
    mask = np.tril(np.ones((positions, positions), "float32"))[None, None]

    def hub_layout(tensors):
        for name in list(tensors):
            tensors[name.removeprefix("transformer.")] = tensors.pop(name)
        for layer in range(GPT2["n_layer"]):
            tensors[f"h.{layer}.attn.bias"] = mask
            tensors[f"h.{layer}.attn.masked_bias"] = np.array(-1e4, "float32")

    folder = edit_tensors(copy("gpt2"), hub_layout)
    assert "h.0.attn.c_attn.weight" in safetensors_numpy.load_file(
        folder / "model.safetensors"
    )
    logits = our_logits(folder)
    np.testing.assert_array_equal(logits, our_logits(saved["gpt2"][0]))
    assert_same_logits(logits, their_logits(folder))
