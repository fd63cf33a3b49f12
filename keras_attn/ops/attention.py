"""Scaled dot-product attention, the public op: plan, then run the kernel."""

import dataclasses
import math

import keras
from keras import ops

from keras_attn import _jax_eager
from keras_attn._checks import (
    check_attention_inputs,
    check_attention_options,
    check_float,
    check_positive_float,
    check_segment_ids,
    exported_by_torch,
)
from keras_attn.ops.kernels import chunked, explicit, fused
from keras_attn.ops.kernels.blocks import KeyBand
from keras_attn.ops.kernels.options import KernelOptions
from keras_attn.ops.masks import merge_attention_masks, same_segment, window_band
from keras_attn.ops.plan import (
    RUNTIME,
    plan_attention,
    platform_of,
    runtime_rows_per_chunk,
)
from keras_attn.ops.positions import segment_runs

__all__ = ["DotProductAttention", "dot_product_attention"]


def dot_product_attention(
    query,
    key,
    value,
    mask=None,
    bias=None,
    is_causal=False,
    scale=None,
    flash_attention=None,
    dropout=None,
    return_scores=False,
    heads_major=False,
    logit_soft_cap=None,
    query_segment_ids=None,
    key_segment_ids=None,
    sink_logits=None,
):
    """Scaled dot-product attention, softmax(QK^T * scale + bias) V, safely masked.

    The attention plan (`keras_attn.ops.plan`) chooses the kernel: a fused
    one (on PyTorch torch's own `scaled_dot_product_attention`, with torch's
    kernel choice; elsewhere `keras.ops.dot_product_attention`, with
    cuDNN/flash kernels where the backend has them) or an explicit path that
    materializes the weights with float32 logits and softmax, can apply
    `dropout` to them and return them. For long sequences where no fused
    kernel runs, the explicit path goes in chunks of query rows, each
    recomputed in the backward pass, so that memory grows linearly in the
    length. All give the same numbers. Grouped-query keys and values (`K`
    heads for `H` query heads) reach the kernels unrepeated (but where the
    plan says a fused kernel needs them repeated). A query row whose mask
    allows no key at all attends to nothing: its output and its weights are
    zeros, never NaN. A NaN in the inputs gives NaN, but for torch's fused
    CPU kernel, which gives zeros for a query row holding a NaN where no mask
    or bias reaches it (torch's behaviour, left as it is: see the README).
    Symbolic inputs (`keras.Input`) give the outputs' `KerasTensor`s, as
    `keras.ops` does: the call is a node (`DotProductAttention`) of the
    functional model built from them, which saves; it takes no `dropout`.

    Args:
        query: `(B, T, H, D)`.
        key: `(B, S, K, D)`, or `(B, K, S, D)` with `heads_major`; `K` divides
            `H` (grouped-query attention).
        value: `(B, S, K, Dv)`, or `(B, K, S, Dv)` with `heads_major`.
        mask: optional bool of rank 2 `(T, S)`, 3 `(B, T, S)` or 4
            `(B, H, T, S)`, broadcastable; True = may attend.
        bias: optional float, broadcastable to `(B, H, T, S)` as numpy
            broadcasts (so a rank-3 bias is `(H, T, S)`, unlike a rank-3
            mask), added to the scaled logits (e.g. `alibi_bias`). Keep it
            finite; mask with `mask`.
        is_causal: bool. Also apply a lower-triangular mask (query `i` sees
            keys `j <= i`). Defaults to `False`.
        scale: float. Logit scale; defaults to `1 / sqrt(D)`.
        flash_attention: `None` (fused where it computes the same, unless
            `keras.config.disable_flash_attention()` was called), `True`
            (require a fused kernel, whatever Keras' switch says; raises where
            the backend has none for the inputs) or `False` (always the
            explicit path, in chunks for long sequences). Defaults to `None`.
        dropout: optional callable applied to the weights; it forces the
            explicit path, so pass it only when dropout is active.
        return_scores: bool. Also return the weights `(B, H, T, S)` (before
            dropout). Defaults to `False`.
        heads_major: bool. Keys and values are `(B, K, S, D)`, the layout of
            the key/value caches. Defaults to `False`.
        logit_soft_cap: optional float > 0. Soft-caps the scaled logits to
            `cap * tanh(logits / cap)` before the bias and the softmax (Gemma
            2); it needs the explicit path. Defaults to `None`.
        query_segment_ids: optional int `(B, T)`: packed sequences. Query
            `i` attends to key `j` only where both are in the same segment
            (ANDed with every other mask), padding not special-cased. A
            segment is a contiguous run of equal ids: an id that comes back
            later starts a new document (as in `segment_positions`). Long
            sequences go in chunks that carry the segments, so no `(T, S)`
            mask is built (the plan's rule 7); with `flash_attention=True`
            the fused kernel takes their `(B, 1, T, S)` mask, quadratic in
            the length.
        key_segment_ids: optional int `(B, S)`, with `query_segment_ids`:
            the keys' ids, compared by value (an id names one document on
            each side; runs of two sequences cannot be matched by
            position). Defaults to `query_segment_ids` (self-attention,
            `S == T`, by runs).
        sink_logits: optional float `(H,)`: a logit `s_h` per query head
            that joins each row's softmax denominator and is then dropped
            (gpt-oss's learned attention sinks): weights `exp(l_ij) /
            (sum_j' exp(l_ij') + exp(s_h))`, in float32, so a row's weights
            sum to less than 1. It needs the explicit path (no fused kernel
            takes it). Defaults to `None`.

    Returns:
        `(B, T, H, Dv)`, or `(output, weights)` with `return_scores=True`.

    Example:
    >>> q = np.random.rand(2, 3, 4, 8).astype("float32")
    >>> kv = np.random.rand(2, 5, 2, 8).astype("float32")  # 2 key/value heads
    >>> out = keras_attn.ops.dot_product_attention(q, kv, kv, mask=np.ones((3, 5)))
    >>> tuple(out.shape)
    (2, 3, 4, 8)
    """
    check_attention_options(
        is_causal, scale, flash_attention, dropout, return_scores, heads_major
    )
    check_attention_inputs(query, key, value, mask, bias, heads_major)
    check_positive_float("logit_soft_cap", logit_soft_cap, allow_none=True)
    segment_ids = _checked_segment_ids(
        query_segment_ids, key_segment_ids, query, key, heads_major
    )
    _check_sink_logits(sink_logits, query)
    tensors = (query, key, value, mask, bias, query_segment_ids, key_segment_ids)
    if any(isinstance(x, keras.KerasTensor) for x in (*tensors, sink_logits)):
        return _symbolic(
            tensors, sink_logits, is_causal=is_causal, scale=scale,
            flash_attention=flash_attention, dropout=dropout,
            return_scores=return_scores, heads_major=heads_major,
            logit_soft_cap=logit_soft_cap,
        )  # fmt: skip
    return attend(
        query, key, value, mask, bias, is_causal, scale, flash_attention,
        dropout, return_scores, heads_major, logit_soft_cap, segment_ids,
        sink_logits,
    )  # fmt: skip


