"""Text that several docstrings share, written once: the blocks' arguments,
attention sinks and LoRA's. A docstring names a fragment on a line of its
own, `{name}`, and `shared_docs` puts the text there, at that line's
indentation."""

import re
import textwrap

BLOCK_ARGUMENTS = """\
intermediate_dim: int. Hidden width of the feed-forward network.
num_heads: int. Number of attention heads; must divide the input width
    unless `key_dim` is given.
dropout: float in [0, 1). Dropout on the attention weights, the
    feed-forward hidden units and each residual branch. Defaults to `0.0`.
activation: activation of the feed-forward network. Defaults to `"relu"`.
layer_norm_epsilon: float > 0. Defaults to `1e-5`.
kernel_initializer: initializer of all kernels. Defaults to
    `"glorot_uniform"`.
bias_initializer: initializer of all biases. Defaults to `"zeros"`.
normalize_first: bool. Pre-norm instead of post-norm. Defaults to
    `False`.
key_dim: int, keyword only. Per-head width. Defaults to width //
    `num_heads`.
num_key_value_heads: int, keyword only. Key/value heads for
    grouped-query attention; must divide `num_heads`. Defaults to
    `num_heads`.
flash_attention: `None`, `True` or `False`, keyword only; see
    `keras_attn.MultiHeadAttention`. Defaults to `None`.
"""

BLOCK_OPTIONS = """\
normalization: `"layer_norm"` (Keras' `LayerNormalization`) or
    `"rms_norm"` (Keras' `RMSNormalization`, as in LLaMA), keyword
    only. Defaults to `"layer_norm"`.
gated_feedforward: bool, keyword only. The gated network
    `W_2 (activation(W_g x) * W_1 x)` (`feedforward_gate_dense` is
    `W_g`): SwiGLU with `activation="silu"`, GeGLU with `"gelu"`.
    Defaults to `False`.
normalize_sublayer_outputs: bool, keyword only. Each sublayer's output
    (self-attention, cross-attention, feed-forward `F`) goes through a
    norm of its own (`*_output_norm`: `normalization`, with
    `layer_norm_epsilon`) before the dropout and the residual add.
    Pre-norm: `x + Dropout(Norm_out(F(Norm(x))))`, Gemma 2/3's
    post-attention and post-feed-forward norms; post-norm:
    `Norm(x + Dropout(Norm_out(F(x))))`. Defaults to `False`.
use_bias: bool, keyword only. `False` drops every bias: the
    projections', the feed-forward matrices' and the layer norms'
    offsets (as LLaMA). Defaults to `True`.
normalize_qk: bool, keyword only. RMS-normalize queries and keys per
    head before the dot product (Gemma 3, Qwen3), with `qk_norm_epsilon`.
    Defaults to `False`.
qk_norm_epsilon: float > 0, keyword only. Epsilon of the QK-norms.
    Defaults to `None`: `layer_norm_epsilon`.
logit_soft_cap: float, keyword only. Soft-cap the attention logits to
    `cap * tanh(logits / cap)` (Gemma 2). Defaults to `None`.
rope_max_wavelength: float, keyword only. Rotary position embeddings
    (Su et al. 2021) in self-attention, with this base; see
    `keras_attn.ops.rotary_embedding`. Defaults to `None` (none).
rope_scaling_factor: float, keyword only. Positions are divided by it
    (linear position interpolation). Defaults to `1.0`.
rope_scaling: dict, keyword only. Hugging Face's `rope_scaling`
    (`rope_type` `"linear"`, `"dynamic"`, `"yarn"` or `"llama3"`, with
    its keys), computed as keras-hub's rotary layers compute it; see
    `keras_attn.ops.rotary_embedding`. Needs `rope_max_wavelength`, not
    with `rope_scaling_factor`. Defaults to `None`.
attention_scale: float, keyword only. The multiplier of the
    query-key logits (Gemma: `(width / num_heads) ** -0.5`). Defaults
    to `None`, `1 / sqrt(key_dim)`.
**kwargs: Base layer arguments (`name`, `dtype`, ...).
"""

ATTENTION_SINKS = """\
attention_sinks: int >= 1, keyword only, with `sliding_window`. In
    self-attention, the first `attention_sinks` positions stay visible to
    every query beside its window (StreamingLLM's attention sinks, Xiao et
    al. 2023); a left-padded row's sinks are its first real tokens, a
    packed segment's (`segment_ids`) its own first tokens.
    `keras_attn.generation.generate` keeps them in the rolling cache, so
    generation runs past the window in constant memory. Defaults to `None`.
"""

LORA_ARGUMENTS = """\
rank: int. Rank of the adapters.
lora_alpha: float. Adapters are scaled by `lora_alpha / rank`.
    Defaults to `rank`.
a_initializer: initializer of the down-projections. Defaults to
    `"he_uniform"`.
b_initializer: initializer of the up-projections. Defaults to
    `"zeros"` (so the adapted layer starts unchanged).
"""

_FRAGMENTS = {
    "block_arguments": BLOCK_ARGUMENTS,
    "block_options": BLOCK_OPTIONS,
    "attention_sinks": ATTENTION_SINKS,
    "lora_arguments": LORA_ARGUMENTS,
}


def shared_docs(documented):
    """Fill the `{fragment}` lines of `documented.__doc__` (a class or a
    function); returns it."""

    def fill(match):
        return textwrap.indent(_FRAGMENTS[match.group(2)], match.group(1))

    documented.__doc__ = re.sub(
        r"^( *)\{(\w+)\}\n", fill, documented.__doc__, flags=re.MULTILINE
    )
    return documented
