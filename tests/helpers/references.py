"""Float64 numpy references, straight from the definitions: attention, the
position encodings, and what `generate` must return."""

import numpy as np

from tests.helpers.backend import to_numpy

# float32's unit roundoff
EPS32 = 2.0**-24


# --- Attention and positions --------------------------------------------------


def dot_product_reference(
    query, key, value, mask=None, bias=None, soft_cap=None, sink_logits=None
):
    """softmax(QK^T / sqrt(D) + bias) V in float64, the formula of
    `keras_attn.ops.dot_product_attention`.

    `query` `(B, T, H, D)`; `key`, `value` `(B, S, K, D|Dv)` with `K` dividing
    `H` (query head `h` uses key/value head `h // (H // K)`); `mask`: bool
    broadcastable to `(B, H, T, S)`, True where attention is allowed; `bias`:
    float broadcastable to `(B, H, T, S)`; `soft_cap`: logits become
    `soft_cap * tanh(logits / soft_cap)` before the bias; `sink_logits`
    `(H,)`: gpt-oss's sinks, a last logit column of each row, its weight
    dropped after the softmax (transformers' `eager_attention_forward`). Returns
    `(context (B, T, H, Dv), weights (B, H, T, S))`; a query row that may
    attend to no key gives zeros (the documented behaviour), not NaN.
    """
    group = query.shape[2] // key.shape[2]
    key, value = np.repeat(key, group, axis=2), np.repeat(value, group, axis=2)
    logits = np.einsum("bthd,bshd->bhts", query, key) / np.sqrt(query.shape[-1])
    if soft_cap is not None:  # Gemma 2
        logits = soft_cap * np.tanh(logits / soft_cap)
    if bias is not None:
        logits = logits + bias
    if mask is not None:
        logits = np.where(mask, logits, -np.inf)
    keys = logits.shape[-1]
    if sink_logits is not None:
        sinks = np.asarray(sink_logits, np.float64)[None, :, None, None]
        sinks = np.broadcast_to(sinks, (*logits.shape[:-1], 1))
        logits = np.concatenate([logits, sinks], axis=-1)
    with np.errstate(invalid="ignore"):
        weights = np.exp(logits - logits.max(-1, keepdims=True))
        weights = (weights / weights.sum(-1, keepdims=True))[..., :keys]
    weights = np.nan_to_num(weights, nan=0.0)  # rows with no allowed key
    return np.einsum("bhts,bshd->bthd", weights, value), weights


def attention_reference(layer, query, value, mask=None, bias=None):
    """softmax(QK^T / sqrt(d_k) + bias) V W_O from a MultiHeadAttention's own
    weights, in float64. `mask`: bool broadcastable to `(B, H, T, S)`; a query
    row that may attend to no key gives the output bias alone (the layer's
    documented behaviour), not NaN. A projection without a bias adds 0; the
    layer's `sink_logits`, where it has them, join the softmax."""
    w = {
        name: {
            p: 0.0 if w is None else to_numpy(w).astype(np.float64)
            for p, w in (("kernel", dense.kernel), ("bias", dense.bias))
        }
        for name, dense in (
            ("q", layer.query_dense),
            ("k", layer.key_dense),
            ("v", layer.value_dense),
            ("o", layer.output_dense),
        )
    }
    q = np.einsum("btd,dhk->bthk", query, w["q"]["kernel"]) + w["q"]["bias"]
    k = np.einsum("bsd,dhk->bshk", value, w["k"]["kernel"]) + w["k"]["bias"]
    v = np.einsum("bsd,dhk->bshk", value, w["v"]["kernel"]) + w["v"]["bias"]
    sinks = getattr(layer, "sink_logits", None)
    sinks = None if sinks is None else to_numpy(sinks).astype(np.float64)
    context, _ = dot_product_reference(q, k, v, mask, bias, sink_logits=sinks)
    return np.einsum("bthk,hko->bto", context, w["o"]["kernel"]) + w["o"]["bias"]


