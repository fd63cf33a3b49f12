"""The attention plan: which kernel computes attention, in which form, and why.

`plan_attention` is the one place that chooses the kernel. It reads only
static facts (shapes, dtypes, the backend and its device, which masks and
options a call has, Keras' global flash attention switch) and returns a
frozen `AttentionPlan`; the kernels in `keras_attn.ops.kernels` carry it out
and decide nothing. Every rule a kernel imposes is written here once, each
with its source:

Correctness limits first. Where `flash_attention=True` asks for what they
rule out, it raises (`refuse_flash`) rather than falling back.

1. `flash_attention=False`: explicit.
2. What no fused kernel computes (`fused_limits`): dropout on the weights
   (training), returning the weights, values of another width than the keys,
   soft-capped logits, sink logits (gpt-oss: an extra logit per head in the
   softmax's denominator, which neither `keras.ops.dot_product_attention`
   nor torch's `scaled_dot_product_attention` takes), float64 (Keras' fused
   op returns float32 for it on JAX and PyTorch). Explicit; with
   `flash_attention=True`, a `ValueError`.
3. `flash_attention=True`: fused (the backend raises where it has no fused
   kernel for the inputs; on PyTorch its composite kernel is ruled out).
4. `keras.config.disable_flash_attention()` (`is_flash_attention_enabled()`
   is `False`; read when the call is planned, so a compiled function keeps
   the switch it was traced with): explicit. It rules out every fused kernel,
   torch's too. As in Keras' own `MultiHeadAttention` (`flash_attention or
   is_flash_attention_enabled()`), it decides only for `flash_attention=None`:
   an explicit `True` wins (and `False` stays explicit);
   `keras.config.enable_flash_attention()` restores the default.
5. TensorFlow: explicit. Keras has no fused TensorFlow kernel, and its op
   fails for one key/value head and forms half-precision logits (which
   overflow float16 to NaN).
6. JAX on a CPU, with at least `CHUNKED_FROM` logits per batch row:
   explicit, in chunks. XLA's CPU attention materializes the logits and keeps
   them for the gradient (memory rule: `benchmarks/long_sequence.py`). And
   JAX off a GPU in float16: explicit. JAX's XLA attention asks for a float16
   product summed in float32 (`DotAlgorithmPreset.F16_F16_F32`), which XLA
   refuses on a CPU ("not supported by dot_general on CPU") and, by JAX's
   own comment, on a TPU; its fallback catches that only where the product
   compiles on its own (an eager call), so any compiled float16 model
   failed (jax 0.10, `jax/_src/nn/functions.py`,
   `_dot_product_attention_core`).
7. Segment ids (packed sequences) where the explicit path would go in
   chunks (at least `CHUNKED_FROM` logits per batch row): explicit, in
   chunks, each chunk's mask built from its rows' segment ids and all the
   keys' (memory stays linear; no `(T, S)` mask is built). No fused kernel
   takes segment ids: neither Keras' op nor JAX's
   `jax.nn.dot_product_attention` (0.10: sequence lengths and a local
   window, no segments) nor torch's `scaled_dot_product_attention`.
   FlexAttention's block masks do, and skip the blocks no segment spans:
   on a CPU, compiled, a 4,096-token row of 128-token documents took 0.05x
   the time of SDPA with the folded mask, our chunks 3.75x (forward:
   `benchmarks/flex_attention.py`). It is not used: it runs fused only
   under `torch.compile` (eager, as Keras runs PyTorch, it runs an unfused
   reference that materializes the weights), it has no backward pass on a
   CPU (torch 2.13), and it is not yet measured on a GPU.
   Shorter sequences fold the segment mask `(B, 1, T, S)` into the mask,
   which any kernel runs (the other rules as for any mask).
8. Otherwise: fused, heads-major caches too: on PyTorch torch's own
   `scaled_dot_product_attention` with torch's kernel choice, elsewhere
   `keras.ops.dot_product_attention`. While `torch.export` traces a length
   it keeps dynamic, torch's composite kernel only: the fused kernels' shape
   checks leave guards in the program that fail for dynamic lengths on CUDA
   (`min(4*L, 8*L) != 16*L`; FINDINGS.md, section 1), and the composite
   kernel checks nothing.

With `flash_attention=True` or `False` segment ids add no rule: fused with
the segment mask folded in, or explicit (in chunks where long). So
`flash_attention=True` on a long packed sequence builds the quadratic
`(B, 1, T, S)` segment mask: memory is no longer linear in the length.

The form of a fused call:

- Causal attention goes to the kernel as `is_causal` only when nothing else
  masks it. With a mask, the causal mask is folded into it, so that rows left
  empty by both are found (they give zeros). On PyTorch it is folded with a
  bias too: torch's SDPA raises for `attn_mask` together with `is_causal`
  (its documentation: "An error is thrown if both attn_mask and is_causal
  are set"; on CUDA, not on a CPU: `../shared/gpu/FINDINGS.md`, section 1).
- Grouped key/value heads reach the kernel unrepeated, except on PyTorch on a
  GPU in float32: there `enable_gqa` runs only torch's composite kernel
  (flash and cuDNN take half precision only, memory-efficient takes no
  `enable_gqa`: torch's `sdp_utils.cpp`, FINDINGS.md section 1), which
  materializes the logits; repeated heads run the memory-efficient kernel.

The explicit path materializes the weights, unless it may go in chunks: no
dropout, no returned weights, and at least `CHUNKED_FROM` logits per batch
row (`H * T * S`). In training calls, lengths known only at run time
(TensorFlow with `keras.Input((None, width))`, `RUNTIME_CHUNKS`) go in
chunks counted in the graph by the same rule, which puts a call under
`CHUNKED_FROM` logits in one chunk: the materialized computation, with the
chunked path's gradient. Other calls of unknown length (`predict`,
`evaluate`, `fit`'s validation, `Model.export`, and `dot_product_attention`,
which takes no `training`) materialize.

In chunks, a chunk of query rows computes only the keys that the masks by
position may leave visible (`kernels/blocks.py`): with `is_causal` (keys up
to its last row) and with a layer's sliding window (its band, and the
attention sinks where padding and segments do not move them), not with a
bias. The chunks go in at most `blocks.MAX_GROUPS` loops, each with one
static key width, so XLA compiles them; causal attention then computes about
0.56 of the logits at 16 chunks, a window of `w` about `rows + w - 1` keys a
row (`benchmarks/block_skipping.py`). A prompt's prefill is causal
attention here: the caches say when their mask lies within the top-left
causal mask (`cache.top_left_causal`, index 0), and the layers pass
`attend(within_causal=True)`, so each chunk skips the slots past its rows,
the cache's unwritten tail included; the other kernels take the mask as it
is (folding a causal mask in again is `(T, S)` work for nothing there).
Segment ids and lengths known only at run time skip nothing yet. Nor do
other cache offsets, whose index is traced, so no window is static; the
one caller with such an offset, a speculative verify pass, has `k + 1`
rows, so it goes in chunks only past `CHUNKED_FROM / ((k + 1) * H)` cache
slots (419,430 for `k = 4` and 32 heads), and otherwise runs a kernel that
takes the whole mask.

No speed rule: none measured wins by 10%. Reading a heads-major cache in
place in a decoding step was one; `benchmarks/dispatch.py` finds it level with
the fused kernel on JAX and slower on PyTorch.
"""

