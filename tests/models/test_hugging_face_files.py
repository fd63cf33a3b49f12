"""`from_hugging_face` on bad or unusual folders and files: a missing or
unreadable file, an unreadable index or a missing shard, a tensor that does
not match the config each raise a clear error before any weight is read; the
layouts transformers also reads (sharded files, a single file beside shards,
a tied head's stored copy, GPT-2's original hub names) load to transformers'
logits. `to_hugging_face`: each argument refused (a folder holding a
checkpoint left as it was), a model no config describes, and the tensors'
dtype.

Each tiny folder is written once per module and copied per test."""

import json
import os
import shutil

import keras
import numpy as np
import pytest

import keras_attn
from keras_attn.models import from_hugging_face, to_hugging_face
from tests.helpers.hugging_face import (
    TINY,
    VOCABULARY,
    assert_same_logits,
    edit_config,
    edit_tensors,
    our_logits,
    reference_model,
    their_logits,
    write_tiny,
)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_numpy = pytest.importorskip("safetensors.numpy")
safe_open = pytest.importorskip("safetensors").safe_open


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """name: (folder, transformers model), each written once."""
    names = ("llama", "gpt2")
    return {name: write_tiny(tmp_path_factory, name, *TINY[name]) for name in names}


def test_the_no_read_guard_catches_a_load(saved, no_weight_reads):
    """The guard the error tests use does see a load's reads."""
    with pytest.raises(pytest.fail.Exception, match="read the weight"):
        from_hugging_face(saved["llama"][0])


# --- Folders and files ----------------------------------------------------------


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


# --- Shards ---------------------------------------------------------------------


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


def test_a_folder_with_the_single_file_and_shards_reads_the_single_file(
    saved, sharded, tmp_path
):
    """transformers reads model.safetensors where a folder also holds an
    index and its shards: here the shards of one model (the tiny Llama) and
    the file of another (its weights halved)."""
    folder = shutil.copytree(sharded[0], tmp_path / "both")
    file = os.path.join(saved["llama"][0], "model.safetensors")
    halved = {
        name: value * np.float32(0.5)
        for name, value in safetensors_numpy.load_file(file).items()
    }
    safetensors_numpy.save_file(
        halved, folder / "model.safetensors", metadata={"format": "pt"}
    )
    logits = our_logits(folder)
    assert_same_logits(logits, their_logits(folder))
    shards = our_logits(sharded[0])
    assert np.abs(logits - shards).max() > 1e-2 * np.abs(shards).max()


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
    gpt2 = TINY["gpt2"][1]
    positions = gpt2["n_positions"]
    mask = np.tril(np.ones((positions, positions), "float32"))[None, None]

    def hub_layout(tensors):
        for name in list(tensors):
            tensors[name.removeprefix("transformer.")] = tensors.pop(name)
        for layer in range(gpt2["n_layer"]):
            tensors[f"h.{layer}.attn.bias"] = mask
            tensors[f"h.{layer}.attn.masked_bias"] = np.array(-1e4, "float32")

    folder = edit_tensors(copy("gpt2"), hub_layout)
    assert "h.0.attn.c_attn.weight" in safetensors_numpy.load_file(
        folder / "model.safetensors"
    )
    logits = our_logits(folder)
    np.testing.assert_array_equal(logits, our_logits(saved["gpt2"][0]))
    assert_same_logits(logits, their_logits(folder))


# --- to_hugging_face's arguments and folder --------------------------------------


@pytest.fixture(scope="module")
def llama(saved):
    """The tiny Llama loaded, to write back."""
    return from_hugging_face(saved["llama"][0])


def test_to_hugging_face_needs_a_keras_model(tmp_path):
    with pytest.raises(TypeError, match=r"`model` must be a keras.Model .*: str\."):
        to_hugging_face("x", tmp_path / "out", max_position_embeddings=64)
    assert not os.path.exists(tmp_path / "out")


def test_to_hugging_face_needs_a_path(llama):
    with pytest.raises(TypeError, match=r"`path` must be a folder .*Received: int\."):
        to_hugging_face(llama, 3, max_position_embeddings=64)


@pytest.mark.parametrize(
    "held", ["config.json", "model.safetensors", "model.safetensors.index.json"]
)
def test_to_hugging_face_leaves_a_checkpoint_alone(held, llama, tmp_path):
    """A new model.safetensors beside old files would be read as either."""
    (tmp_path / held).write_text("old")
    with pytest.raises(
        ValueError, match=rf"already holds a checkpoint \(\['{held}'\]\)"
    ):
        to_hugging_face(llama, tmp_path, max_position_embeddings=64)
    assert os.listdir(tmp_path) == [held]
    assert (tmp_path / held).read_text() == "old"


def test_a_bfloat16_model_is_written_in_bfloat16(saved, tmp_path):
    """dtype=None: the variables' dtype, in the tensors and the config."""
    model = from_hugging_face(saved["llama"][0], dtype="bfloat16")
    assert {keras.backend.standardize_dtype(w.dtype) for w in model.weights} == {
        "bfloat16"
    }
    to_hugging_face(model, tmp_path, max_position_embeddings=64)
    with open(tmp_path / "config.json") as handle:
        assert json.load(handle)["dtype"] == "bfloat16"
    with safe_open(tmp_path / "model.safetensors", framework="numpy") as file:
        dtypes = {file.get_slice(name).get_dtype() for name in file.keys()}
    assert dtypes == {"BF16"}
    theirs = reference_model(tmp_path)
    assert theirs.dtype == torch.bfloat16


@pytest.mark.parametrize("limit", [None, 0, 64.0])
def test_a_rotary_model_needs_max_position_embeddings(limit, llama, tmp_path):
    """Rotary weights do not say the context length: the caller's config does."""
    with pytest.raises(
        ValueError,
        match=rf"`max_position_embeddings` must be .* Received: "
        rf"max_position_embeddings={limit!r}\.",
    ):
        to_hugging_face(llama, tmp_path / "out", max_position_embeddings=limit)
    assert not os.path.exists(tmp_path / "out")


def test_gpt2_with_another_context_than_its_table(saved, tmp_path):
    model = from_hugging_face(saved["gpt2"][0])
    with pytest.raises(
        ValueError,
        match=r"GPT-2's context is its position table's length, 48\. "
        r"Received: max_position_embeddings=64\.",
    ):
        to_hugging_face(model, tmp_path / "out", max_position_embeddings=64)
    assert not os.path.exists(tmp_path / "out")


def test_a_layer_norm_model_whose_final_norm_has_no_offset(tmp_path):
    """GPT-2's blocks, learned positions, and a final layer norm without
    an offset: GPT-2's config cannot say that; a ValueError names it."""
    block = dict(
        intermediate_dim=32,
        num_heads=2,
        normalize_first=True,
        normalization="layer_norm",
        activation=keras_attn.models.gelu_approximate,
        layer_norm_epsilon=1e-5,
    )
    spec = keras_attn.models.DecoderLMSpec(
        vocabulary_size=VOCABULARY,
        hidden_dim=16,
        blocks=(block,),
        normalization="layer_norm",
        layer_norm_epsilon=1e-5,
        use_bias=False,
        positions=16,
    )
    model = keras_attn.models.decoder_lm(spec)
    with pytest.raises(
        ValueError, match=r"gpt2: it would compute with \{'use_bias': \(False, True\)\}"
    ):
        to_hugging_face(model, tmp_path / "out")
    assert not os.path.exists(tmp_path / "out")
