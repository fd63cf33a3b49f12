"""Tiny seeded keras-hub backbones and keras-hub's own logits and greedy
tokens, the reference for `from_keras_hub`'s families."""

import keras
import numpy as np

from tests.helpers.backend import to_numpy


def seeded_backbone(cls, kwargs):
    """keras-hub backbone class `cls` built from `kwargs`, its weights drawn
    from N(0, 0.3): large enough that every option changes the logits."""
    keras.utils.set_random_seed(0)
    backbone = cls(**kwargs)
    rng = np.random.default_rng(1)
    for weight in backbone.weights:
        weight.assign(rng.normal(0.0, 0.3, weight.shape).astype("float32"))
    return backbone


def hub_logits(backbone, token_ids):
    hidden = backbone({"token_ids": token_ids, "padding_mask": np.ones_like(token_ids)})
    return to_numpy(backbone.token_embedding(hidden, reverse=True))


def hub_greedy(backbone, prompt, new_tokens):
    """A greedy loop over keras-hub's logits, one full pass per token on a
    fixed-width array (causal: the zeros after the prefix change nothing)."""
    width = prompt.shape[1] + new_tokens
    tokens = np.zeros((len(prompt), width), "int32")
    tokens[:, : prompt.shape[1]] = prompt
    for t in range(prompt.shape[1], width):
        tokens[:, t] = hub_logits(backbone, tokens)[:, t - 1].argmax(-1)
    return tokens
