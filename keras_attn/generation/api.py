"""`generate`, the public entry of cached decoding: it checks the call once,
then finds (or compiles) the decoding loop for the model and runs it."""

import weakref

import keras
import numpy as np
from keras import ops

from keras_attn.generation import prompts
from keras_attn.generation.adapter import FunctionAdapter, ModelAdapter
from keras_attn.generation.drafts import check_draft_sources, draft_plan
from keras_attn.generation.loop import Generator
from keras_attn.generation.plans import FunctionPlan, plan_of
from keras_attn.generation.settings import Settings, check_speculation
from keras_attn.generation.speculative import SpeculativeGenerator

_GENERATORS = weakref.WeakKeyDictionary()  # model -> {key: Generator}


def generate(
    model,
    inputs,
    max_length=None,
    method="greedy",
    temperature=1.0,
    top_k=None,
    top_p=None,
    seed=None,
    num_beams=4,
    length_penalty=1.0,
    end_token_id=None,
    pad_token_id=0,
    *,
    max_new_tokens=None,
    min_new_tokens=0,
    repetition_penalty=1.0,
    return_scores=False,
    on_token=None,
    jit_compile="auto",
    cache_dtype=None,
    draft_model=None,
    num_speculative_tokens=None,
    return_acceptance=False,
):
    """Generate token ids with cached decoding from a keras_attn model.

    The model is a functional `keras.Model` whose (single) output is the
    per-token logits `(batch, length, vocabulary)`, computed as a token
    embedding of the decoder-side token ids (`SinusoidalEmbedding(
    vocabulary_size=...)`, or Keras' `Embedding` or `ReversibleEmbedding` for
    models whose decoders rotate positions, `rope_max_wavelength`), then
    causal `TransformerDecoder` blocks (decoder-only, or with cross-attention
    into an encoder output computed from the other inputs), with per-position
    layers (`Dense`, `LayerNormalization`, `RMSNormalization`, `Dropout`,
    `Activation`, ...) between or after them; the head may be the embedding
    itself, tied (`ReversibleEmbedding` called with `reverse=True`). The
    encoder runs once; the decoder runs on the prompt, then on one new token
    per step, with its self-attention keys and values cached and the
    cross-attention ones computed once. The result equals running the whole
    model on each prefix, at a cost per token that does not grow with the
    prefix. Models that cannot be read this way pass `(prefill, step)`
    functions instead (see `model`).

    Padding: prompts of different lengths are padded with `pad_token_id`, on
    the left or on the right (each row's tokens contiguous). Every row keeps
    its own positions (its first real token is position 0). Right-padded rows
    are returned left-aligned; left-padded rows are returned left-padded.
    Source-side padding reaches the cross-attention when the encoder input's
    embedding has `mask_zero=True`. A Python list of rows of different lengths
    is right-padded with `pad_token_id` (and so returned left-aligned).

    Sampling draws from a counter-based hash of `(seed, row, step)` written in
    integer `keras.ops`, so the same seed and model give the same tokens on
    JAX, TensorFlow and PyTorch (up to logits that differ in the last bits).
    The numeric settings (`temperature`, `top_k`, `top_p`, `min_new_tokens`,
    `repetition_penalty`, `length_penalty`, `seed`) are inputs of the compiled
    loop: changing them compiles nothing. Generation's own numbers (the
    logits processors, temperature, penalties, sampling, beam scores) are
    float32 whatever the model's or the global dtype policy (e.g.
    `"mixed_bfloat16"`): the model's logits are cast to float32 first.

    Args:
        model: a functional `keras.Model` built from keras_attn layers as
            above; or a pair `(prefill, step)` of functions for any other
            model: `prefill(token_ids, length)` gets the left-padded prompt
            `(batch, width)` and the final length, and returns `(logits,
            state)`; `step(token_ids, index, state)` gets the new tokens
            `(batch, 1)` at position `index` (an int32 scalar tensor) and
            returns `(logits, state)`. Logits are `(batch, vocabulary)` or
            `(batch, length, vocabulary)` (the last position's are used), the
            state any nest of batch-first tensors whose shapes do not change.
            The compiled loop is kept, and reads the current weights, for
            functions that are methods of a Keras layer or model, or close
            over one; otherwise it is compiled anew on each call.
        inputs: int token ids `(batch, prompt_length)` (array, tensor or
            nested lists, which may have different lengths: see Padding) for
            a one-input model, or a list (in `model.inputs` order) or dict (by
            input name) for an encoder-decoder model, whose decoder-side entry
            is the prefix to extend (e.g. a start token). Each encoder input
            is an array of its `keras.Input`'s shape with one row per prompt
            row; int ids must be in the vocabulary of the embedding that reads
            them.
        max_length: int. Length of the returned sequences, prompt included.
            Pass it or `max_new_tokens`.
        method: `"greedy"` (argmax), `"sample"` (from the softmax, after
            `temperature`, `top_k` and `top_p`) or `"beam"` (beam search).
            Defaults to `"greedy"`.
        temperature: float > 0. Divides the logits before sampling.
            `"sample"` only.
        top_k: int. Sample only among the `top_k` most likely tokens; a
            `top_k` of the vocabulary size or more keeps every token (as
            Hugging Face's `TopKLogitsWarper` clamps it).
        top_p: float in (0, 1]. Sample only among the most likely tokens whose
            probabilities add up to `top_p` (nucleus sampling).
        seed: int in [0, 2**31). Seed of `"sample"`. Defaults to a draw from
            Python's `random` (which `keras.utils.set_random_seed` seeds).
        num_beams: int. Beams of `"beam"`, at most the vocabulary size of
            the model's embedding (more could only repeat beams). Defaults
            to `4`.
        length_penalty: float. `"beam"` ranks finished beams by
            `log p / length**length_penalty`. Defaults to `1.0`.
        end_token_id: int or list of ints. A sequence stops after generating
            one; the positions after it hold `pad_token_id`. It may equal
            `pad_token_id` (as Hugging Face sets it for GPT-2): a row then
            ends with that id, the same id fills the positions after it, and
            in prompts it counts as padding. Defaults to `None` (no stop).
        pad_token_id: int. Padding id of the prompts and of the output.
            Defaults to `0`.
        max_new_tokens: int >= 0, keyword only. New tokens per row, instead
            of `max_length`: the result has `prompt_length + max_new_tokens`
            columns. `0` returns the prompts (padded as described under
            Padding; scores 0), after the checks, without running the model.
        min_new_tokens: int, keyword only. End tokens are not generated before
            this many new tokens. Defaults to `0`.
        repetition_penalty: float > 0, keyword only. Logits of tokens already
            in a row are divided (if positive) or multiplied (if negative) by
            it, as in Hugging Face; `float("inf")` forbids every repeat.
            Defaults to `1.0` (none).
        return_scores: bool, keyword only. Also return the log-probability of
            each chosen token under the distribution it was chosen from.
        on_token: callable `on_token(step, tokens)`, keyword only, called
            after each step with the step number (0 for the first new token)
            and the new tokens `(batch,)` as numpy. Compiled loops cannot call
            back, so with it the loop runs step by step in Python (slower on
            JAX and TensorFlow). Not with `"beam"`, whose sequences are known
            only at the end.

        jit_compile: `"auto"`, `True` or `False`, keyword only. Whether the
            loop is compiled. On JAX and TensorFlow: a `while_loop` per cache
            segment (`"auto"`: yes). On PyTorch the step, once per shape
            (batch size, prompt width, length, settings): `True` exports it
            (`torch.export`) and compiles it with TorchInductor (on a GPU,
            replayed as CUDA graphs), the caches written in place; its first
            call compiles for seconds (`benchmarks/results/compile_time.md`).
            `"auto"` chooses by measurement (`keras_attn/generation/tiers.py`):
            eager steps, timed, until the eager time a shape has cost over
            every call, with what the call's remaining steps would cost,
            reaches what a compile costs on this machine; then, in the
            middle of a call if need be, the step is exported and captured
            as one CUDA graph on a GPU (no Inductor: seconds) or compiled by
            Inductor on a CPU, and stays so for its shape. `False` runs the
            step eagerly from a Python loop everywhere (for debugging).
            Compiled loops are kept per model, settings, prompt width, length
            and (on PyTorch) batch size.
        cache_dtype: `None`, `"int8"` or a float dtype name, keyword only.
            The self-attention caches' dtype: `None` keeps the model's
            compute dtype; `"int8"` quantizes each key and value vector
            (per token and head, symmetric, a float32 scale each:
            `keras_attn.cache.Int8Cache`) as it is written and dequantizes
            it inside the step that reads it, about a quarter of a float32
            cache's memory (half of a bfloat16 one) at a head width of 64;
            a float dtype (e.g. `"bfloat16"` for a float32 model) stores
            them in it. Not with `(prefill, step)` functions.
        draft_model: a functional `keras.Model` as `model` is, keyword only:
            speculative decoding (Leviathan et al., 2022). Each round the
            draft proposes `num_speculative_tokens` tokens one at a time
            (with its own caches), the target scores them in one pass, and
            every row keeps the prefix that every running row accepted
            (the fewest tokens among them), plus the target's own next
            token. `"greedy"` gives the tokens
            of plain greedy decoding; `"sample"` accepts a draft token `x`
            with probability `min(1, p(x) / q(x))`, else draws from
            `max(0, p - q)` (`p`, `q`: the target's and the draft's
            distributions after `temperature`, `top_k`, `top_p`), so the
            tokens follow the target's distribution (not the same draws as
            without a draft). It must take the target's inputs and score
            the same vocabulary. Not with `"beam"`, a `repetition_penalty`
            or `(prefill, step)` functions. Compiled as one `while_loop` on
            JAX and TensorFlow; on PyTorch (and with `on_token` or
            `jit_compile=False`) the rounds run from Python, which reads the
            index back once per round, and `jit_compile=True` compiles the
            round as it does the step. Sliding-window decoders keep full
            caches (no rolling).
        num_speculative_tokens: int >= 1, keyword only. Draft tokens per
            round; only with `draft_model` (without one, any value but
            `None` raises). Defaults to `None`: 4 with a draft model. A
            round runs `num_speculative_tokens - 1` positions past the
            returned length (discarded): both models' position tables must
            hold them.
        return_acceptance: bool, keyword only. Also return the draft's
            acceptance rate, a float: draft tokens the target accepted over
            those proposed, counted over the rows still running (NaN if
            nothing was proposed). Only with `draft_model`.

    Returns:
        numpy int32 array `(batch, length)`: each prompt followed by its
        generated tokens. With `return_scores=True`, a tuple `(tokens,
        scores)`, scores float32 `(batch, length)`: 0 at the prompt and
        after a row's end (with a draft model, the target's log-probability
        of each token). With `return_acceptance=True`, the acceptance rate
        comes last: `(tokens, acceptance)` or `(tokens, scores,
        acceptance)`.

    Example:
    >>> ids = keras.Input((None,), dtype="int32")
    >>> x = keras_attn.SinusoidalEmbedding(
    ...     vocabulary_size=20, embedding_dim=16, mask_zero=True)(ids)
    >>> x = keras_attn.TransformerDecoder(intermediate_dim=32, num_heads=2)(x)
    >>> model = keras.Model(ids, keras.layers.Dense(20)(x))
    >>> tokens = keras_attn.generation.generate(model, [[3, 4, 5]], 8)
    >>> tokens.shape, tokens[0, :3].tolist()
    ((1, 8), [3, 4, 5])
    >>> tokens, scores = keras_attn.generation.generate(
    ...     model, [[3, 4, 5]], max_new_tokens=4, method="sample", seed=1,
    ...     top_k=5, return_scores=True)
    >>> tokens.shape, bool(np.all(scores[0, 3:] <= 0))
    ((1, 7), True)
    >>> keras_attn.generation.generate(
    ...     model, [[3, 4, 5], [6]], max_new_tokens=0).tolist()
    [[3, 4, 5], [6, 0, 0]]
    >>> fast, acceptance = keras_attn.generation.generate(
    ...     model, [[3, 4, 5]], 8, draft_model=model, num_speculative_tokens=1,
    ...     return_acceptance=True)  # a draft that always agrees
    >>> plain = keras_attn.generation.generate(model, [[3, 4, 5]], 8)
    >>> bool(np.all(fast == plain)), acceptance
    (True, 1.0)
    """
    settings = Settings.from_arguments(
        method, end_token_id, pad_token_id, return_scores,
        max_length=max_length, max_new_tokens=max_new_tokens,
        min_new_tokens=min_new_tokens, temperature=temperature, top_k=top_k,
        top_p=top_p, repetition_penalty=repetition_penalty,
        length_penalty=length_penalty, seed=seed, num_beams=num_beams,
        cache_dtype=cache_dtype,
    )  # fmt: skip
    _check_call_options(settings, on_token)
    jit_compile = _jit_compile(jit_compile)
    k = check_speculation(
        settings, draft_model, num_speculative_tokens, return_acceptance
    )
    owner, plan = plan_of(model)
    if settings.cache_dtype is not None and isinstance(plan, FunctionPlan):
        raise ValueError(
            "`cache_dtype` sets the dtype of the caches `generate` makes for a "
            "model's decoders; `(prefill, step)` functions keep their own. "
            f"Received: cache_dtype={settings.cache_dtype!r} with functions."
        )
    draft = draft_plan(draft_model, model, plan, k)
    prompt, sources = plan.split_inputs(inputs)
    prompt, pads, right_padded = prompts.left_pad(prompt, settings.pad_token_id)
    length, returned = prompts.decoding_length(
        settings, prompt.shape[1], pads, right_padded
    )
    # A speculative round runs up to k - 1 positions past `length`.
    prompts.check_positions(length, pads, plan.max_positions, spare=max(k - 1, 0))
    if plan.vocabulary_size is not None:
        prompts.check_token_ids(
            prompt,
            plan.vocabulary_size,
            pad_token_id=settings.pad_token_id,
            end_token_id=settings.end_token_ids,
        )
        _check_beams(settings, plan.vocabulary_size)
    sources = prompts.check_sources(sources, plan.source_specs, prompt.shape[0])
    sources = {f"encoder_{i}": x for i, x in enumerate(sources)}
    if draft:  # it reads the target's encoder inputs (the same, checked)
        check_draft_sources(draft, inputs, length, pads)
    plan.warn_if_probabilities(method)
    outputs = _decode(
        owner, plan, settings, prompt, pads, sources, length, jit_compile, on_token,
        draft,
    )  # fmt: skip
    layout = (pads, right_padded, returned)
    return _results(outputs, layout, settings, return_acceptance)