def _symbolic(tensors, sink_logits, dropout, **options):
    """`dot_product_attention` on symbolic inputs: checked here, once, as an
    eager call is (its plan's refusals included), then a `DotProductAttention`
    node. No `dropout`: a callable hidden in the node is neither tracked by
    the model (a `keras.layers.Dropout`'s seed would never advance in a
    compiled `fit`) nor saveable."""
    if dropout is not None:
        raise ValueError(
            "`dot_product_attention` on symbolic inputs (`keras.Input`) takes no "
            "`dropout`: a functional model would neither track nor save it. Use "
            "`keras_attn.MultiHeadAttention(dropout=...)`, or a layer that owns "
            f"its `keras.layers.Dropout`. Received: dropout={dropout!r}."
        )
    query, key, value, mask, bias, query_ids, _ = tensors
    _planned(
        query, key, value, mask, bias, platform_of(query),
        is_causal=options["is_causal"],
        flash_attention=options["flash_attention"],
        return_scores=options["return_scores"],
        heads_major=options["heads_major"],
        logit_soft_cap=options["logit_soft_cap"],
        segmented=query_ids is not None,
        sinks=sink_logits is not None,
    )  # fmt: skip
    return DotProductAttention(**options)(*tensors, sink_logits)


@keras.saving.register_keras_serializable(package="keras_attn")
class DotProductAttention(keras.Operation):
    """`dot_product_attention` on symbolic inputs (`keras.Input`), as the
    functions of `keras.ops` do: the call gives the outputs' `KerasTensor`s
    and records the op, so that a functional model runs it on its tensors
    (checking them again, as every eager call does). The arguments are
    `dot_product_attention`'s options but `dropout`, and its config."""

    def __init__(
        self,
        is_causal=False,
        scale=None,
        flash_attention=None,
        return_scores=False,
        heads_major=False,
        logit_soft_cap=None,
        name=None,
    ):
        super().__init__(name=name)
        self.options = dict(
            is_causal=is_causal, scale=scale, flash_attention=flash_attention,
            return_scores=return_scores,
            heads_major=heads_major, logit_soft_cap=logit_soft_cap,
        )  # fmt: skip

    def call(self, query, key, value, mask=None, bias=None, query_segment_ids=None,
             key_segment_ids=None, sink_logits=None):  # fmt: skip
        return dot_product_attention(
            query, key, value, mask, bias, query_segment_ids=query_segment_ids,
            key_segment_ids=key_segment_ids, sink_logits=sink_logits,
            **self.options,
        )  # fmt: skip

    def compute_output_spec(self, query, key, value, *masks_and_sinks):
        batch, length, heads = query.shape[:3]
        output = keras.KerasTensor(
            (batch, length, heads, value.shape[-1]), dtype=query.dtype
        )
        if not self.options["return_scores"]:
            return output
        key_length = key.shape[2 if self.options["heads_major"] else 1]
        weights = keras.KerasTensor(
            (batch, heads, length, key_length), dtype=query.dtype
        )
        return output, weights

    def get_config(self):
        return {"name": self.name, **self.options}


