"""The explicit path in chunks of query rows: memory linear in the length.

The forward pass goes one chunk at a time (`ops.scan`) and keeps, besides the
output, only each row's log-sum-exp of its logits. Every chunk sees all the
keys it may see at once, so its softmax is the materialized one, row for row.

The gradient is our own (`ops.custom_gradient`), again one chunk at a time:
each chunk's weights are recomputed from its logits and the saved
log-sum-exp, and the softmax's gradient follows FlashAttention's backward
pass (Dao et al., 2022, Algorithm 4): `dP = dO V^T`, `dS = P * (dP -
rowsum(dO * O))`, `dQ = dS K`, `dK += dS^T Q`, `dV += P^T dO`. No backend
differentiates a loop here, so none can keep a chunk's weights for the
gradient. `keras.remat` around each chunk, which PyTorch keeps (the plan's
`chunk_gradient`, `plan.CHUNKS_REMATERIALIZED`, `recomputed.py`), failed to
compile under XLA on TensorFlow, where Keras trains with XLA on a GPU: the
gradient of Keras' TensorFlow `scan`, a `tf.while_loop` without
`maximum_iterations`, asks XLA for "a fixed tensor list size". It also
recomputes each chunk's output in the backward pass: 8 matrix products a
chunk, 7 here, 6 materialized.

Where the masks by position hide keys from whole chunks (causal attention,
a sliding window's band, `blocks.KeyBand`), each chunk computes only a
window of keys (`blocks.key_windows`), forward and backward: the chunks go
in a few loops, each with its own static window width. Where a group's windows hold
few keys (a band's, a causal call's narrower groups), the backward loop
stacks each chunk's gradients of its keys and adds them after it
(`_backward_stacked`); otherwise it carries the keys' gradients, summed.

Sink logits (gpt-oss: a logit per head in each row's denominator) join each
row's log-sum-exp `L`; the sink's weight `exp(s_h - L)` has no value, so its
logit's gradient is `-sum exp(s_h - L) rowsum(dO * O)` over the rows.
"""

import dataclasses
from typing import Any, NamedTuple

import keras
from keras import ops

from keras_attn.ops.dtypes import at_least_float32
from keras_attn.ops.kernels import blocks, explicit, recomputed
from keras_attn.ops.kernels.chunk_layout import (
    chunking,
    in_chunks,
    joined,
    put,
    split,
    stacked,
)
from keras_attn.ops.masks import zero_empty_rows


class Masking(NamedTuple):
    """What masks a chunk's logits: the mask and bias (`None` or rank 4),
    `is_causal`, and the segments to compare, `(query (B, T), keys (B, S))`
    or `None` (see `attention.attend`), and the `blocks.KeyBand` each
    chunk builds from the positions, or `None`."""

    mask: Any
    bias: Any
    is_causal: bool
    segments: Any
    band: Any = None


def attention(
    query, key, value, mask, bias, is_causal, plan, options, segment_ids=None,
    band=None,
):  # fmt: skip
    """The explicit path on `query` `(B, T, H, D)` (already scaled) in chunks
    of about `plan.chunk_rows` query rows, with the plan's `chunk_gradient`;
    returns `(B, T, H, Dv)`.

    The rows are padded to whole chunks, and the padding cut off.
    `segment_ids`: the segments to compare, `(query (B, T), keys (B, S))`,
    or `None`; the query's go in chunks with the rows, and each chunk builds
    its mask from them. `band`: a `blocks.KeyBand` (a sliding window and
    its sinks) each chunk applies from the positions, or `None`; with it or
    `is_causal`, each chunk computes only the keys it may see (not with a
    bias).
    """
    masking = Masking(mask, bias, is_causal, segment_ids, band)
    length = ops.shape(query)[1]
    count, rows = chunking(length, plan.chunk_rows)
    windows = None
    if bias is None and isinstance(count, int):
        key_length = key.shape[2 if options.heads_major else 1]
        windows = blocks.key_windows(length, key_length, count, rows, is_causal, band)
    # What may need a gradient is an argument: the bias and the sinks too.
    extra = {"bias": bias, "sink_logits": options.sink_logits}
    extra = {name: x for name, x in extra.items() if x is not None}
    if plan.chunk_gradient == "remat":
        return recomputed.attention(
            query, key, value, masking, (count, rows, windows), options, extra
        )

    @ops.custom_gradient
    def attend(query, key, value, *tensors):
        inputs = (query, key, value, *tensors)
        given = dict(zip(extra, tensors, strict=True))
        sinks = given.get("sink_logits")
        own = dataclasses.replace(options, sink_logits=sinks)
        chunks, shared = split(
            query, masking._replace(bias=given.get("bias")), count, rows
        )
        output, log_sum = (
            stacked(parts)
            for parts in zip(
                *(
                    _forward(group, shared, key, value, own, window)
                    for group, window in blocks.chunk_groups(chunks, windows, masking)
                ),
                strict=True,
            )
        )

        def gradient(*args, upstream=None):
            # Keras' documented signature for every backend's custom gradient.
            upstream = args[0] if upstream is None else upstream
            upstream = in_chunks(upstream, 1, count, rows)  # (N, B, C, H, Dv)
            sums = _backward(
                chunks, shared, key, value, output, log_sum, upstream, own,
                (windows, masking),
            )  # fmt: skip
            grads = [joined(sums["query"], length), sums["key"], sums["value"]]
            if "bias" in given:  # chunked like the bias: `(N, B|1, H|1, C, S)` per row
                per_row = "bias" in chunks
                grads.append(
                    joined(sums["bias"], length, 2) if per_row else sums["bias"]
                )
            if sinks is not None:
                grads.append(sums["sink_logits"])
            return tuple(
                ops.cast(g, x.dtype) for g, x in zip(grads, inputs, strict=True)
            )

        return joined(output, length), gradient

    return attend(query, key, value, *extra.values())


