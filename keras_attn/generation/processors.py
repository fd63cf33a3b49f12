"""Logits processors: small functions from float32 logits `(rows, vocabulary)`
to logits, as in Hugging Face's `LogitsProcessor`s. Their settings are
tensors (inputs of the compiled loop), so new values compile nothing.
"""

import numpy as np
from keras import ops

LOWEST = float(np.finfo("float32").min)  # a removed token: never chosen


def repetition_penalty(logits, seen, penalty):
    """Tokens already in the sequence (`seen`, bool `(rows, vocabulary)`)
    have positive logits divided and negative ones multiplied by `penalty`
    (Keskar et al., 2019; Hugging Face's rule). `inf` removes them: no token
    repeats. `1.0` changes nothing."""
    penalized = ops.where(logits > 0, logits / penalty, logits * penalty)
    penalized = ops.where(ops.isinf(penalty), LOWEST, penalized)
    return ops.where(seen, penalized, logits)


def suppress_end_tokens(logits, end_tokens, allowed):
    """Remove the end tokens (bool `(vocabulary,)`) until `allowed` (a bool
    scalar, `min_new_tokens` reached)."""
    return ops.where(
        ops.logical_and(end_tokens, ops.logical_not(allowed)), LOWEST, logits
    )


def temperature(logits, value):
    return logits / value


def descending(logits):
    """Each row's logits sorted from the largest: what `top_k` and `top_p`
    read, sorted once per step."""
    return ops.flip(ops.sort(logits, axis=-1), axis=-1)


def top_k(logits, sorted_logits, k):
    """Keep the `k` largest logits per row (and ties with the k-th); `k=0`
    keeps all. Returns the logits and their sorted form, both filtered (the
    removed ones are the smallest, so the sort still holds)."""
    vocabulary = logits.shape[-1]
    k = ops.where(k > 0, ops.minimum(k, vocabulary), vocabulary)
    kth = ops.take(sorted_logits, k - 1, axis=-1)  # (rows, 1)
    return (
        ops.where(logits < kth, LOWEST, logits),
        ops.where(sorted_logits < kth, LOWEST, sorted_logits),
    )


def top_p(logits, sorted_logits, p):
    """Keep the smallest set of most likely tokens whose probability reaches
    `p` (nucleus sampling, Holtzman et al., 2020); `p=1` keeps all."""
    probabilities = ops.softmax(sorted_logits, axis=-1)
    mass_before = ops.cumsum(probabilities, axis=-1) - probabilities
    kept = ops.logical_or(mass_before < p, p >= 1.0)
    threshold = ops.min(ops.where(kept, sorted_logits, np.inf), axis=-1, keepdims=True)
    return ops.where(logits < threshold, LOWEST, logits)
