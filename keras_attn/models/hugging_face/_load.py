"""`from_hugging_face`: a checkpoint folder to a keras_attn model."""

import keras
import numpy as np

from keras_attn.layers.mixture_of_experts import state_paths
from keras_attn.models.decoder_lm import decoder_lm
from keras_attn.models.hugging_face._config import HFConfig
from keras_attn.models.hugging_face._files import (
    FLOAT_DTYPES,
    as_dtype,
    open_checkpoint,
)
from keras_attn.models.hugging_face._registry import FAMILIES, read_family
from keras_attn.models.hugging_face._sparse_families import mtp_layers


def from_hugging_face(path, dtype=None):
    """A Hugging Face checkpoint folder as a keras_attn language model.

    Reads a local folder (nothing is downloaded) holding `config.json` and
    safetensors weights (`model.safetensors`, or shards listed in
    `model.safetensors.index.json`; float32, float16 or bfloat16), and
    returns the functional `keras.Model` of `keras_attn.models.decoder_lm`:
    int token ids `(batch, length)` to logits `(batch, length, vocab)`, which
    `keras_attn.generation.generate` decodes with caches. Every number comes
    from `config.json`; an entry that changes the maths is computed or
    refused by name, so the model computes what transformers' model of the
    folder computes. The weights are read one tensor at a time into the
    built model's variables: loading holds the model and one tensor.

    Families (`model_type`): `gpt2`, `llama` (2, 3, 3.1's rope scaling, 3.2's
    tied head), `mistral`, `qwen2` (2 and 2.5), `qwen3`, `gemma`, `gemma2`,
    `gemma3_text`, `phi3`, `smollm3`, and the sparse ones: `mixtral`,
    `qwen3_moe`, `gpt_oss` (sink logits, clamped SwiGLU experts) and
    `deepseek_v3` (latent attention, grouped sigmoid routing, shared
    experts; its multi-token-prediction layers are skipped, as transformers
    skips them), whose feed-forward networks are
    `keras_attn.layers.MixtureOfExperts`. Rotary scaling: linear, llama3,
    yarn (gpt-oss's and DeepSeek's `mscale` included); dynamic NTK, longrope
    and partial rotary factors are refused.

    Args:
        path: str or os.PathLike. The checkpoint folder.
        dtype: the model's dtype policy (`"float32"`, `"bfloat16"`,
            `"mixed_bfloat16"`, ...). Defaults to `None`: Keras' global
            policy (`keras.config.dtype_policy()`), as for any Keras layer;
            the checkpoint's tensors are converted to it. Gemma needs float32
            variables (its norms hold `1 + w`): a mixed policy computes in
            bfloat16 on them.

    Returns:
        A `keras.Model`, its layers named as `decoder_lm` names them.

    Raises:
        FileNotFoundError: the folder, its config or weights are missing.
        ValueError: an unknown `model_type` (the message lists ours), a config
            entry we do not compute, or a tensor missing, left over or of
            another shape than the config says: each before any weight is
            read, and nothing half-built is returned.

    Example (a folder `save_pretrained` writes; the hubs' download tools
    write the same):
    >>> import tempfile, transformers
    >>> folder = tempfile.mkdtemp()
    >>> transformers.LlamaForCausalLM(transformers.LlamaConfig(
    ...     vocab_size=64, hidden_size=16, intermediate_size=32,
    ...     num_hidden_layers=1, num_attention_heads=2)).save_pretrained(folder)
    >>> model = keras_attn.models.from_hugging_face(folder)
    >>> tuple(model(np.array([[1, 2, 3]])).shape)
    (1, 3, 64)
    """
    checkpoint = open_checkpoint(path)
    config = HFConfig(checkpoint.config)
    if config.family not in FAMILIES:
        raise ValueError(
            f"`from_hugging_face` loads the model types {sorted(FAMILIES)}. "
            f"Received: model_type={config.family!r} in {checkpoint.path}."
        )
    policy = _float_policy(dtype)
    spec, links = read_family(config, policy.name)
    config.check_all_read()
    if config.family.startswith("gemma") and policy.variable_dtype != "float32":
        raise ValueError(
            "Gemma's RMS norms scale by 1 + w, which Keras' norms hold as one "
            f"weight: in {policy.variable_dtype} variables 1 + w loses w's low "
            f"bits. Received: dtype={dtype!r}. Pass dtype='float32' or a mixed "
            "policy ('mixed_bfloat16')."
        )
    model = decoder_lm(spec, name=f"{config.family}_keras_attn")
    state = state_paths(model)
    shapes = {v.path: tuple(v.shape) for v in model.weights if v.path not in state}
    names = _resolve(links, shapes, checkpoint, mtp_layers(config))
    _check_tied_copy(links, names, checkpoint)
    _assign(links, names, {v.path: v for v in model.weights}, checkpoint)
    return model