import dataclasses

import keras
from keras import ops

from keras_attn._checks import dims_differ

__all__ = [
    "AttentionPlan",
    "fused_limits",
    "plan_attention",
    "platform_of",
    "refuse_flash",
]

# The explicit path goes in chunks of query rows from `CHUNKED_FROM` logits
# per batch row (`H * T * S`: usually two chunks or more; 2,897 tokens for 8
# heads), each chunk of about `CHUNK_LOGITS` logits (at least `MIN_CHUNK_ROWS`
# rows), recomputed in the backward pass (`benchmarks/long_sequence.py`).
# 2**25 float32 logits are 128 MiB per batch row. Chunks of 2**23 took about
# twice as long on a CPU (skinny matmuls), and under 32 MiB (glibc's largest
# threshold for memory it maps itself) they left each chunk's freed memory
# resident on TensorFlow and PyTorch.
CHUNKED_FROM = 2**26
CHUNK_LOGITS = 2**25
MIN_CHUNK_ROWS = 16

# The chunked path's gradient: our own (FlashAttention's backward pass), which
# no backend's autodiff of the loop can undo, except on these backends, where
# each chunk goes under `keras.remat`: on PyTorch ours took 1.33x the time and
# 400 MiB more at 8,192 tokens (`benchmarks/long_sequence.py`; the A/B in
# `benchmarks/results/long_sequence_tensorflow.md`). On TensorFlow the
# gradient of Keras' `scan` does not compile under XLA.
CHUNKS_REMATERIALIZED = ("torch",)

