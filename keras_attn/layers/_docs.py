"""Text that docstrings share or that would crowd a module, written once: the
blocks' arguments, `MultiHeadAttention`'s options, attention sinks and
LoRA's. A docstring names a fragment on a line of its
own, `{name}`, and `shared_docs` puts the text there, at that line's
indentation."""

import re
import textwrap

BLOCK_ARGUMENTS = """\
intermediate_dim: int. Hidden width of the feed-forward network; `None`
    with `feedforward`.
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
    offsets (as LLaMA), but where `use_output_bias` or
    `use_feedforward_bias` says otherwise. Defaults to `True`.
use_output_bias: bool, keyword only. Whether each attention's output
    projection (`attention_output`, W_O) has a bias. `False` with
    `use_bias=True`: biases on query, key and value only (Qwen2, Qwen2.5).
    Defaults to `None`: as `use_bias`.
use_feedforward_bias: bool, keyword only. Whether the feed-forward
    matrices (`feedforward_*_dense`) have biases; the layer norms'
    offsets stay with `use_bias`. `False` with `use_bias=True`: Qwen2 and
    Llama's `attention_bias=True, mlp_bias=False`; `True` with
    `use_bias=False`: Llama's `mlp_bias=True`. Defaults to `None`: as
    `use_bias`.
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
feedforward: optional `keras_attn.layers.MixtureOfExperts` (or its
    `keras.saving.serialize_keras_object` dict), keyword only: the
    feed-forward network, instead of the block's matrices. The block
    builds a clone of it named `feedforward` (no `feedforward_*_dense`),
    keeps its own `feedforward_layer_norm`, residual, output norm and
    dropout, and refuses `gated_feedforward` and `use_feedforward_bias`
    (the layer has its own). Defaults to `None`.
attention_scale: float, keyword only. The multiplier of the
    query-key logits (Gemma: `(width / num_heads) ** -0.5`). Defaults
    to `None`, `1 / sqrt(key_dim)`.
use_sink_logits: bool, keyword only. A learned sink logit per head in
    self-attention (gpt-oss): see `keras_attn.MultiHeadAttention`; not
    with `flash_attention=True`. Defaults to `False`.
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

ATTENTION_ARGUMENTS = """\
num_heads: int. Number of query heads.
key_dim: int. Per-head width of queries and keys. Defaults to the query
    width // `num_heads` (which must then divide it).
value_dim: int. Per-head width of values. Defaults to `key_dim`.
dropout: float in [0, 1). Dropout on the attention weights in training.
    Defaults to `0.0`.
use_bias: bool. Whether the projections have biases (W_O's: see
    `use_output_bias`). Defaults to `True`.
output_shape: int or tuple of ints. Shape of each output position.
    Defaults to the query width.
attention_axes: int or tuple of ints. The axes of inputs of rank >= 3
    that attention runs over (the others act as batch axes). Defaults
    to every axis between the batch and the feature axis.
sliding_window: int >= 1. Query `i` attends only to keys `j` with
    `|i - j| < sliding_window`; with `use_causal_mask=True` this is
    the causal sliding window of Mistral. Defaults to `None`.
flash_attention: `None` (fused kernels where they compute the same,
    none after `keras.config.disable_flash_attention()`, as in Keras'
    layer), `True` (require a fused kernel, whatever Keras' switch
    says: raises with `dropout`, `logit_soft_cap`,
    `use_sink_logits`, `return_attention_scores=True`, and where the
    backend has none for the inputs; on PyTorch, any of torch's
    fused kernels, not its composite one) or `False` (always the explicit
    path, in chunks for long sequences). Defaults to `None`.
kernel_initializer: initializer of the kernels. Defaults to
    `"glorot_uniform"` (fans of the 2-D projection matrices).
bias_initializer: initializer of the biases. Defaults to `"zeros"`.
kernel_regularizer: optional regularizer of the kernels.
bias_regularizer: optional regularizer of the biases.
activity_regularizer: optional regularizer of the output.
kernel_constraint: optional constraint of the kernels.
bias_constraint: optional constraint of the biases.
use_gate: bool. Multiply the attention output by a sigmoid gate
    projected from the query (Qiu et al. 2025, arXiv 2505.06708), as
    Keras does. Defaults to `False`.
seed: optional int. Seed of the attention dropout.
num_key_value_heads: int, keyword only. Key/value heads for
    grouped-query attention; must divide `num_heads`. `1` is
    multi-query attention. Defaults to `num_heads`.
output_dim: int, keyword only. The same as an int `output_shape` (the
    name of keras_attn 0.1).
use_output_bias: bool, keyword only. Whether the output projection
    (`attention_output`, W_O) has a bias: `False` with `use_bias=True`
    gives biases on query, key and value only (Qwen2, Qwen2.5). Defaults
    to `None`: as `use_bias`.
rope_max_wavelength: float, keyword only. Rotate queries and keys by
    their positions after projection (rotary position embeddings, Su
    et al. 2021; `keras_attn.ops.rotary_embedding`) with this base.
    Needs inputs of rank 3 and an even `key_dim`. Defaults to `None`
    (no rotation).
rope_scaling_factor: float, keyword only. Positions are divided by it
    (linear position interpolation). Defaults to `1.0`.
rope_scaling: dict, keyword only. Hugging Face's `rope_scaling`, as
    keras-hub computes it: `{"rope_type": "linear", "factor": f}` (as
    `rope_scaling_factor=f`), `{"rope_type": "dynamic", "factor": f}`
    (static NTK-aware scaling), `{"rope_type": "yarn", "factor": f,
    "original_max_position_embeddings": n}` (and optionally
    `beta_fast`, `beta_slow`, `truncate`, `attention_factor`) or
    `{"rope_type": "llama3", "factor": f, "low_freq_factor": l,
    "high_freq_factor": h, "original_max_position_embeddings": n}`; see
    `keras_attn.ops.rotary_embedding`. Needs `rope_max_wavelength`;
    not with `rope_scaling_factor`. Saved with its defaults filled
    in. Defaults to `None`.