def reference_encoding(length, dim, max_wavelength=10000.0, start=0):
    """The paper's sinusoid in float64, straight from its definition; and the
    angles (the float32 error bound grows with them)."""
    pos = np.arange(start, start + length, dtype=np.float64)[:, None]
    i = np.arange(dim)[None, :]
    angles = pos / np.power(max_wavelength, (2 * (i // 2)) / dim)
    return np.where(i % 2 == 0, np.sin(angles), np.cos(angles)), angles


def rotary_reference(x, positions, max_wavelength=10000.0, scaling_factor=1.0):
    """Rotate-half RoPE in float64, from its definition; and the angles."""
    dim = x.shape[-1]
    inverse = np.power(max_wavelength, -np.arange(0, dim, 2) / dim) / scaling_factor
    angles = np.asarray(positions, np.float64)[..., None] * inverse  # (..., T, D/2)
    angles = np.concatenate([angles, angles], -1)
    angles = angles[..., None, :] if angles.ndim == 3 else angles[None, :, None, :]
    half = dim // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], -1)
    return x * np.cos(angles) + rotated * np.sin(angles), angles


def visible_positions_reference(
    index, count, length, real=None, window=None, sinks=None
):
    """Which of `length` key positions the queries at `index, ..., index +
    count - 1` see, bool `(B or 1, count, length)`, from the definitions: key
    `p` at or before query `q`, a real token (`real` `(B, length)`), and
    with a `window`, `q - p < window` or `p` among the row's first `sinks`
    real positions (counted from its first real one)."""
    query = index + np.arange(count)[:, None]  # (count, 1)
    key = np.arange(length)[None, :]  # (1, length)
    real = np.ones((1, length), bool) if real is None else np.asarray(real, bool)
    seen = (key <= query)[None] & real[:, None, :]
    if window is not None:
        first = real.argmax(axis=1)[:, None, None]  # (B, 1, 1)
        near = (query - key < window)[None] | (key[None] < first + (sinks or 0))
        seen = seen & near
    return seen


def masking_bias(mask):
    """An additive bias that does what the boolean `mask` does."""
    return np.where(mask, 0.0, -1e9).astype("float32")


# --- Generation --------------------------------------------------------------


def next_token_logits(model, prefix, source=None, width=16):
    """The model's logits after `prefix`, from a call on the whole prefix.

    The prefix sits in a fixed-width buffer of trailing padding, which the causal
    decoder cannot see, so every call has one shape (JAX compiles it once).
    """
    ids = np.zeros((1, width), "int32")
    ids[0, : len(prefix)] = prefix
    inputs = ids if source is None else [np.array([source], "int32"), ids]
    return to_numpy(model(inputs))[0, len(prefix) - 1]


def naive_greedy(model, prompt, max_length, source=None):
    """Call the model on the whole prefix, take the argmax, repeat."""
    sequence = list(prompt)
    while len(sequence) < max_length:
        sequence.append(int(next_token_logits(model, sequence, source).argmax()))
    return sequence


def reference_decode(
    model,
    prompt,
    max_length,
    repetition_penalty=1.0,
    end_token_ids=(),
    min_new_tokens=0,
    pad_token_id=0,
):
    """Greedy decoding as Hugging Face's `generate` runs it, on the whole
    prefix each step, in float64: the repetition penalty (finite; logits of
    tokens seen so far divided if positive, multiplied if negative), end
    tokens removed before `min_new_tokens` new ones, the argmax; after an end
    token, `pad_token_id`. Returns `(tokens, scores)` as lists, scores the
    log-softmax of the processed logits at each chosen token (0 in the prompt
    and after the end)."""
    tokens, scores = list(prompt), [0.0] * len(prompt)
    while len(tokens) < max_length:
        logits = next_token_logits(model, tokens).astype(np.float64)
        seen = np.isin(np.arange(len(logits)), tokens)
        penalized = np.where(
            logits > 0, logits / repetition_penalty, logits * repetition_penalty
        )
        logits = np.where(seen, penalized, logits)
        if len(tokens) - len(prompt) < min_new_tokens:
            logits[list(end_token_ids)] = -np.inf
        token = int(logits.argmax())
        shifted = logits - logits.max()
        log_probs = shifted - np.log(np.exp(shifted).sum())
        tokens.append(token)
        scores.append(float(log_probs[token]))
        if token in end_token_ids:
            break
    padding = max_length - len(tokens)
    return tokens + [pad_token_id] * padding, scores + [0.0] * padding


def counter_uniform_reference(seed, rows, step):
    """`keras_attn.generation.strategies.counter_uniform` in np.uint32, whose
    arithmetic wraps: lowbias32 (C. Wellons, 2018) of `step ^ seed * golden`,
    then of that `^ row`; the top 24 bits over 2**24. `rows` an int array."""

    def lowbias32(x):
        x = x ^ (x >> np.uint32(16))
        x = x * np.uint32(0x7FEB352D)
        x = x ^ (x >> np.uint32(15))
        x = x * np.uint32(0x846CA68B)
        return x ^ (x >> np.uint32(16))

    with np.errstate(over="ignore"):
        golden = np.uint32(0x9E3779B9)
        x = lowbias32(np.uint32(step) ^ (np.uint32(seed) * golden))
        x = lowbias32(x ^ np.asarray(rows).astype(np.uint32))
    return (x >> np.uint32(8)).astype(np.float64) / 2**24