# Where a length is known only at run time (a TensorFlow graph traced with
# `keras.Input((None, width))`), a training call on these backends still goes
# in chunks: their count and rows computed from the lengths in the graph
# (`RUNTIME`). XLA compiles such a graph for each concrete shape, so the loop
# is static there. Inference calls materialize: Keras' export converters
# (tf2onnx, LiteRT) fail on the loop (`tests/integration/test_export.py`).
# JAX always traces concrete shapes (`jax.export`'s symbolic ones aside).
# PyTorch's symbolic lengths materialize: `torch.export` fails on a loop
# counted from one, and `torch.compile(dynamic=True)` is not measured with it.
RUNTIME_CHUNKS = ("tensorflow",)
RUNTIME = "runtime"

# Rule 4's reason.
FLASH_DISABLED = "flash attention disabled by keras.config.disable_flash_attention()"
# Rule 7's reason.
LONG_SEGMENTS = "segment ids on a long sequence (no fused kernel takes them)"
# Rule 6's for float16: a compiled program's limit, not a fused kernel's
# choice (with `flash_attention=True` Keras' op refuses a CPU itself).
JAX_FLOAT16 = "float16 on JAX off a GPU (XLA refuses its float32 sums there)"


@dataclasses.dataclass(frozen=True)
class AttentionPlan:
    """How one attention call runs.

    Attributes:
        kernel: `"fused"` (the backend's fused kernel), `"materialized"` (the
            explicit path, all weights at once) or `"chunked"` (the explicit
            path in chunks of query rows).
        is_causal: bool. The kernel applies the causal mask itself (a fused
            kernel's `is_causal`); otherwise a causal mask, if any, is folded
            into the boolean mask.
        repeat_key_value_heads: bool. Grouped key/value heads are repeated to
            the query heads before a fused kernel.
        require_fused: bool. `flash_attention=True`: no fallback to a
            composite kernel.
        composite: bool. PyTorch's composite kernel only (`torch.export`
            tracing a dynamic length).
        chunk_rows: int, `"runtime"` or `None`. Query rows per chunk
            (`"chunked"` only); `"runtime"` where the lengths are known only
            at run time: the same rule, computed then
            (`runtime_rows_per_chunk`; the kernel gets its int32 tensor).
        chunk_gradient: `"own"` (FlashAttention's backward pass from each
            row's log-sum-exp) or `"remat"` (each chunk recomputed by
            `keras.remat`); `"chunked"` only.
        not_fused: tuple of str. Why no fused kernel runs (empty when one
            does).
    """

    kernel: str
    is_causal: bool = False
    repeat_key_value_heads: bool = False
    require_fused: bool = False
    composite: bool = False
    chunk_rows: int | str | None = None
    chunk_gradient: str | None = None
    not_fused: tuple = ()