def _results(outputs, layout, settings, return_acceptance):
    """`generate`'s return value from the loop's numpy outputs: tokens in the
    user's layout (`(pads, right_padded, returned length)`), then the scores
    and the acceptance rate where asked for."""
    tokens = outputs["tokens"].astype("int32")
    results = [prompts.to_user_layout(tokens, *layout, settings.pad_token_id)]
    if settings.return_scores:
        scores = outputs["scores"].astype("float32")
        results.append(prompts.to_user_layout(scores, *layout, 0.0))
    if return_acceptance:
        results.append(float(outputs.get("acceptance", np.nan)))
    return results[0] if len(results) == 1 else tuple(results)


def _check_beams(settings, vocabulary_size):
    """Beam search keeps `num_beams` distinct sequences: one step from a
    single prompt has only `vocabulary_size` of them."""
    if settings.num_beams > vocabulary_size:
        raise ValueError(
            "`num_beams` must be at most the vocabulary size of the model's "
            f"embedding. Received: num_beams={settings.num_beams}, "
            f"vocabulary_size={vocabulary_size}."
        )


def _check_call_options(settings, on_token):
    if on_token is not None and not callable(on_token):
        raise TypeError(
            "`on_token` must be a callable `on_token(step, tokens)`. "
            f"Received: on_token={on_token!r}."
        )
    if on_token is not None and settings.method == "beam":
        raise ValueError(
            "`on_token` cannot stream beam search: its sequences are chosen "
            "only at the end. Use method='greedy' or 'sample' to stream."
        )


