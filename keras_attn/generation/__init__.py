"""Cached autoregressive generation for models built from keras_attn.

`generate(model, inputs, max_length)` decodes with key/value caches; there is
no decoding loop to write. It is arranged like keras-hub's samplers and
Hugging Face's `generate`, one concern per module:

- `graph`: reads a functional model once (token embedding, decoders, head,
  encoder); `adapter`: runs them, with `prefill`, `step` and `grow` (the
  cache segments). The only code that knows about layers.
- `strategies`: greedy, sample and beam search pick tokens from logits.
- `processors`: small functions on the logits (repetition penalty, end-token
  suppression, temperature, top-k, top-p).
- `settings`: the arguments, validated once, in a frozen dataclass that is the
  cache key of compiled loops; numbers are loop inputs, so they compile nothing.
- `loop`: the loop itself, compiled per segment of cache length (64, 128, ...)
  so each step attends over at most twice the positions written so far (on
  PyTorch, one step compiled once per shape, over the whole length).
- `api`: `generate` itself: checks the call, finds the loop, runs it.
"""

from keras_attn.generation.api import generate
from keras_attn.generation.settings import METHODS

__all__ = ["generate", "METHODS"]