def _check_sink_logits(sink_logits, query):
    """Raise unless `sink_logits` is `None` or a float `(H,)`, one per query head."""
    if sink_logits is None:
        return
    shape = tuple(getattr(sink_logits, "shape", ()))
    if shape != (query.shape[2],):
        raise ValueError(
            "`sink_logits` must have shape `(num_heads,)`, one logit per query "
            f"head. Received: sink_logits.shape={shape}, query heads="
            f"{query.shape[2]}."
        )
    check_float("sink_logits", sink_logits)


def _checked_segment_ids(query_ids, key_ids, query, key, heads_major):
    """The segments to compare, `(query (B, T), keys (B, S))`, or `None`,
    checked against the inputs: the run numbers of the query ids in
    self-attention, else both sides' ids (by value)."""
    if query_ids is None:
        if key_ids is not None:
            raise ValueError(
                "`key_segment_ids` needs `query_segment_ids`. Received: "
                f"query_segment_ids=None, key_segment_ids of shape "
                f"{tuple(getattr(key_ids, 'shape', ()))}."
            )
        return None
    batch, length = query.shape[0], query.shape[1]
    key_length = key.shape[2 if heads_major else 1]
    check_segment_ids(
        "query_segment_ids", query_ids, (batch, length), "(batch, query_length)"
    )
    if key_ids is None:
        name = "query_segment_ids (the keys' by default)"
        check_segment_ids(name, query_ids, (batch, key_length), "(batch, key_length)")
        runs = segment_runs(query_ids)  # (B, T)
        return runs, runs
    check_segment_ids(
        "key_segment_ids", key_ids, (batch, key_length), "(batch, key_length)"
    )
    return query_ids, key_ids


