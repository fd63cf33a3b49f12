"""Argument and tensor checks, one message style, raised before any state
changes (ground floor: imports nothing of ours but `_keras_compat`, the
Keras internals, which imports only Keras), by kind:
`arguments` (Python values), `tensors` (shapes, dtypes, a few values) and
`configs` (saved configs).

Each public entry (a layer's `__init__`, `build` or `call`, a public op,
`generate`) checks its arguments once; inner code trusts them. Checks of
shapes and dtypes read static shapes only. The few that read tensor values
(`check_index`, token ids) do so in eager calls only, and never inside the
decoding loop of `generate`, which checks its inputs once and runs its steps
through the layers' unchecked twins (`decode_unchecked`, `call_unchecked`).
"""

from keras_attn._checks.arguments import (
    check_bool,
    check_count,
    check_heads_divide,
    check_key_value_heads,
    check_one_of,
    check_output_shape,
    check_positive_float,
    check_positive_int,
    check_rate,
    check_seed,
    check_shape_argument,
    check_size,
    check_sizes,
    get_keras_object,
    normalize_attention_axes,
)
from keras_attn._checks.configs import check_config
from keras_attn._checks.tensors import (
    check_attention_inputs,
    check_attention_options,
    check_broadcastable,
    check_fits,
    check_float,
    check_index,
    check_mask,
    check_positions,
    check_rank,
    check_segment_ids,
    check_segment_ids_call,
    check_width,
    compiled_by_torch,
    concrete_value,
    dims_differ,
    exported_by_torch,
    in_keras_step,
)

__all__ = [
    "check_attention_inputs",
    "check_attention_options",
    "check_bool",
    "check_broadcastable",
    "check_config",
    "check_count",
    "check_fits",
    "check_float",
    "check_heads_divide",
    "check_index",
    "check_key_value_heads",
    "check_mask",
    "check_one_of",
    "check_output_shape",
    "check_positions",
    "check_positive_float",
    "check_positive_int",
    "check_rank",
    "check_rate",
    "check_seed",
    "check_segment_ids",
    "check_segment_ids_call",
    "check_shape_argument",
    "check_size",
    "check_sizes",
    "check_width",
    "compiled_by_torch",
    "concrete_value",
    "dims_differ",
    "exported_by_torch",
    "get_keras_object",
    "in_keras_step",
    "normalize_attention_axes",
]
