"""Speculative decoding (Leviathan et al., 2022): a small draft model proposes
`k` tokens one at a time, the target model scores them all in one pass, and
the longest prefix the target agrees with is kept, plus one token of the
target's own.

Greedy keeps the tokens of plain greedy decoding; sampling uses the paper's
rejection rule (`rejection_sample`), so the tokens follow the target's
distribution. The loop is `loop.Generator`'s, with a round of `k + 1` new
positions in the place of a step. Its state:

- `index`: the next position to fill; the token at `index - 1` is written
  ("pending") and both caches hold every position before it. A round runs
  both models from the pending token on. After a round neither model has
  run it (it is the target's own token: a replacement or the bonus); in the
  first round it is the prompt's last token, which prefill ran, and the
  round writes the same keys and values again. Rolling back after a
  rejection is moving `index`: cache positions past it are hidden by the
  causal mask and written again.
- `tokens` `(B, length + k + 1)`: a round writes `k + 1` columns at `index`
  (those past what it keeps as padding); the spare columns are cut off.
- `target`, `draft`: each model's state (its adapter's); `done`, `scores`
  as in `Generator`; `accepted`, `proposed`: the draft tokens accepted and
  proposed over the rows still running, for the acceptance rate.
"""

import functools

from keras import ops

from keras_attn.generation import strategies
from keras_attn.generation.adapter import pad_to
from keras_attn.generation.loop import (
    Generator,
    is_end_token,
    numbered,
    shapes_key,
)
from keras_attn.generation.settings import NUMBERS
from keras_attn.layers._lean_call import SublayerCalls

# Random streams of a round: a draft token's draw, its acceptance test, the
# token that replaces it (or the bonus one after the last).
_DRAFT, _ACCEPT, _RESIDUAL = range(3)


def rejection_sample(p, q, proposals, accept_uniform, residual_uniform):
    """Leviathan et al.'s rule: `(accepted, replacement)`, each `(...)`.

    `proposals` were drawn from `q`; each is accepted with probability
    `min(1, p(x) / q(x))`, else replaced by a draw from `max(0, p - q)`
    (normalized). Either way the result follows `p`. `p`, `q` `(..., V)` are
    probabilities, the uniforms `(...)` in [0, 1).
    """
    x = ops.cast(proposals, "int32")[..., None]
    p_x = ops.take_along_axis(p, x, axis=-1)[..., 0]
    q_x = ops.take_along_axis(q, x, axis=-1)[..., 0]
    accepted = accept_uniform * q_x < p_x  # u < p(x) / q(x), without dividing
    residual = ops.maximum(p - q, 0.0)
    # p == q leaves no residual, and then nothing is rejected: p stands in.
    residual = ops.where(ops.sum(residual, -1, keepdims=True) > 0, residual, p)
    return accepted, strategies.draw(residual, residual_uniform)