def _jit_compile(jit_compile):
    if not (jit_compile == "auto" or isinstance(jit_compile, bool)):
        raise ValueError(
            "`jit_compile` must be 'auto', True or False. "
            f"Received: jit_compile={jit_compile!r}."
        )
    if jit_compile == "auto" and keras.config.backend() != "torch":
        return True  # a compiled `while_loop`: PyTorch chooses by measurement
    return jit_compile


def _decode(
    owner, plan, settings, prompt, pads, sources, length, jit_compile, on_token, draft
):
    """Tokens and scores (and with a draft, the acceptance rate) as numpy;
    with no new position, the prompts themselves (the model need not run)."""
    if length == prompt.shape[1]:
        return {"tokens": prompt, "scores": np.zeros(prompt.shape, "float32")}
    generator = _generator(
        owner, plan, settings, prompt.shape[1], length, jit_compile, draft
    )
    return _run(generator, settings, prompt, pads, sources, on_token)


def _run(generator, settings, prompt, pads, sources, on_token):
    batch = {"prompt": prompt, "pads": pads, **settings.numbers(), **sources}
    # PyTorch loops in Python anyway; `predict_on_batch` adds no_grad.
    compiled = generator.jit_compile or keras.config.backend() == "torch"
    if on_token is None and compiled:
        outputs = generator.predict_on_batch(batch)
    else:  # a Python loop, which can call back
        outputs = _eager_decode(generator, batch, on_token)
    return {k: np.asarray(ops.convert_to_numpy(v)) for k, v in outputs.items()}