def plan_attention(
    query_shape,
    key_shape,
    value_shape,
    dtype,
    *,
    heads_major=False,
    mask_shape=None,
    bias_shape=None,
    is_causal=False,
    dropout=False,
    return_scores=False,
    logit_soft_cap=None,
    sink_logits=False,
    flash_attention=None,
    backend=None,
    platform=None,
    exporting=False,
    segmented=False,
    banded=False,
    training=False,
):
    """The `AttentionPlan` for one call (the rules: this module's docstring).

    Args:
        query_shape: `(B, T, H, D)`.
        key_shape: `(B, S, K, D)`, or `(B, K, S, D)` with `heads_major`.
        value_shape: the keys' shape with the value width last.
        dtype: the query's dtype.
        heads_major: bool. Keys and values are heads-major (caches).
        mask_shape: shape of the rank-4 boolean mask, or `None`.
        bias_shape: shape of the rank-4 float bias, or `None`.
        is_causal: bool. Causal attention.
        dropout: bool. Dropout on the weights (training).
        return_scores: bool. The weights are returned.
        logit_soft_cap: float or `None`.
        sink_logits: bool. A sink logit per head joins the softmax.
        flash_attention: `None`, `True` or `False`.
        backend: Keras backend; defaults to the running one.
        platform: `"cpu"`, `"gpu"` or `"tpu"` (see `platform_of`); defaults
            to Keras' first device.
        exporting: bool. `torch.export` is tracing the call.
        segmented: bool. The call has segment ids (packed sequences): in
            chunks they ride with each chunk, elsewhere their mask `(B, 1,
            T, S)` is folded into the mask.
        banded: bool. The call has a band by position (a layer's sliding
            window): in chunks each chunk builds it, elsewhere its mask
            `(T, S)` is folded into the mask.
        training: bool. A training call (Keras' `training=True`): lengths
            known only at run time go in chunks (`RUNTIME_CHUNKS`).

    Returns:
        An `AttentionPlan`.
    """
    backend = backend or keras.config.backend()
    platform = platform or platform_of(None)
    not_fused = fused_limits(
        dropout=dropout,
        return_scores=return_scores,
        key_width=query_shape[-1],
        value_width=value_shape[-1],
        logit_soft_cap=logit_soft_cap,
        sink_logits=sink_logits,
        dtype=dtype,
    )
    if not_fused and flash_attention:
        refuse_flash(not_fused)
    key_length = key_shape[2 if heads_major else 1]
    chunk_rows = None
    if not (dropout or return_scores):
        runtime = training and backend in RUNTIME_CHUNKS
        chunk_rows = _rows_per_chunk(
            query_shape, key_length, mask_shape, bias_shape, runtime
        )
    if segmented or banded:  # their mask, folded in unless in chunks
        mask_shape = mask_shape or (query_shape[0], 1, query_shape[1], key_length)
    if flash_attention is None:
        not_fused += _explicit_here(backend, platform, chunk_rows, dtype)
        if segmented and isinstance(chunk_rows, int):
            not_fused += (LONG_SEGMENTS,)
    elif flash_attention is False:
        not_fused += ("flash_attention=False",)
    if not_fused and chunk_rows:
        gradient = "remat" if backend in CHUNKS_REMATERIALIZED else "own"
        return AttentionPlan(
            "chunked", chunk_rows=chunk_rows, chunk_gradient=gradient,
            not_fused=not_fused,
        )  # fmt: skip
    if not_fused:
        return AttentionPlan("materialized", not_fused=not_fused)
    grouped = query_shape[2] != key_shape[1 if heads_major else 2]
    return AttentionPlan(
        "fused",
        is_causal=is_causal and not _causal_in_mask(backend, mask_shape, bias_shape),
        repeat_key_value_heads=grouped and _repeat_groups(backend, platform, dtype),
        require_fused=bool(flash_attention),
        composite=flash_attention is None
        and _traced_dynamic(backend, exporting, query_shape, key_shape),
    )


def _explicit_here(backend, platform, chunk_rows, dtype):
    """Rules 4 to 6: where the explicit path runs though a fused kernel
    could compute the same."""
    if keras.config.is_flash_attention_enabled() is False:
        return (FLASH_DISABLED,)
    if backend == "tensorflow":
        return ("no fused TensorFlow kernel in Keras",)
    if backend != "jax":
        return ()
    if platform != "gpu" and keras.backend.standardize_dtype(dtype) == "float16":
        return (JAX_FLOAT16,)
    if chunk_rows and platform == "cpu":
        return ("XLA's CPU kernel materializes long sequences",)
    return ()


def _causal_in_mask(backend, mask_shape, bias_shape):
    """Whether the causal mask is folded into the mask rather than left to the
    kernel's `is_causal`: with a mask (so that empty rows are found), and on
    PyTorch with a bias too (SDPA raises for `attn_mask` with `is_causal`)."""
    return mask_shape is not None or (backend == "torch" and bias_shape is not None)


def _traced_dynamic(backend, exporting, query_shape, key_shape):
    """Whether `torch.export` traces a length it keeps dynamic (a symbolic
    dimension, not an int)."""
    lengths = (query_shape[1], key_shape[1], key_shape[2])
    return (
        backend == "torch"
        and exporting
        and not all(isinstance(n, int) for n in lengths)
    )


