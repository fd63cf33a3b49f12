"""Pure `keras.ops` functions behind the layers: attention, masks, positions.

Every function here is stateless and backend-agnostic. Shapes use `B` batch,
`T`/`S` query/key length, `H` heads, `K` key/value heads, `D` per-head width.

One module per concern: `positions` (sinusoids, rotary), `masks` (causal,
sliding window, ALiBi, segments, merging), `attention` (the public op), `plan` (which
kernel runs, and why) and `kernels` (explicit, chunked, fused).
"""

from keras_attn.ops.attention import dot_product_attention
from keras_attn.ops.experts import ExpertWeights, expert_feedforward
from keras_attn.ops.masks import (
    alibi_bias,
    causal_mask,
    merge_attention_masks,
    segment_mask,
    sliding_window_mask,
)
from keras_attn.ops.positions import (
    rotary_embedding,
    segment_positions,
    sinusoidal_position_encoding,
    yarn_mscale,
)

__all__ = [
    "ExpertWeights",
    "alibi_bias",
    "causal_mask",
    "dot_product_attention",
    "expert_feedforward",
    "merge_attention_masks",
    "rotary_embedding",
    "segment_mask",
    "segment_positions",
    "sinusoidal_position_encoding",
    "sliding_window_mask",
    "yarn_mscale",
]