normalize_qk: bool, keyword only. RMS-normalize queries and keys per
    head (sublayers `query_norm`, `key_norm`, Keras'
    `RMSNormalization`) before the rotation and the dot product, as in
    Gemma 3. Defaults to `False`.
qk_norm_epsilon: float, keyword only. Epsilon of the QK-norms.
    Defaults to `1e-6`.
logit_soft_cap: float, keyword only. Soft-cap the scaled logits to
    `cap * tanh(logits / cap)` before the softmax (Gemma 2); it runs on
    the explicit path. Defaults to `None`.
attention_scale: float > 0, keyword only. The multiplier of the
    query-key logits, on every path (Gemma scales by `(query width /
    num_heads) ** -0.5` where its heads are wider). Defaults to
    `None`: `1 / sqrt(key_dim)`.
attention_sinks: int >= 1, keyword only, with `sliding_window`. Key
    `j` is also visible where `j < attention_sinks`: with the causal
    mask, each query sees the first `attention_sinks` positions and
    the last `sliding_window` (StreamingLLM, Xiao et al. 2023;
    `keras_attn.ops.sliding_window_mask`). Left padding (the leading
    keys the padding mask masks out) does not count: a left-padded
    row's sinks are its first real keys; with `segment_ids`, each
    segment's first keys. Defaults to `None`.
use_sink_logits: bool, keyword only. A learned logit `s_h` per head
    (the weight `sink_logits`, `(num_heads,)`, initialized to zeros)
    joins each query row's softmax denominator and is then dropped, as
    gpt-oss's attention sinks (not StreamingLLM's `attention_sinks`):
    weights `exp(l_ij) / (sum_j' exp(l_ij') + exp(s_h))`, in float32,
    so a row may attend to almost nothing. It runs on the explicit path
    (no fused kernel takes it; not with `flash_attention=True`);
    returned scores are the weights of the real keys (rows sum to less
    than 1). Defaults to `False`.
**kwargs: Base layer arguments (`name`, `dtype`, ...).
"""

ATTENTION_CALL_ARGUMENTS = """\
query: float tensor `(batch, query_length, query_width)`, or of higher
    rank with `attention_axes`.
value: optional float tensor `(batch, key_length, value_width)`.
    Defaults to `query` (self-attention).
key: optional float tensor `(batch, key_length, key_width)`. Defaults to
    `value`.
query_mask: optional bool `(batch, query_length)`; filled in by Keras from
    the query's Keras mask. It only sets the output's mask.
value_mask: optional bool `(batch, key_length)`, True for keys that may be
    attended to; filled in by Keras from the value's Keras mask.
key_mask: optional bool `(batch, key_length)`, combined with `value_mask`.
attention_mask: optional bool `(batch, query_length, key_length)` or
    broadcastable (rank 2 to 4), True where attention is allowed. For
    inputs of higher rank, `(batch, *batch axes, *query attention axes,
    *key attention axes)`.
return_attention_scores: bool. Also return the attention weights.
    Defaults to `False`.
training: bool. Whether dropout is active.
use_causal_mask: bool. Query `i` may only attend to keys `j <= i` (over
    the flattened attention axes). Defaults to `False`.
attention_bias: optional float tensor broadcastable to
    `(batch, num_heads, query_length, key_length)`, added to the scaled
    logits (ALiBi: `keras_attn.ops.alibi_bias`; T5 relative biases).
    Inputs of rank 3 only.
cache: optional key/value cache: a tensor `(batch, 2,
    num_key_value_heads, cache_length, key_dim)` (Keras' and
    keras-hub's form; see `get_empty_cache`, `compute_cache`),
    written into a new one, or a `keras_attn.cache.DenseCache` or
    `Int8Cache`, written in place on PyTorch. Inputs of rank 3 only.
cache_update_index: optional int or scalar int tensor: write the new
    keys and values into `cache` from this position; the queries sit
    there too. Without it, `cache` holds precomputed keys and values.
positions: optional int tensor `(query_length,)` or
    `(batch, query_length)`: the rotary positions of the queries (and,
    in self-attention, of the new keys), e.g. per row for left-padded
    prompts. Defaults to `cache_update_index` (or 0) onwards. For
    self-attention only (no `value`, or `value` the query itself):
    keys of another sequence sit at `cache_update_index` (or 0)
    onwards. Needs `rope_max_wavelength`.
segment_ids: optional int `(batch, query_length)`: packed sequences
    (several documents in one row). A segment is a contiguous run
    of equal ids (an id that comes back later starts a new
    document). A token attends only to tokens of its own segment
    (ANDed with every other mask), and its rotary position counts
    from its segment's start (`keras_attn.ops.segment_positions`;
    explicit `positions` win). Padding is not special-cased (mask it
    with a padding mask). Self-attention without a `cache` only.
    Long sequences go in chunks, memory linear in the length,
    except with `flash_attention=True`, which folds their `(batch,
    1, T, T)` mask into the fused kernel's: quadratic memory.
mask: filled in by Keras with the query's Keras mask when the query is
    the only tensor argument (self-attention); in self-attention it masks
    the keys as `value_mask` does.
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
    "attention_arguments": ATTENTION_ARGUMENTS,
    "attention_call_arguments": ATTENTION_CALL_ARGUMENTS,
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