def _forward(chunks, all_shared, all_key, all_value, options, window):
    """Each chunk's output `(N, B, C, H, Dv)` and its rows' log-sum-exp of the
    logits `(N, B, H, C, 1)`; `window`: the keys each computes (`blocks.windowed`)."""
    value = all_value

    def step(previous, index):
        chunk = {name: ops.take(x, index, axis=0) for name, x in chunks.items()}
        chunk, shared, key, value = blocks.windowed(
            chunk, all_shared, all_key, all_value, window, options
        )
        logits, _, has_key = _logits(chunk, shared, key, options, window)
        if options.sink_logits is not None:  # a last key, dropped after
            logits = explicit.with_sinks(logits, options.sink_logits)
        top = ops.max(logits, axis=-1, keepdims=True)
        exp = ops.exp(logits - top)  # softmax as Keras computes it
        total = ops.sum(exp, axis=-1, keepdims=True)
        if options.sink_logits is not None:
            exp = exp[..., :-1]
        probs = ops.cast(exp / total, value.dtype)
        output = explicit.combine(probs, value, options)  # (B, C, H, Dv)
        output = zero_empty_rows(output, None, has_key)[0]
        result = (output, top + ops.log(total))
        return result, result

    # `ops.scan`, not `ops.map`: TensorFlow's map runs 10 chunks at once. Its
    # scan wants outputs shaped like the carry, which is the previous chunk's
    # output (unused). It goes over the chunks' indices: Keras' TensorFlow
    # scan fails for several inputs of unknown count (3.15.1: it asserts
    # their counts on `None`), which the lengths known at run time give.
    query = chunks["query"]  # (N, B, C, H, D)
    count, batch, rows = (ops.shape(query)[axis] for axis in range(3))
    heads = query.shape[3]
    first = (
        ops.zeros((batch, rows, heads, value.shape[-1]), dtype=value.dtype),
        ops.zeros((batch, heads, rows, 1), dtype=at_least_float32(query.dtype)),
    )
    return ops.scan(step, first, ops.arange(count, dtype="int32"))[1]


def _backward(
    chunks, shared, key, value, output, log_sum, upstream, options, layout
):  # fmt: skip
    """The gradients, summed over the chunks: `query` `(N, B, C, H, D)`,
    `key`, `value`, and `bias` (chunked like the bias), in float32;
    `layout`: `(windows, masking)`, the keys each chunk computes
    (`blocks.KeyWindows` or `None`) and the `Masking`."""
    windows, masking = layout
    width = chunks["query"].shape[-1]
    chunks, sums = _backward_start(
        chunks, shared, key, value, output, log_sum, upstream
    )
    # A loop per group (one without windows, the bias's gradient too), the
    # keys' gradients carried through or stacked.
    chunks = {**chunks, "rows": sums.pop("rows")}
    parts = []
    key_length = key.shape[2 if options.heads_major else 1]
    for group, window in blocks.chunk_groups(chunks, windows, masking):
        rows = group.pop("rows")
        if _stacks_keys(rows.shape[0], window, key_length, rows.dtype):
            sums, rows = _backward_stacked(
                group, rows, shared, (key, value), options, window, sums
            )
        else:
            sums["rows"] = rows
            sums = _backward_loop(group, shared, (key, value), options, window, sums)
            rows = sums.pop("rows")
        parts.append(rows[..., :width])
    sums["query"] = stacked(parts)
    if options.sink_logits is not None:
        sums["sink_logits"] = _sink_gradient(options.sink_logits, log_sum, chunks)
    return sums


