"""Tiny seeded transformers models, the reference for checkpoint folders,
and the one closeness rule their logits are held to."""

import numpy as np


def tiny_causal_lm(config_class, dtype="float32", **kwargs):
    """A seeded transformers causal LM of `config_class` (a name in
    `transformers`), in eval mode, with weights large enough (N(0, 0.3))
    that every config option changes the logits."""
    import torch
    import transformers

    config = getattr(transformers, config_class)(**kwargs)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for weight in model.parameters():
            weight.copy_(torch.randn(weight.shape, generator=generator) * 0.3)
    return model.to(getattr(torch, dtype)).eval()


def transformers_logits(model, token_ids):
    """A transformers model's float32 logits of int `token_ids`, as numpy."""
    import torch

    with torch.no_grad():
        logits = model(torch.as_tensor(np.asarray(token_ids), dtype=torch.long)).logits
    return logits.float().numpy()


def assert_same_logits(actual, expected):
    """Within 1e-4 of the reference's largest |logit| (float32)."""
    scale = np.abs(expected).max()
    np.testing.assert_allclose(actual, expected, rtol=0, atol=1e-4 * scale)
