"""Tiny seeded transformers models, the reference for checkpoint folders,
and the one closeness rule their logits are held to; the tiny folders the
error modules (`test_hugging_face_files`, `test_hugging_face_configs`) alter,
with their editors and a guard against reading weights."""

import json
import os

import numpy as np
import pytest

from keras_attn.models import from_hugging_face
from keras_attn.models.hugging_face import _files
from tests.helpers.backend import BACKEND, to_numpy

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
GEMMA = dict(LLAMA, hidden_size=16, head_dim=8)
# name: (transformers config class, its arguments), the tiny folders altered.
TINY = {
    "llama": ("LlamaConfig", LLAMA),
    "gpt2": (
        "GPT2Config",
        dict(vocab_size=VOCABULARY, n_embd=16, n_layer=2, n_head=2, n_positions=48),
    ),
    "gemma2": (
        "Gemma2Config",
        dict(
            GEMMA,
            sliding_window=4,
            attn_logit_softcapping=3.0,
            final_logit_softcapping=5.0,
            query_pre_attn_scalar=12,
        ),
    ),
}
# Longer than every tiny window, so a window changes the logits.
TOKENS = np.random.default_rng(2).integers(1, VOCABULARY, (2, 11)).astype("int32")
DELETE = object()
EXACT = dict(attn_implementation="eager")  # see `reference_model`


def tiny_causal_lm(config_class, dtype="float32", **kwargs):
    """A seeded transformers causal LM of `config_class` (a name in
    `transformers`), in eval mode, with weights large enough (N(0, 0.3))
    that every config option changes the logits."""
    import torch
    import transformers

    config = getattr(transformers, config_class)(**kwargs)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, **EXACT)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for weight in model.parameters():
            weight.copy_(torch.randn(weight.shape, generator=generator) * 0.3)
    return model.to(getattr(torch, dtype)).eval()


def transformers_logits(model, token_ids):
    """A transformers model's float32 logits of int `token_ids`, as numpy."""
    import torch

    with torch.no_grad():
        logits = model(torch.as_tensor(np.asarray(token_ids), dtype=torch.long)).logits
    return logits.float().numpy()


def assert_same_logits(actual, expected):
    """Within 1e-4 of the reference's largest |logit| (float32)."""
    scale = np.abs(expected).max()
    np.testing.assert_allclose(actual, expected, rtol=0, atol=1e-4 * scale)


def write_tiny(tmp_path_factory, name, config_class, kwargs):
    """`(folder, model)`: a tiny transformers model (`tiny_causal_lm`)
    written by `save_pretrained` in a new folder named after `name`."""
    model = tiny_causal_lm(config_class, **kwargs)
    folder = tmp_path_factory.mktemp(name)
    model.save_pretrained(folder)
    return folder, model


def forbid_weight_reads(monkeypatch):
    """Fail the test if any tensor's data is read: errors come first."""

    def read(self, name, start=None, stop=None):
        pytest.fail(f"read the weight {name} before the error")

    monkeypatch.setattr(_files.Checkpoint, "read", read)


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
    from safetensors import numpy as safetensors_numpy

    file = os.path.join(folder, "model.safetensors")
    tensors = safetensors_numpy.load_file(file)
    edit(tensors)
    safetensors_numpy.save_file(tensors, file, metadata={"format": "pt"})
    return folder


def reference_model(folder, **kwargs):
    """transformers' causal LM of `folder`, in eval mode, computing attention
    in its eager (written-out) form: the SDPA form drops Gemma 2's logit
    soft-cap in transformers <= 5.17 (`_supports_sdpa` was True there; an
    H100 run with 5.17 failed our Gemma 2 tests on that alone)."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        folder, **EXACT, **kwargs
    ).eval()


def their_logits(folder, token_ids=TOKENS):
    """The logits of transformers' model of `folder`."""
    return transformers_logits(reference_model(folder), token_ids)


def our_logits(folder, token_ids=TOKENS):
    """The logits of `from_hugging_face(folder)` in float32."""
    return model_logits(from_hugging_face(folder, dtype="float32"), token_ids)


def model_logits(model, token_ids=TOKENS):
    """A Keras model's logits of `token_ids`, as numpy."""
    if BACKEND == "jax":  # one compiled call beats compiling each op (2.5x)
        return model.predict(token_ids, verbose=0)
    return to_numpy(model(token_ids))


# Prompts of two lengths, left-padded with 0, for greedy comparisons.
LEFT_PADDED = np.array([[0, 0, 0, 5, 9, 14, 3], [7, 11, 4, 8, 21, 30, 6]], "int32")
# TensorFlow decodes the small models faster eagerly than compiling each (51 s
# against 66 s for the 12 dense families); the compiled loops are tested in
# tests/generation.
GREEDY_JIT = False if BACKEND == "tensorflow" else "auto"


def write_folders(tmp_path_factory, families, make):
    """family: `(folder, model)`, each `make(family)` (a transformers model)
    written by `save_pretrained` once."""
    written = {}
    for family in families:
        model = make(family)
        folder = str(tmp_path_factory.mktemp(family))
        model.save_pretrained(folder)
        written[family] = folder, model
    return written


def assert_same_greedy(model, reference, new_tokens):
    """Our greedy tokens for `LEFT_PADDED` are transformers' `reference`'s."""
    import torch

    import keras_attn

    tokens = keras_attn.generation.generate(
        model, LEFT_PADDED, max_new_tokens=new_tokens, jit_compile=GREEDY_JIT
    )
    ids = torch.as_tensor(LEFT_PADDED, dtype=torch.long)
    with torch.no_grad():
        theirs = reference.generate(
            ids,
            attention_mask=(ids != 0).long(),
            max_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
        )
    np.testing.assert_array_equal(
        np.asarray(tokens)[:, LEFT_PADDED.shape[1] :],
        theirs[:, LEFT_PADDED.shape[1] :].numpy(),
    )
