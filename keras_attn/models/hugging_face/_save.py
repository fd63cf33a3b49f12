"""`to_hugging_face`: a keras_attn language model as a checkpoint folder
that transformers loads to the same logits.

The config is written for a family, then read back with the same reader
`from_hugging_face` uses: the folder is written only when what the reader
builds from it is the model itself, so the two directions cannot drift."""

import math

import keras

from keras_attn.layers._machinery import all_layers, quantized_layers
from keras_attn.models.decoder_lm import spec_of
from keras_attn.models.hugging_face._config import HFConfig
from keras_attn.models.hugging_face._files import (
    as_dtype,
    checked_new_folder,
    write_checkpoint,
)
from keras_attn.models.hugging_face._registry import read_family
from keras_attn.models.hugging_face._writers import WRITERS, resolved

# The families tried, simplest first, when `model_type` is not given
# (Phi-3's fused layout only when asked for).
PREFERENCE = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "smollm3",
    "gemma",
    "gemma2",
    "gemma3_text",
    "gpt2",
)


def to_hugging_face(
    model, path, model_type=None, dtype=None, max_position_embeddings=None
):
    """Write a keras_attn language model as a Hugging Face checkpoint folder.

    `config.json` and `model.safetensors` in `path`, which transformers'
    `AutoModelForCausalLM.from_pretrained(path)` loads to the same logits
    (and `from_hugging_face` back to the same model). LoRA adapters are
    merged into the kernels written (Keras' `kernel` with LoRA enabled).
    The special token ids are the tokenizer's, not the model's: they are
    written as none; copy `tokenizer.json`, `tokenizer_config.json` and
    `generation_config.json` from the source folder. The tensors are
    gathered in memory, then written (a second copy of the model, briefly).

    Args:
        model: a model `keras_attn.models.decoder_lm` builds
            (`from_hugging_face` and `from_keras_hub` return one).
        path: str or os.PathLike. The folder, created if needed; one that
            already holds a config or weights is refused.
        model_type: the family to write (`"llama"`, `"mistral"`, `"qwen2"`,
            `"qwen3"`, `"phi3"`, `"smollm3"`, `"gemma"`, `"gemma2"`,
            `"gemma3_text"`, `"gpt2"`). Defaults to `None`: the first of
            these (Phi-3 aside) whose config describes the model exactly.
        dtype: the tensors' dtype, `"float32"`, `"bfloat16"` or
            `"float16"`. Defaults to `None`: the variables' dtype.
        max_position_embeddings: int. The context length the config
            declares (serving tools cap prompts by it): the source config's.
            Required for rotary families, whose weights do not say it;
            GPT-2's is its position table's length.

    Returns:
        The family written (its `model_type`).

    Raises:
        ValueError: a model of another shape (mixture-of-experts and latent
            attention blocks included), quantized layers, a folder
            holding a checkpoint, or a model no family's config describes
            (the message says what each would compute differently), before
            anything is written. TypeError: a `model` or `path` of another
            type.

    Example:
    >>> import tempfile
    >>> block = dict(intermediate_dim=32, num_heads=2, normalize_first=True,
    ...              normalization="rms_norm", gated_feedforward=True,
    ...              use_bias=False, activation="silu",
    ...              layer_norm_epsilon=1e-6, rope_max_wavelength=10000.0)
    >>> model = keras_attn.models.decoder_lm(keras_attn.models.DecoderLMSpec(
    ...     vocabulary_size=50, hidden_dim=16, blocks=(block,)))
    >>> keras_attn.models.to_hugging_face(
    ...     model, tempfile.mkdtemp(), max_position_embeddings=2048)
    'llama'
    """
    _check_arguments(model, path, model_type, dtype)
    spec = spec_of(model)
    _check_dense(spec)
    _check_float(model)
    family, config, links = _describe(spec, model_type)
    config.update(_limit(spec, family, max_position_embeddings))
    variables = keras.dtype_policies.get(spec.dtype).variable_dtype
    dtype = dtype or keras.backend.standardize_dtype(variables)
    config["dtype"] = dtype
    values = _values(model)
    tensors = {item.theirs: as_dtype(item.save(values), dtype) for item in links}
    write_checkpoint(path, config, tensors)
    return family


def _check_arguments(model, path, model_type, dtype):
    if not isinstance(model, keras.Model):
        raise TypeError(
            "`model` must be a keras.Model that `keras_attn.models.decoder_lm` "
            f"builds. Received: {type(model).__name__}."
        )
    checked_new_folder(path)
    if model_type is not None and model_type not in WRITERS:
        raise ValueError(
            f"`model_type` must be one of {sorted(WRITERS)} or None. "
            f"Received: model_type={model_type!r}."
        )
    if dtype not in (None, "float32", "bfloat16", "float16"):
        raise ValueError(
            "`dtype` must be None, 'float32', 'bfloat16' or 'float16'. "
            f"Received: dtype={dtype!r}."
        )


