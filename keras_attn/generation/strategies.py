"""Decoding strategies: they pick the next token from processed logits, and
know nothing about layers, padding or cache segments.

A strategy has `start(state)`, `choose(logits, state, numbers) -> (token,
log-probability of the token, state)` and `finish(state, numbers) -> (tokens,
scores)`. The state is a dict
of row-major tensors (`index`, a scalar, aside); `scores` are the
log-probabilities of the chosen tokens (greedy and sampling compute them only
where `scores=True`; their log-probability is `None` otherwise).
"""

import keras
from keras import ops

from keras_attn.generation.processors import LOWEST

# lowbias32 (C. Wellons, "Prospecting for hash functions", 2018): an integer
# hash good enough that its outputs look uniform. As int32, whose products wrap
# on every backend exactly as uint32 ones do.
_MULTIPLIERS = (0x7FEB352D, 0x846CA68B - 2**32)
_GOLDEN = 0x9E3779B9 - 2**32  # mixes the seed, row and step apart


def _shift_right(x, bits):
    """Logical right shift of int32 bits (`>>` on int32 keeps the sign)."""
    return ops.bitwise_and(ops.right_shift(x, bits), (1 << (32 - bits)) - 1)


def _hash(x):
    for multiplier, bits in zip(_MULTIPLIERS, (16, 15), strict=True):
        x = ops.bitwise_xor(x, _shift_right(x, bits))
        x = ops.multiply(x, ops.convert_to_tensor(multiplier, "int32"))
    return ops.bitwise_xor(x, _shift_right(x, 16))


def counter_uniform(seed, rows, step):
    """Uniform floats in [0, 1) from integer counters: the same bits on every
    backend, unlike `keras.random`, whose streams differ per backend.

    `seed` `(1,)`, `rows` `(R,)` and `step` (scalar) are int32; each `(seed,
    row, step)` gives its own draw, with 24 random bits.
    """
    golden = ops.convert_to_tensor(_GOLDEN, "int32")
    x = _hash(ops.bitwise_xor(ops.cast(step, "int32"), ops.multiply(seed, golden)))
    x = _hash(ops.bitwise_xor(x, ops.cast(rows, "int32")))
    return ops.cast(_shift_right(x, 8), "float32") * (1.0 / (1 << 24))


def draw(weights, uniform):
    """int32 `(...)`: a token per row of `weights` `(..., V)` (probabilities,
    or any nonnegative weights), by inverting their cumulative sum at
    `uniform` `(...)`."""
    cumulative = ops.cumsum(weights, axis=-1)
    target = uniform[..., None] * cumulative[..., -1:]
    token = ops.sum(ops.cast(cumulative <= target, "int32"), axis=-1)
    # Rounding can put the target past the last token with mass.
    vocabulary = weights.shape[-1]
    last = vocabulary - 1 - ops.argmax(ops.flip(weights > 0, axis=-1), -1)
    return ops.minimum(token, ops.cast(last, "int32"))


class Greedy:
    """The most likely token; its log-probability where `scores` are kept
    (a `log_softmax` over the vocabulary per step otherwise spent)."""

    def __init__(self, scores=True):
        self.scores = scores

    def start(self, state):
        return state

    def choose(self, logits, state, numbers):
        return self._with_log_prob(ops.argmax(logits, axis=-1), logits, state)

    def _with_log_prob(self, token, logits, state):
        """`(token, its log-probability or None, state)`."""
        if not self.scores:
            return token, None, state
        log_probs = ops.log_softmax(logits, axis=-1)
        log_prob = ops.take_along_axis(log_probs, ops.cast(token, "int32")[:, None], -1)
        return token, log_prob[:, 0], state

    def finish(self, state, numbers):
        return state["tokens"], state.get("scores")


class Sample(Greedy):
    """A draw from the softmax of the processed logits, by inverting its
    cumulative distribution at `counter_uniform(seed, row, step)`."""

    def choose(self, logits, state, numbers):
        rows = ops.arange(ops.shape(logits)[0], dtype="int32")
        uniform = counter_uniform(numbers["seed"], rows, state["index"])
        token = draw(ops.softmax(logits, axis=-1), uniform)
        return self._with_log_prob(token, logits, state)


class BeamSearch:
    """The `num_beams` most likely sequences per row, extended a token at a
    time; finished ones rank by `log p / length ** length_penalty`.

    Rows become `batch * num_beams` (a row's beams adjacent); each step
    reorders the whole state by the beam each new beam extends.
    """

    def __init__(self, num_beams, pad_token_id):
        self.beams, self.pad_token_id = num_beams, pad_token_id

    def start(self, state):
        state = {
            key: value if key == "index" else _map(_repeat(self.beams), value)
            for key, value in state.items()
        }
        rows = ops.shape(state["done"])[0]
        first = ops.arange(rows) % self.beams == 0  # identical beams start once
        state["beam_scores"] = ops.where(first, 0.0, LOWEST / 2)
        state["lengths"] = ops.zeros((rows,), "float32")
        return state

    def choose(self, logits, state, numbers):
        rows, vocabulary = ops.shape(logits)[0], logits.shape[-1]
        log_probs = ops.log_softmax(logits, axis=-1)
        finished = ops.where(ops.arange(vocabulary) == self.pad_token_id, 0.0, LOWEST)
        log_probs = ops.where(state["done"][:, None], finished, log_probs)
        total = state["beam_scores"][:, None] + log_probs
        scores, best = ops.top_k(
            ops.reshape(total, (-1, self.beams * vocabulary)), self.beams
        )
        origin = ops.reshape(
            best // vocabulary + ops.arange(rows // self.beams)[:, None] * self.beams,
            (-1,),
        )  # (rows,): the beam each new beam extends
        state = {
            key: value
            if key == "index"
            else _map(lambda x: ops.take(x, origin, 0), value)
            for key, value in state.items()
        }
        scores = ops.reshape(scores, (-1,))
        log_prob = scores - state["beam_scores"]
        state["beam_scores"] = scores
        state["lengths"] += ops.cast(ops.logical_not(state["done"]), "float32")
        return ops.reshape(best % vocabulary, (-1,)), log_prob, state

    def finish(self, state, numbers):
        ranks = (
            state["beam_scores"]
            / ops.maximum(state["lengths"], 1.0) ** numbers["length_penalty"]
        )
        best = ops.argmax(ops.reshape(ranks, (-1, self.beams)), axis=-1)
        best += ops.arange(ops.shape(best)[0]) * self.beams
        scores = state.get("scores")
        return ops.take(state["tokens"], best, 0), (
            None if scores is None else ops.take(scores, best, 0)
        )


def strategy(settings):
    if settings.method == "beam":
        return BeamSearch(settings.num_beams, settings.pad_token_id)
    kind = Sample if settings.method == "sample" else Greedy
    return kind(scores=settings.return_scores)


def _repeat(times):
    return lambda x: ops.repeat(x, times, axis=0)


def _map(function, tree):
    """`function` on every tensor of a nest, keeping its structure."""
    return keras.tree.map_structure(function, tree)