def _backward_loop(chunks, all_shared, keys_values, options, window, sums):
    """`sums` with the gradients of `chunks` added, one chunk after the
    other, each over the keys of `window` (`blocks.windowed`)."""
    per_row = "bias" in chunks
    chunks = {name: x for name, x in chunks.items() if name != "bias"}

    def step(index, sums):
        chunk = {name: ops.take(x, index, axis=0) for name, x in chunks.items()}
        if per_row:
            chunk["bias"] = ops.take(sums["bias"], index, axis=0)
        rows = ops.take(sums["rows"], index, axis=0)
        chunk, grads = _gradients_of(
            chunk, rows, all_shared, keys_values, options, window
        )
        rows = ops.concatenate(
            [grads["query"], ops.zeros_like(chunk["upstream"])], axis=-1
        )
        sums = {
            **sums,
            "rows": put(sums["rows"], index, rows),
            **{
                name: blocks.add_keys(sums[name], grads[name], chunk, window, options)
                for name in ("key", "value")
            },
        }
        if per_row:
            sums["bias"] = put(sums["bias"], index, grads["bias"])
        elif "bias" in sums:
            sums["bias"] = sums["bias"] + grads["bias"]
        return sums

    return ops.fori_loop(0, ops.shape(sums["rows"])[0], step, sums)


def _stacks_keys(count, view, key_length, dtype):
    """Whether a group of `count` chunks over the keys of `view` (a
    `blocks.View`) stacks its gradients of the keys (`_backward_stacked`):
    where its windows hold at most `blocks.STACKED_KEYS` times the `key_length`
    keys, e.g. a sliding window's band, and the gradients (in `dtype`) are
    float32: Keras' PyTorch `segment_sum` adds in float32 (3.15.1), which
    would round float64 gradients."""
    if keras.backend.standardize_dtype(dtype) != "float32":
        return False
    return blocks.few_keys(count, view, key_length)


def _backward_stacked(chunks, rows, all_shared, keys_values, options, view, sums):
    """`_backward_loop` for a group whose windows `_stacks_keys`: the loop
    carries nothing. Each chunk's gradients of its rows `rows` (query and
    upstream gradient) and of its window of keys are stacked (`ops.scan`),
    and the keys' added to `sums` after the loop, in one sum by position.
    Returns `(sums, the rows' gradients (N, B, C, H, D))`."""
    width = rows.shape[-1] - sums["value"].shape[-1]
    axis = 2 if options.heads_major else 1

    def step(previous, index):
        chunk = {name: ops.take(x, index, axis=0) for name, x in chunks.items()}
        own = ops.take(rows, index, axis=0)
        grads = _gradients_of(chunk, own, all_shared, keys_values, options, view)[1]
        grads = {name: ops.cast(grads[name], rows.dtype) for name in first}
        return grads, grads

    # Keras' TensorFlow scan stacks outputs shaped like its carry (unused).
    first = {"query": ops.zeros((*ops.shape(rows)[1:-1], width), rows.dtype)}
    for name, x in zip(("key", "value"), keys_values, strict=True):
        shape = list(ops.shape(x))
        shape[axis] = view.sinks + view.width
        first[name] = ops.zeros(shape, rows.dtype)
    count = ops.shape(rows)[0]
    stack = ops.scan(step, first, ops.arange(count, dtype="int32"))[1]
    added = {
        name: blocks.add_windows(
            sums[name], stack[name], chunks["start"], view, options
        )
        for name in ("key", "value")
    }
    return {**sums, **added}, stack["query"]


def _gradients_of(chunk, rows, all_shared, keys_values, options, view):
    """`(chunk, gradients)`: one chunk's inputs over the keys of `view`
    (`blocks.windowed`), its query and upstream gradient read from its
    `rows` `(B, C, H, D + Dv)`, and its share of the gradients."""
    width = rows.shape[-1] - keys_values[1].shape[-1]
    chunk = {**chunk, "query": rows[..., :width], "upstream": rows[..., width:]}
    chunk, shared, key, value = blocks.windowed(
        chunk, all_shared, *keys_values, view, options
    )
    return chunk, _chunk_gradients(chunk, shared, key, value, options, view)


