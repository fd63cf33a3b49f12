"""A draft model for speculative decoding, checked against its target: the
same inputs, vocabulary and positions (`generate`'s `draft_model`)."""

import contextlib
import dataclasses

import keras

from keras_attn.generation import prompts
from keras_attn.generation.graph import GraphPlan
from keras_attn.generation.plans import FunctionPlan, plan_of


@dataclasses.dataclass(frozen=True, eq=False)
class Draft:
    """A checked draft model: the model, its `GraphPlan` and `k`, the draft
    tokens per round (`num_speculative_tokens`)."""

    model: keras.Model
    plan: GraphPlan
    k: int


def check_draft_sources(draft, inputs, length, pads):
    """Raise if the draft would run past its position table (a round's
    `k - 1` spare positions included) or cannot read the encoder inputs (its
    own vocabularies); it reads the target's, which it takes in the same
    places and specs (`_check_draft_inputs`)."""
    prompts.check_positions(
        length, pads, draft.plan.max_positions, spare=draft.k - 1, model="draft_model"
    )
    with _naming_draft_model():
        encoder_inputs = draft.plan.split_inputs(inputs)[1]
        prompts.check_sources(encoder_inputs, draft.plan.source_specs, len(pads))


@contextlib.contextmanager
def _naming_draft_model():
    """Errors from reading the draft model's graph, re-raised naming
    `draft_model` (the cause kept)."""
    try:
        yield
    except (ValueError, TypeError) as error:
        raise type(error)(f"`draft_model`: {error}") from error


def draft_plan(draft_model, model, plan, k):
    """A `Draft`, checked against the target's `plan`, or None without a
    draft model."""
    if draft_model is None:
        return None
    if not isinstance(draft_model, keras.Model):
        raise TypeError(
            "`draft_model` must be a functional keras.Model (not `(prefill, "
            "step)` functions). Received: draft_model of type "
            f"{type(draft_model).__name__}."
        )
    if isinstance(plan, FunctionPlan):
        raise ValueError(
            "Speculative decoding needs a functional keras.Model as `model`, "
            "not `(prefill, step)` functions. Received a `(prefill, step)` "
            "pair as `model` with a `draft_model`."
        )
    with _naming_draft_model():
        _, draft = plan_of(draft_model)
    _check_draft_vocabulary((draft_model, draft), (model, plan))
    _check_draft_inputs(draft, plan)
    return Draft(draft_model, draft, k)


def _check_draft_vocabulary(draft, target):
    """The draft must embed and score the target's tokens: the embeddings'
    sizes and the logits' last dimensions (which must be known: they are
    compared here, not inside the compiled loop). Each is `(model, plan)`."""
    (draft_model, draft), (model, plan) = draft, target
    if draft.vocabulary_size != plan.vocabulary_size:
        raise ValueError(
            "`draft_model` must score the target's vocabulary. Received a "
            f"draft with vocabulary_size={draft.vocabulary_size}; the target "
            f"has {plan.vocabulary_size}."
        )
    widths = [m.outputs[0].shape[-1] for m in (model, draft_model)]
    if None in widths:
        raise ValueError(
            "`draft_model` and `model` must score a vocabulary of a known "
            "size (the last dimension of their logits), to compare them "
            f"before decoding. Received logits of {widths[1]} (draft) and "
            f"{widths[0]} (target) tokens."
        )
    if widths[0] != widths[1]:
        raise ValueError(
            "`draft_model` must score the target's vocabulary. Received a "
            f"draft whose logits score {widths[1]} tokens; the target's "
            f"{widths[0]}."
        )


def _check_draft_inputs(draft, plan):
    """The draft must take the target's inputs: as many, in the same places
    (the token ids and each encoder input), of the same specs."""
    counts = [(len(p.inputs), len(p.source_specs)) for p in (draft, plan)]
    specs = [[(s.shape[1:], s.integer) for s in p.source_specs] for p in (draft, plan)]
    places = [(p.prompt_index, list(p.encoder_indices)) for p in (draft, plan)]
    if counts[0] != counts[1] or specs[0] != specs[1] or places[0] != places[1]:
        raise ValueError(
            "`draft_model` must take the target's inputs (decoder-only, or "
            "the same encoder inputs, in the same order). Received a draft "
            f"with {counts[0][0]} inputs, {counts[0][1]} of them encoder "
            f"inputs (shapes, int: {specs[0]}; token ids at input "
            f"{places[0][0]}, encoder inputs at {places[0][1]}); the target "
            f"has {counts[1][0]}, {counts[1][1]} ({specs[1]}; {places[1][0]}, "
            f"{places[1][1]})."
        )
