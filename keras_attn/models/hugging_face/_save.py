"""`to_hugging_face`: a keras_attn language model as a checkpoint folder
that transformers loads to the same logits.

The config is written for a family, then read back with the same reader
`from_hugging_face` uses: the folder is written only when what the reader
builds from it is the model itself, so the two directions cannot drift."""

import math

import keras

from keras_attn.models.decoder_lm import spec_of
from keras_attn.models.hugging_face._config import HFConfig
from keras_attn.models.hugging_face._families import read_family
from keras_attn.models.hugging_face._files import write_checkpoint
from keras_attn.models.hugging_face._load import cast
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
ARCHITECTURES = {
    "gpt2": "GPT2LMHeadModel",
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
    "gemma": "GemmaForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}


def to_hugging_face(model, path, model_type=None, dtype=None):
    """Write a keras_attn language model as a Hugging Face checkpoint folder.

    `config.json` and `model.safetensors` in `path`, which transformers'
    `AutoModelForCausalLM.from_pretrained(path)` loads to the same logits
    (and `from_hugging_face` back to the same model). LoRA adapters are
    merged into the kernels written (Keras' `kernel` with LoRA enabled).

    Args:
        model: a model `keras_attn.models.decoder_lm` builds
            (`from_hugging_face` and `from_keras_hub` return one).
        path: str or os.PathLike. The folder (created if needed).
        model_type: the family to write (`"llama"`, `"mistral"`, `"qwen2"`,
            `"qwen3"`, `"phi3"`, `"smollm3"`, `"gemma"`, `"gemma2"`,
            `"gemma3_text"`, `"gpt2"`). Defaults to `None`: the first of
            these (Phi-3 aside) whose config describes the model exactly.
        dtype: the tensors' dtype, `"float32"`, `"bfloat16"` or
            `"float16"`. Defaults to `None`: the variables' dtype.

    Returns:
        The family written (its `model_type`).

    Raises:
        ValueError: a model of another shape, quantized layers, or a model
            no family's config describes (the message says what differs),
            before anything is written.

    Example:
    >>> import tempfile
    >>> block = dict(intermediate_dim=32, num_heads=2, normalize_first=True,
    ...              normalization="rms_norm", gated_feedforward=True,
    ...              use_bias=False, activation="silu",
    ...              layer_norm_epsilon=1e-6, rope_max_wavelength=10000.0)
    >>> model = keras_attn.models.decoder_lm(keras_attn.models.DecoderLMSpec(
    ...     vocabulary_size=50, hidden_dim=16, blocks=(block,)))
    >>> keras_attn.models.to_hugging_face(model, tempfile.mkdtemp())
    'llama'
    """
    spec = spec_of(model)
    _check_float(model)
    if model_type is not None and model_type not in ARCHITECTURES:
        raise ValueError(
            f"`model_type` must be one of {sorted(ARCHITECTURES)} or None. "
            f"Received: model_type={model_type!r}."
        )
    if dtype not in (None, "float32", "bfloat16", "float16"):
        raise ValueError(
            "`dtype` must be None, 'float32', 'bfloat16' or 'float16'. "
            f"Received: dtype={dtype!r}."
        )
    family, config, links = _describe(spec, model_type)
    values = _values(model)
    dtype = dtype or keras.backend.standardize_dtype(model.dtype_policy.variable_dtype)
    config["dtype"] = dtype
    tensors = {item.theirs: cast(item.save(values), dtype) for item in links}
    write_checkpoint(path, config, tensors)
    return family


def _check_float(model):
    quantized = [
        layer.name
        for layer in model._flatten_layers(include_self=False)
        if getattr(layer, "quantization_mode", None)
    ]
    if quantized:
        raise ValueError(
            "`to_hugging_face` writes float weights; these layers are "
            f"quantized: {quantized[:3]}. Write the float model."
        )


def _values(model):
    """`{variable path: numpy array}`, LoRA merged into its kernels."""
    values = {w.path: keras.ops.convert_to_numpy(w) for w in model.weights}
    for layer in model._flatten_layers(include_self=False):
        if getattr(layer, "lora_enabled", False):
            merged = layer.kernel if hasattr(layer, "kernel") else layer.embeddings
            name = "kernel" if hasattr(layer, "kernel") else "embeddings"
            values[f"{layer.path}/{name}"] = keras.ops.convert_to_numpy(merged)
    return {path: v for path, v in values.items() if "/lora_" not in path}


def _describe(spec, model_type):
    """`(family, config, links)` of the first family whose config, read
    back, is `spec`; a ValueError listing why each failed."""
    reasons = {}
    for family in (model_type,) if model_type else PREFERENCE:
        try:
            blocks = [resolved(b, spec.hidden_dim) for b in spec.blocks]
            config = WRITERS[family](spec, blocks) | {
                "model_type": family,
                "architectures": [ARCHITECTURES[family]],
            }
            reader = HFConfig(dict(config))
            read, links = read_family(reader, spec.dtype)
            reader.check_all_read()
        except (ValueError, KeyError) as error:
            reasons[family] = str(error)
            continue
        differences = _differences(spec, read)
        if not differences:
            return family, config, links
        reasons[family] = f"it would compute with {differences}"
    raise ValueError(
        "No Hugging Face config describes this model exactly, so transformers "
        "would compute something else: "
        + "; ".join(f"{family}: {why}" for family, why in reasons.items())
    )


def _differences(ours, theirs):
    """The entries where two specs differ in what they compute."""
    found = {}
    for key in ("vocabulary_size", "hidden_dim", "normalization", "tie_weights"):
        if getattr(ours, key) != getattr(theirs, key):
            found[key] = (getattr(ours, key), getattr(theirs, key))
    for key in ("layer_norm_epsilon", "embedding_scale", "final_logit_soft_cap"):
        if not _close(getattr(ours, key), getattr(theirs, key)):
            found[key] = (getattr(ours, key), getattr(theirs, key))
    if ours.positions != theirs.positions or len(ours.blocks) != len(theirs.blocks):
        found["positions or blocks"] = (ours.positions, len(ours.blocks))
    for i, (a, b) in enumerate(zip(ours.blocks, theirs.blocks, strict=False)):
        a, b = resolved(a, ours.hidden_dim), resolved(b, theirs.hidden_dim)
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