def _repeat_groups(backend, platform, dtype):
    """Whether grouped key/value heads are repeated before the fused kernel:
    on PyTorch on a GPU outside half precision, where `enable_gqa` runs only
    the composite kernel."""
    half = keras.backend.standardize_dtype(dtype) in ("float16", "bfloat16")
    return backend == "torch" and platform == "gpu" and not half


def fused_limits(
    *,
    dropout=False,
    return_scores=False,
    key_width=None,
    value_width=None,
    logit_soft_cap=None,
    sink_logits=False,
    dtype=None,
):
    """What no fused kernel computes among what is asked: the reasons, in words
    (empty when a fused kernel can)."""
    reasons = {
        "dropout on the attention weights": bool(dropout),
        "returning the attention weights": bool(return_scores),
        "values of another width than the keys' width": dims_differ(
            value_width, key_width
        ),
        "soft-capped logits": logit_soft_cap is not None,
        "sink logits": bool(sink_logits),
        "float64 inputs": dtype is not None
        and keras.backend.standardize_dtype(dtype) == "float64",
    }
    return tuple(reason for reason, applies in reasons.items() if applies)


def refuse_flash(reasons, received="", asked=None, advice=None):
    """Raise for `flash_attention=True` together with what only the explicit
    path computes. `received`: the arguments that asked for it, as text;
    `asked`: the call argument that needs the explicit path, if one does;
    `advice`: how to fix it, where the caller knows better than
    "pass `flash_attention=None`"."""
    lead = f"`{asked}` needs the explicit path, and " if asked else ""
    received = f" Received: flash_attention=True, {received}." if received else ""
    advice = advice or (
        "Pass `flash_attention=None` (fused where possible) or `False`."
    )
    raise ValueError(
        f"{lead}`flash_attention=True` needs the fused flash kernel, which "
        f"cannot compute attention with {' or '.join(reasons)}.{received} "
        f"{advice}"
    )


def _rows_per_chunk(query_shape, key_length, mask_shape, bias_shape, runtime):
    """Query rows per chunk of the explicit path, `RUNTIME` where the lengths
    are known only at run time and `runtime` allows it
    (`runtime_rows_per_chunk` then), or `None` to materialize. The masks'
    query axes must be static (whether they go with the rows or broadcast),
    and with static lengths their key axes too (the key windows slice them)."""
    length, heads = query_shape[1], query_shape[2]
    masks = [shape[2:] for shape in (mask_shape, bias_shape) if shape is not None]
    if not isinstance(heads, int) or any(shape[0] is None for shape in masks):
        return None
    if not all(isinstance(n, int) for n in (length, key_length)):
        return RUNTIME if runtime else None  # the keys all taken: axis 3 as is
    if any(None in shape for shape in masks) or (
        heads * length * key_length < CHUNKED_FROM
    ):
        return None
    return min(length, max(MIN_CHUNK_ROWS, CHUNK_LOGITS // (heads * key_length)))


def runtime_rows_per_chunk(length, heads, key_length):
    """`_rows_per_chunk`'s rule on lengths known only at run time (int32
    tensors): all `length` rows in one chunk below `CHUNKED_FROM` logits,
    which is the materialized computation."""
    logits = heads * key_length
    rows = ops.maximum(CHUNK_LOGITS // ops.maximum(logits, 1), MIN_CHUNK_ROWS)
    rows = ops.maximum(ops.minimum(rows, length), 1)
    # In float: int32 overflows at long lengths (32 heads of 65,536 keys).
    total = ops.cast(logits, "float32") * ops.cast(length, "float32")
    return ops.where(total < CHUNKED_FROM, ops.maximum(length, 1), rows)


def platform_of(tensor):
    """`"cpu"`, `"gpu"` or `"tpu"`: where a PyTorch `tensor` is, else where
    Keras computes (its first device, asked once per process)."""
    device = getattr(tensor, "device", None)
    if keras.config.backend() == "torch" and hasattr(device, "type"):
        return "gpu" if device.type == "cuda" else device.type
    if "platform" not in _PLATFORM:
        _PLATFORM["platform"] = _default_platform()
    return _PLATFORM["platform"]


_PLATFORM = {}


def _default_platform():
    if keras.config.backend() == "torch":  # no `keras.distribution` on PyTorch
        device = keras.ops.convert_to_tensor(0.0).device.type
    else:
        device = keras.distribution.list_devices()[0].split(":")[0].lower()
    return "gpu" if device == "cuda" else device