def _eager_decode(generator, batch, on_token):
    """The loop run step by step from Python (no gradients recorded)."""
    tensors = {k: ops.convert_to_tensor(v) for k, v in batch.items()}
    if keras.config.backend() != "torch":
        return generator.decode(tensors, on_token=on_token)
    from keras_attn.generation import _torch

    with _torch.no_grad():
        return generator.decode(tensors, on_token=on_token)


def _generator(owner, plan, settings, width, length, jit_compile, draft=None):
    """The compiled loop for these settings, prompt width and length, and
    Keras' flash attention switch (which the attention plan reads when the
    loop is traced); with a `Draft`, speculative."""
    functions = getattr(plan, "functions", None)
    functions_key = functions and tuple(map(_function_key, functions))
    flash = keras.config.is_flash_attention_enabled()
    draft_key = draft and (draft.model, draft.k)
    key = (settings, width, length, jit_compile, functions_key, flash, draft_key)
    cache = _GENERATORS.setdefault(owner, {})
    if key in cache:
        return cache[key]
    if draft:
        size = length + draft.k + 1
        dtype = settings.cache_dtype
        cache[key] = SpeculativeGenerator(
            ModelAdapter(plan, size, roll=False, cache_dtype=dtype),
            ModelAdapter(draft.plan, size, roll=False, cache_dtype=dtype),
            settings, width, length, draft.k, jit_compile,
        )  # fmt: skip
        return cache[key]
    if functions:
        adapter = FunctionAdapter(functions, length)
        if not adapter.layers:  # weights unknown: compiled in, so never kept
            return Generator(adapter, settings, width, length, jit_compile)
    else:
        adapter = ModelAdapter(plan, length, cache_dtype=settings.cache_dtype)
    cache[key] = Generator(adapter, settings, width, length, jit_compile)
    return cache[key]


def _function_key(function):
    return getattr(function, "__func__", function)