def _assign(links, names, variables, checkpoint):
    """Each linked tensor read once and assigned; an expert's slice goes into
    its variable's buffer, assigned once every expert's slice is in (the
    family lists a variable's experts together, so one buffer at a time)."""
    buffers, filled = {}, {}
    for item, name in zip(links, names, strict=True):
        shapes = {path: tuple(variables[path].shape) for path in item.ours}
        for path, value in item.load(checkpoint.read(name), shapes).items():
            variable = variables[path]
            if item.expert is None:
                variable.assign(as_dtype(value, variable.dtype))
                continue
            buffer = buffers.setdefault(path, np.empty(shapes[path], value.dtype))
            buffer[item.expert] = value
            filled[path] = filled.get(path, 0) + 1
            if filled[path] == shapes[path][0]:
                variable.assign(as_dtype(buffers.pop(path), variable.dtype))


def _float_policy(dtype):
    """`dtype`'s Keras dtype policy, once it is a float one (the global
    policy for `None`); a ValueError naming `dtype` otherwise."""
    floats = ("float16", "bfloat16", "float32", "float64")
    try:
        policy = keras.dtype_policies.get(dtype or keras.config.dtype_policy())
    except (TypeError, ValueError):
        policy = None
    if (
        policy is None
        or getattr(policy, "quantization_mode", None)
        or policy.variable_dtype not in floats
        or policy.compute_dtype not in floats
    ):
        raise ValueError(
            "`dtype` must be None (Keras' global policy) or a float dtype "
            "policy: 'float32', 'bfloat16', 'float16', 'mixed_bfloat16', .... "
            f"Received: dtype={dtype!r}. To quantize, load in float, then call "
            "`model.quantize(...)`."
        )
    return policy


def _resolve(links, shapes, checkpoint, unread=()):
    """Each link's tensor name in the checkpoint, after checking that every
    variable is linked once, every tensor used once (a tied head's copy and
    GPT-2's mask buffers aside), each of the shape the config implies, and
    each a float tensor. `unread`: name prefixes of tensors the family's
    transformers model skips (DeepSeek-V3's multi-token prediction)."""
    _check_links(links, shapes)
    names = [_name(item.theirs, checkpoint) for item in links]
    errors = []
    for item, name in zip(links, names, strict=True):
        expected = item.shape(shapes)
        if name is None:
            errors.append(f"missing {item.theirs} of shape {expected}")
        elif checkpoint.shapes[name] != expected:
            shape = checkpoint.shapes[name]
            errors.append(f"{name} has shape {shape}, the config implies {expected}")
        elif checkpoint.dtypes[name] not in FLOAT_DTYPES:
            errors.append(f"{name} is {checkpoint.dtypes[name]}, not a float tensor")
    ignored = _ignored(checkpoint, names, unread)
    unused = sorted(set(checkpoint.shapes) - set(names) - ignored)
    if unused:
        errors.append(f"tensors the config does not use: {unused[:8]}")
    if errors:
        raise ValueError(
            f"The weights in {checkpoint.path} do not match its config.json: "
            + "; ".join(errors)
            + ". Nothing was loaded."
        )
    return names


def _check_links(links, shapes):
    """Our own tables' consistency: every variable linked once (or each of
    its experts' slices once)."""
    linked = [(path, item.expert) for item in links for path in item.ours]
    expected = {
        (path, e)
        for path in {p for p, e in linked if e is not None}
        for e in range(shapes[path][0])
    } | {(path, None) for path in set(shapes) - {p for p, e in linked if e is not None}}
    if set(linked) != expected or len(linked) != len(set(linked)):
        missing = sorted(expected - set(linked), key=str)[:4]
        raise AssertionError(f"Our links miss {missing} or repeat a variable.")


def _check_tied_copy(links, names, checkpoint):
    """A tied head's stored `lm_head.weight` must equal the token table:
    transformers ties them only then, and else keeps both (with a warning),
    which `tie_word_embeddings` misdescribes. Compared a block of rows at a
    time, so the check holds no whole tensor."""
    if "lm_head.weight" in names or "lm_head.weight" not in checkpoint.shapes:
        return
    table = next(
        name
        for item, name in zip(links, names, strict=True)
        if item.ours == ("token_embedding/embeddings",)
    )
    rows, step = checkpoint.shapes[table][0], 4096
    if not all(
        np.array_equal(
            checkpoint.read(table, start, min(start + step, rows)),
            checkpoint.read("lm_head.weight", start, min(start + step, rows)),
        )
        for start in range(0, rows, step)
    ):
        raise ValueError(
            f"The config at {checkpoint.path} has tie_word_embeddings=True, but "
            f"its lm_head.weight differs from {table}: transformers then keeps "
            "both. Set tie_word_embeddings to false in config.json to load this "
            "head, or drop lm_head.weight. Nothing was loaded."
        )


def _name(theirs, checkpoint):
    """`theirs` in the checkpoint, or the same without the base model's
    prefix (GPT-2's original files have `h.0...`, not `transformer.h.0...`)."""
    for name in (theirs, theirs.partition(".")[2]):
        if name in checkpoint.shapes:
            return name
    return None


def _ignored(checkpoint, names, unread):
    """Tensors transformers' model does not read: a tied head's copy of the
    token table, GPT-2's causal-mask buffers, rotary frequency buffers."""
    buffers = (".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq")
    return {
        name
        for name in set(checkpoint.shapes) - set(names)
        if name == "lm_head.weight" or name.endswith(buffers) or name.startswith(unread)
    }