def attend(
    query,
    key,
    value,
    mask=None,
    bias=None,
    is_causal=False,
    scale=None,
    flash_attention=None,
    dropout=None,
    return_scores=False,
    heads_major=False,
    logit_soft_cap=None,
    segment_ids=None,
    sink_logits=None,
    band=None,
    training=False,
    within_causal=False,
):
    """`dot_product_attention` without its checks, for callers that checked
    what they pass (the layers check their own calls, once); `segment_ids`:
    the segments to compare, `(query (B, T), keys (B, S))` (in
    self-attention the run numbers `segment_runs`, computed once a call),
    or `None`; `sink_logits`: `(H,)` or `None` (a layer's weight); `band`:
    `(sliding_window, attention_sinks)`, a layer's band by position
    (`window_band`, query `i` at position `i`), or `None`: the chunked path
    builds it chunk by chunk and skips the keys outside it, the others fold
    it into the mask; `training`: a training call (the plan's
    `training`); `within_causal`: a promise that `mask` lies within the
    causal mask (a prefill's cache mask, `cache.top_left_causal`): the
    chunked path then skips the keys past each chunk's rows as with
    `is_causal`, and the other kernels take the mask as it is."""
    band = None if band is None else KeyBand(*band)
    platform = platform_of(query)
    mask, bias, plan = _planned(
        query, key, value, mask, bias, platform,
        is_causal=is_causal,
        flash_attention=flash_attention,
        return_scores=return_scores,
        heads_major=heads_major,
        logit_soft_cap=logit_soft_cap,
        segmented=segment_ids is not None,
        sinks=sink_logits is not None,
        dropout=dropout is not None,
        banded=band is not None,
        training=training,
    )  # fmt: skip
    # The promise is about a mask: with none, it holds nothing.
    within_causal = within_causal and mask is not None
    is_causal = is_causal or (within_causal and plan.kernel == "chunked")
    options = KernelOptions(
        scale=1.0 / math.sqrt(query.shape[-1]) if scale is None else scale,
        heads_major=heads_major,
        dropout=dropout,
        logit_soft_cap=logit_soft_cap,
        sink_logits=None if sink_logits is None else ops.convert_to_tensor(sink_logits),
    )
    tensors = (query, key, value, mask, bias, segment_ids)
    run = _in_one_program if _one_program(plan, tensors, options, platform) else _run
    segments = (segment_ids, band)
    output, weights = run(
        plan, query, key, value, mask, bias, is_causal, options, segments
    )
    return (output, weights) if return_scores else output


def _planned(query, key, value, mask, bias, platform, *, is_causal,
             flash_attention, return_scores, heads_major, logit_soft_cap,
             segmented, sinks, dropout=False, banded=False,
             training=False):  # fmt: skip
    """The call's mask and bias of rank 4 and its `AttentionPlan`, which
    raises for what no kernel can honour (`segmented`, `sinks`, `dropout`
    and `banded`: whether the call has them)."""
    mask = merge_attention_masks(mask)
    if bias is not None:  # rank 4, which every backend's fused kernel takes
        bias = ops.reshape(bias, (1,) * (4 - len(bias.shape)) + tuple(ops.shape(bias)))
    plan = plan_attention(
        tuple(query.shape),
        tuple(key.shape),
        tuple(value.shape),
        query.dtype,
        heads_major=heads_major,
        mask_shape=None if mask is None else tuple(mask.shape),
        bias_shape=None if bias is None else tuple(bias.shape),
        is_causal=is_causal,
        dropout=dropout,
        return_scores=return_scores,
        logit_soft_cap=logit_soft_cap,
        sink_logits=sinks,
        flash_attention=flash_attention,
        platform=platform,
        exporting=exported_by_torch(),
        segmented=segmented,
        banded=banded,
        training=training,
    )
    return mask, bias, plan


def _one_program(plan, tensors, options, platform):
    """Whether an eager call on JAX runs as one XLA program (`_jax_eager`):
    not with dropout (its Keras `SeedGenerator` is updated in place), nor
    for the fused kernel on a TPU (Keras' splash attention reads a concrete
    mask and falls back to XLA's for a traced one:
    `keras/src/backend/jax/nn.py`, `dot_product_attention`)."""
    return (
        options.dropout is None
        and not (plan.kernel == "fused" and platform == "tpu")
        and _jax_eager.eager((tensors, options.sink_logits))
    )