def _check_dense(spec):
    """The families written have one attention and one dense feed-forward
    per block: a mixture of experts or latent attention is refused by name."""
    sparse = [
        f"transformer_layer_{i}"
        for i, block in enumerate(spec.blocks)
        if block.get("feedforward") is not None
        or block.get("self_attention") is not None
    ]
    if sparse:
        raise ValueError(
            f"`to_hugging_face` writes the dense families {sorted(WRITERS)}; "
            f"the blocks {sparse[:4]} have a mixture of experts (`feedforward`) "
            "or latent attention (`self_attention`), which it does not write. "
            "Save the model with `model.save(path)` (a .keras file) instead."
        )


def _limit(spec, family, max_position_embeddings):
    """`max_position_embeddings` for the config: given, or GPT-2's table."""
    if family == "gpt2":
        if max_position_embeddings not in (None, spec.positions):
            raise ValueError(
                "GPT-2's context is its position table's length, "
                f"{spec.positions}. Received: max_position_embeddings="
                f"{max_position_embeddings}."
            )
        return {}
    if not isinstance(max_position_embeddings, int) or max_position_embeddings < 1:
        raise ValueError(
            "`max_position_embeddings` must be the context length the source "
            "config.json declares (a positive int; rotary weights do not say "
            "it, and serving tools cap prompts by it). Received: "
            f"max_position_embeddings={max_position_embeddings!r}."
        )
    return {"max_position_embeddings": max_position_embeddings}


def _check_float(model):
    quantized = quantized_layers(model)
    if quantized:
        raise ValueError(
            "`to_hugging_face` writes float weights; these layers are "
            f"quantized: {quantized[:3]}. Write the float model."
        )


def _values(model):
    """`{variable path: numpy array}`, LoRA merged into its kernels."""
    values = {w.path: keras.ops.convert_to_numpy(w) for w in model.weights}
    for layer in all_layers(model):
        if getattr(layer, "lora_enabled", False):
            name = "kernel" if hasattr(layer, "kernel") else "embeddings"
            merged = getattr(layer, name)  # Keras adds LoRA's product
            values[f"{layer.path}/{name}"] = keras.ops.convert_to_numpy(merged)
    return {path: v for path, v in values.items() if "/lora_" not in path}


def _describe(spec, model_type):
    """`(family, config, links)` of the first family whose config, read
    back, is `spec`; a ValueError listing why each failed."""
    reasons = {}
    blocks = [resolved(b, spec.hidden_dim) for b in spec.blocks]  # once, not per family
    for family in (model_type,) if model_type else PREFERENCE:
        architecture, writer = WRITERS[family]
        try:
            config = writer(spec, blocks) | {
                "model_type": family,
                "architectures": [architecture],
            }
            reader = HFConfig(dict(config))
            read, links = read_family(reader, spec.dtype)
            reader.check_all_read()
        except ValueError as error:
            reasons[family] = str(error)
            continue
        differences = _differences(spec, blocks, read)
        if not differences:
            return family, config, links
        reasons[family] = f"it would compute with {differences}"
    raise ValueError(
        "No Hugging Face config describes this model exactly, so transformers "
        "would compute something else: "
        + "; ".join(f"{family}: {why}" for family, why in reasons.items())
    )


def _differences(ours, our_blocks, theirs):
    """The entries where two specs differ in what they compute
    (`our_blocks`: `ours.blocks`, resolved)."""
    found = {}
    exact = (
        "vocabulary_size",
        "hidden_dim",
        "normalization",
        "use_bias",
        "tie_weights",
    )
    for key in exact:
        if getattr(ours, key) != getattr(theirs, key):
            found[key] = (getattr(ours, key), getattr(theirs, key))
    for key in ("layer_norm_epsilon", "embedding_scale", "final_logit_soft_cap"):
        if not _close(getattr(ours, key), getattr(theirs, key)):
            found[key] = (getattr(ours, key), getattr(theirs, key))
    if ours.positions != theirs.positions or len(ours.blocks) != len(theirs.blocks):
        found["positions or blocks"] = (ours.positions, len(ours.blocks))
    for i, (a, b) in enumerate(zip(our_blocks, theirs.blocks, strict=False)):
        b = resolved(b, theirs.hidden_dim)
        found.update(
            {
                f"block {i} {k}": (a.get(k), b.get(k))
                for k in a
                if not _close(a[k], b[k])
            }
        )
    return found


def _close(a, b):
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-9)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    return a == b