class SpeculativeGenerator(Generator):
    """`Generator` with a draft model: each round proposes `k` tokens with
    the draft (its own adapter and caches) and keeps what the target
    accepts. One segment of `length + k + 1` cache positions."""

    def __init__(self, adapter, draft, settings, width, length, k, jit_compile):
        super().__init__(adapter, settings, width, length, jit_compile)
        self.draft, self.k = draft, k
        self.draft_layers = draft.layers  # tracked: the draft's weights are state

    def decode(self, inputs, on_token=None):
        """`{"tokens", "acceptance"}` and `"scores"` if asked for; tokens
        and scores `(batch, length)`, the acceptance rate a float32 scalar
        (NaN if nothing was proposed)."""
        calls = SublayerCalls()  # bound once for every round of this call
        state = self._initial_state(inputs, calls)
        numbers = {key: inputs[key] for key in NUMBERS}
        if on_token is None and self.jit_compile:  # JAX, TensorFlow
            state = ops.while_loop(
                self._running, lambda s: self._round(s, numbers, calls), state
            )
        else:
            with self._steps_held():
                state = self._python_rounds(state, numbers, on_token, calls)
        outputs = {
            "tokens": state["tokens"][:, : self.length],
            "acceptance": state["accepted"] / state["proposed"],
        }
        if self.settings.return_scores:
            outputs["scores"] = state["scores"][:, : self.length]
        return outputs

    def _initial_state(self, inputs, calls):
        prompt, pads = inputs["prompt"], ops.cast(inputs["pads"], "int32")
        size = self.length + self.k + 1
        sources = numbered(inputs, "encoder_")  # both models read them
        models = {
            name: adapter.prefill(prompt, pads, sources, size, calls)[1]
            for name, adapter in (("target", self.adapter), ("draft", self.draft))
        }
        state = {
            "index": ops.convert_to_tensor(self.width, "int32"),
            "tokens": pad_to(
                ops.cast(prompt, "int32"), size, self.settings.pad_token_id
            ),
            "done": ops.less(pads, 0),  # False, from an input (see `Generator`)
            **models,
            "accepted": ops.zeros((), "float32"),
            "proposed": ops.zeros((), "float32"),
        }
        if self.settings.return_scores:
            state["scores"] = ops.zeros((ops.shape(prompt)[0], size), "float32")
        return state

    def _running(self, state):
        return ops.logical_and(
            state["index"] < self.length, ops.logical_not(ops.all(state["done"]))
        )

    def _python_rounds(self, state, numbers, on_token, calls):
        """Rounds from Python (PyTorch, `jit_compile=False`, `on_token`): the
        index is read back once per round (how far a round goes depends on
        the tokens), and `on_token` called for each new position."""
        index = self.width
        round_ = functools.partial(self._round, calls=calls)
        if self.forms is not None and self.forms.jit_compile is True:
            round_ = self._compiled_round(state, numbers, round_)
        while bool(ops.convert_to_numpy(self._running(state))):
            state = round_(state, numbers)
            new_index = int(ops.convert_to_numpy(state["index"]))
            if on_token is not None:
                tokens = ops.convert_to_numpy(state["tokens"])
                for position in range(index, min(new_index, self.length)):
                    on_token(position - self.width, tokens[:, position])
            index = new_index
        return state

    def _compiled_round(self, state, numbers, round_):
        """PyTorch: the round exported and compiled for these shapes, as
        `Generator._compiled` does the step (the draft's weights included)."""
        key = shapes_key(state)
        if key not in self.forms.compiled:
            from keras_attn.generation import _torch

            layers = [*self.decoding_layers, *self.draft_layers]
            self.forms.compiled[key] = _torch.compile_step(
                round_, list(dict.fromkeys(layers)), state, numbers
            )
        return self.forms.compiled[key]

    def _round(self, state, numbers, calls):
        """Propose `k` tokens, verify them in one target pass, keep the
        accepted prefix (the same length in every row) and one more."""
        self.traces += 1
        index = state["index"]
        pending = ops.take(state["tokens"], index - 1, axis=1)  # (B,)
        proposals, q_logits, draft = self._propose(pending, state, numbers, calls)
        verified = ops.concatenate([pending[:, None], proposals], axis=1)
        logits, target = self.adapter.extend(
            verified, index - 1, state["target"], calls
        )
        p_logits = self._process_at(logits, index, numbers)  # (B, k + 1, V)
        chosen, accepted = self._verify(p_logits, q_logits, proposals, index, numbers)
        running = ops.logical_not(state["done"])
        # Every row advances by the fewest accepted among the rows running.
        kept = ops.min(ops.where(running, accepted, self.k))
        state = self._write(chosen, p_logits, kept, state)
        counted = ops.cast(running, "float32")
        return {
            **state,
            "index": index + kept + 1,
            "target": target,
            "draft": draft,
            "accepted": state["accepted"]
            + ops.sum(counted * ops.cast(accepted, "float32")),
            "proposed": state["proposed"] + self.k * ops.sum(counted),
        }

    def _propose(self, pending, state, numbers, calls):
        """The draft's `k` tokens `(B, k)` after the pending one, and its
        processed logits `(B, k, V)` they were chosen from. The draft runs
        `k + 1` tokens, the last for its cache only."""
        index, draft = state["index"], state["draft"]
        token, proposals, q_logits = pending, [], []
        for j in range(self.k + 1):
            logits, draft = self.draft.step(token, index - 1 + j, draft, calls)
            if j == self.k:
                break
            logits = self._process_at(logits[:, None], index + j, numbers)[:, 0]
            if self.settings.method == "sample":
                uniform = self._uniform(numbers, index, j, _DRAFT, logits)
                token = strategies.draw(ops.softmax(logits, axis=-1), uniform)
            else:
                token = ops.cast(ops.argmax(logits, axis=-1), "int32")
            proposals.append(token)
            q_logits.append(logits)
        return ops.stack(proposals, axis=1), ops.stack(q_logits, axis=1), draft

    def _verify(self, p_logits, q_logits, proposals, index, numbers):
        """Each row's tokens for the round's `k + 1` positions `(B, k + 1)`
        (valid up to its first rejection, included) and how many draft
        tokens it accepted `(B,)`."""
        if self.settings.method == "sample":
            p = ops.softmax(p_logits, axis=-1)
            uniforms = [
                ops.stack(
                    [self._uniform(numbers, index, j, stream, p) for j in range(n)], 1
                )
                for stream, n in ((_ACCEPT, self.k), (_RESIDUAL, self.k + 1))
            ]
            accepted, replacement = rejection_sample(
                p[:, :-1], ops.softmax(q_logits, axis=-1), proposals, *uniforms[:1],
                uniforms[1][:, :-1],
            )  # fmt: skip
            bonus = strategies.draw(p[:, -1], uniforms[1][:, -1])
        else:
            best = ops.cast(ops.argmax(p_logits, axis=-1), "int32")  # (B, k + 1)
            accepted, replacement, bonus = best[:, :-1] == proposals, best, best[:, -1]
            replacement = replacement[:, :-1]
        chosen = ops.where(accepted, proposals, replacement)  # (B, k)
        chosen = ops.concatenate([chosen, bonus[:, None]], axis=1)
        leading = ops.cumprod(ops.cast(accepted, "int32"), axis=1)
        return chosen, ops.sum(leading, axis=1)

    def _write(self, chosen, p_logits, kept, state):
        """The round's tokens at `index`: each row's first `kept + 1`, with
        padding after its end token; padding past `kept`. Then `done` and
        the scores: the target's log-probabilities of the tokens."""
        done, columns = state["done"], ops.arange(self.k + 1)
        in_round = (columns <= kept)[None, :]  # (1, k + 1)
        ended = ops.zeros_like(chosen, "bool")
        if self.settings.end_token_ids:
            ended = is_end_token(chosen, self.settings.end_token_ids)  # (B, k + 1)
            ended = ops.logical_and(ended, in_round)
        ends_before = ops.cumsum(ops.cast(ended, "int32"), axis=1) - ops.cast(
            ended, "int32"
        )
        finished = ops.logical_or(done[:, None], ends_before > 0)  # (B, k + 1)
        blank = ops.logical_or(finished, ops.logical_not(in_round))
        tokens = ops.where(blank, self.settings.pad_token_id, chosen)
        index = state["index"]
        state = {
            **state,
            "tokens": ops.slice_update(state["tokens"], [0, index], tokens),
            "done": ops.logical_or(done, ops.any(ended, axis=1)),
        }
        if self.settings.return_scores:
            log_probs = ops.log_softmax(p_logits, axis=-1)
            scores = ops.take_along_axis(log_probs, chosen[..., None], -1)[..., 0]
            scores = ops.where(blank, 0.0, scores)
            state["scores"] = ops.slice_update(state["scores"], [0, index], scores)
        return state

    def _process_at(self, logits, index, numbers):
        """`Generator._process` on logits `(B, T, V)` for positions `index,
        ..., index + T - 1` (end tokens allowed from `min_new_tokens` on, per
        position)."""
        batch, steps, vocabulary = (
            ops.shape(logits)[0],
            logits.shape[1],
            logits.shape[2],
        )
        positions = index + ops.arange(steps, dtype="int32")  # (T,)
        positions = ops.reshape(ops.tile(positions[None], [batch, 1]), (-1, 1))
        flat = ops.reshape(logits, (-1, vocabulary))  # (B * T, V)
        flat = self._process({"logits": flat, "index": positions}, numbers)
        return ops.reshape(flat, (batch, steps, vocabulary))

    def _uniform(self, numbers, index, j, stream, like):
        """Uniforms `(B,)` of stream `stream` at the round's position `j`: a
        counter of its own for every round (rounds start at increasing
        indices) and position, so no draw is used twice."""
        rows = ops.arange(ops.shape(like)[0], dtype="int32")
        counter = (index * (self.k + 1) + j) * 3 + stream
        return strategies.counter_uniform(numbers["seed"], rows, counter)