def _sink_gradient(sink_logits, log_sum, chunks):
    """d loss / d sink logits `(H,)`: the sink's weight `exp(s_h - L)` is a
    softmax weight like the keys', so its logit's gradient is `P (dP - D)`
    with `dP = 0` (it has no value): `-sum exp(s_h - L_bhi) D_bhi` over the
    batch and the rows (padding rows and empty rows have `D = 0`)."""
    sinks = ops.reshape(ops.cast(sink_logits, log_sum.dtype), (1, 1, -1, 1, 1))
    weights = ops.exp(sinks - log_sum)  # (N, B, H, C, 1)
    return -ops.sum(weights * chunks["delta"], axis=(0, 1, 3, 4))


def _backward_start(chunks, shared, key, value, output, log_sum, upstream):
    """`(chunks, sums)`: what each backward step reads, and the sums it adds
    to. Each step reads its chunk's rows (query, upstream gradient, a bias
    per row) from the stacks it then writes their gradients into, so the
    steps run one after the other: TensorFlow's while loop (as
    `ops.fori_loop` runs it) would start up to 10 at once, each with its
    chunk's weights."""
    wide = log_sum.dtype
    upstream = ops.cast(upstream, wide)
    # rowsum(dO * O), the softmax gradient's subtrahend: (N, B, H, C, 1)
    delta = ops.sum(upstream * ops.cast(output, wide), axis=-1)
    delta = ops.expand_dims(ops.moveaxis(delta, -1, 2), -1)
    query = ops.cast(chunks["query"], wide)
    sums = {
        "rows": ops.concatenate([query, upstream], axis=-1),  # (N, B, C, H, D+Dv)
        "key": ops.zeros(ops.shape(key), wide),
        "value": ops.zeros(ops.shape(value), wide),
    }
    if "bias" in chunks:
        sums["bias"] = ops.cast(chunks["bias"], wide)  # (N, B|1, H|1, C, S)
    elif "bias" in shared:
        sums["bias"] = ops.zeros(ops.shape(shared["bias"]), wide)
    rest = {name: x for name, x in chunks.items() if name != "query"}
    return {**rest, "log_sum": log_sum, "delta": delta}, sums


def _chunk_gradients(chunk, shared, key, value, options, view):
    """One chunk's share of the gradients (FlashAttention's backward pass)
    over the keys of `view`."""
    wide = chunk["log_sum"].dtype
    logits, capped, has_key = _logits(chunk, shared, key, options, view)
    probs = ops.exp(logits - chunk["log_sum"])  # (B, H, C, S)
    upstream = zero_empty_rows(chunk["upstream"], None, has_key)[0]  # (B, C, H, Dv)
    heads = key.shape[1 if options.heads_major else 2]
    d_value = explicit.combine_rows(
        ops.cast(probs, value.dtype), upstream, heads, options
    )
    d_probs = explicit.scores(upstream, value, options)
    d_logits = probs * (d_probs - chunk["delta"])
    d_scores = d_logits
    if options.logit_soft_cap is not None:  # d tanh(x) = 1 - tanh(x)^2
        d_scores = d_logits * (1.0 - ops.square(capped / options.logit_soft_cap))
    query = ops.cast(chunk["query"], wide)
    grads = {
        "query": explicit.combine(d_scores, ops.cast(key, wide), options),
        "key": explicit.combine_rows(d_scores, query, heads, options),
        "value": d_value,
    }
    bias = chunk.get("bias", shared.get("bias"))
    if bias is not None:  # summed over the axes it broadcasts
        axes = [
            axis
            for axis in range(4)
            if bias.shape[axis] == 1 and d_logits.shape[axis] != 1
        ]
        grads["bias"] = (
            ops.sum(d_logits, axis=axes, keepdims=True) if axes else d_logits
        )
    return grads


def _logits(chunk, shared, key, options, view):
    """A chunk's masked logits `(B, H, C, S)` over the keys of `view`, its
    soft-capped scores before the bias, and which rows have a key
    `(B, 1|H, C, 1)` (`None`: all)."""
    query = chunk["query"]
    bias = chunk.get("bias", shared.get("bias"))
    keyed = blocks.rows_have_keys(chunk, shared, view)
    mask = blocks.chunk_mask(chunk, shared)
    mask, has_key = explicit.visible(
        mask, chunk.get("offset"), query, key, options, keyed
    )
    capped = explicit.soft_cap(explicit.scores(query, key, options), options)
    logits = capped if bias is None else capped + ops.cast(bias, capped.dtype)
    return explicit.masked(logits, mask), capped, has_key