def _in_one_program(plan, query, key, value, mask, bias, is_causal, options, segments):
    """`_run` as one XLA program (`_jax_eager.run`): the tensors, the sink
    logits and segment ids among them, are its arguments, the rest static.
    Only here are the options split: elsewhere `_run` takes them as they
    are, with no copy on an eager PyTorch step's path."""
    segment_ids, band = segments
    tensors = (query, key, value, mask, bias, options.sink_logits, segment_ids)
    static = (plan, is_causal, dataclasses.replace(options, sink_logits=None), band)
    return _jax_eager.run(_run_tensors, tensors, static)


def _run_tensors(
    query, key, value, mask, bias, sink_logits, segment_ids,
    plan, is_causal, options, band,
):  # fmt: skip
    """`_run` with its tensors first and the static rest after, as
    `_jax_eager.run` calls it (`_in_one_program`)."""
    options = dataclasses.replace(options, sink_logits=sink_logits)
    segments = (segment_ids, band)
    return _run(plan, query, key, value, mask, bias, is_causal, options, segments)


def _folded(mask, segment_ids, band, query, key, heads_major):
    """`mask` with the segments' mask `(B, 1, T, S)` and the band's `(T, S)`
    merged in: for the kernels other than the chunked path, which builds
    both chunk by chunk."""
    if segment_ids is not None:
        mask = merge_attention_masks(mask, same_segment(*segment_ids))
    if band is not None:
        lengths = ops.shape(query)[1], ops.shape(key)[2 if heads_major else 1]
        mask = merge_attention_masks(
            mask, window_band(*lengths, band.window, sinks=band.sinks)
        )
    return mask


def _run(plan, query, key, value, mask, bias, is_causal, options, segments):
    """Carry out `plan`: `(output, weights)`, the weights `None` but on the
    materialized path; `segments`: `(segment_ids, band)`, which reach the
    chunked path as they are and the other kernels folded into the mask."""
    segment_ids, band = segments
    if plan.kernel != "chunked":
        mask = _folded(mask, segment_ids, band, query, key, options.heads_major)
    if plan.kernel == "fused":  # the kernel scales the logits
        output = fused.attention(
            query, key, value, mask, bias, is_causal, plan, options
        )
        return output, None
    # The explicit path scales the query: T x D products rather than T x S.
    query = _scaled(query, options.scale)
    if plan.kernel == "chunked":
        output = chunked.attention(
            query, key, value, mask, bias, is_causal,
            _counted(plan, query, key, options), options, segment_ids, band,
        )  # fmt: skip
        return output, None
    causal_offset = 0 if is_causal else None
    return explicit.attention(query, key, value, mask, bias, causal_offset, options)


def _counted(plan, query, key, options):
    """`plan` with its rows per chunk counted in the graph (an int32 tensor)
    where the plan leaves them to run time (`plan.RUNTIME`)."""
    if plan.chunk_rows != RUNTIME:
        return plan
    length, key_length = (
        ops.shape(query)[1],
        ops.shape(key)[2 if options.heads_major else 1],
    )
    rows = runtime_rows_per_chunk(length, query.shape[2], key_length)
    return dataclasses.replace(plan, chunk_rows=rows)


def _scaled(query, scale):
    """`query * scale` in the query's dtype. Keras' binary ops promote
    float64 to float32 on PyTorch from Keras 3.16 (`result_type`'s 64 -> 32
    rule, as JAX without x64), while its einsum is torch's, which keeps it;
    a float64 query is scaled by an einsum with the scalar."""
    dtype = keras.backend.standardize_dtype(query.dtype)
    scale = ops.convert_to_tensor(scale, dtype=dtype)
    if dtype == "float64":
        return ops.einsum("...,->...", query, scale)
    return ops.multiply(query, scale)
