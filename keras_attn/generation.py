"""Cached autoregressive generation for functional models built from keras_attn.

`generate(model, inputs, max_length)` finds the token embedding, the
`TransformerDecoder` blocks and the per-token head in a functional model's
graph, runs the encoder (if any) once, and then decodes one token at a time
with key/value caches, in compiled `keras.ops.while_loop`s on JAX and
TensorFlow (through `Model.predict_on_batch`) and eagerly on PyTorch: one loop
per segment of cache length (64, 128, ... `max_length` positions), so each step
attends over at most twice the positions written so far.
"""

import math
import random
import weakref

import keras
import numpy as np
from keras import ops

from keras_attn.layers import SinusoidalEmbedding, TransformerDecoder

__all__ = ["generate"]

METHODS = ("greedy", "sample", "beam")

# Layers that act on each position alone, so a head made of them can run on one
# new token at a time.
PER_TOKEN_LAYERS = tuple(
    getattr(keras.layers, name)
    for name in (
        "Activation",
        "Dense",
        "Dropout",
        "LayerNormalization",
        "RMSNormalization",
        "Softmax",
    )
    if hasattr(keras.layers, name)
)

# Keras' tied embedding (`reverse=True` gives logits), where Keras has it.
_REVERSIBLE_EMBEDDING = getattr(keras.layers, "ReversibleEmbedding", ())
_GENERATORS = weakref.WeakKeyDictionary()  # model -> {settings: _Generator}


def generate(
    model,
    inputs,
    max_length,
    method="greedy",
    temperature=1.0,
    top_k=None,
    top_p=None,
    seed=None,
    num_beams=4,
    length_penalty=1.0,
    end_token_id=None,
    pad_token_id=0,
):
    """Generate token ids with cached decoding from a keras_attn model.

    The model is a functional `keras.Model` whose (single) output is the
    per-token logits `(batch, length, vocabulary)`, computed as a token
    embedding of the decoder-side token ids (`SinusoidalEmbedding(
    vocabulary_size=...)`, or Keras' `Embedding` or `ReversibleEmbedding` for
    models whose decoders rotate positions, `rope_max_wavelength`), then
    `TransformerDecoder` blocks (decoder-only, or with cross-attention into an
    encoder output computed from the other inputs), with per-position layers
    (`Dense`, `LayerNormalization`, `RMSNormalization`, `Dropout`,
    `Activation`, ...) between or after them; the head may be the embedding
    itself, tied (`ReversibleEmbedding` called with `reverse=True`). The
    encoder runs once; the decoder runs on the prompt, then on one new token
    per step, with its self-attention keys and values cached and
    the cross-attention ones computed once. The result equals running the whole
    model on each prefix, at a cost per token that does not grow with the
    prefix.

    Padding: prompts of different lengths are padded with `pad_token_id`, on
    the left or on the right (each row's tokens contiguous). Every row keeps
    its own positions (its first real token is position 0), in the sinusoid
    and in the rotary positions. Right-padded rows
    are returned left-aligned, each filled up to `max_length`; left-padded rows
    are returned left-padded, with `max_length - prompt_width` new tokens each.
    Source-side padding reaches the cross-attention when the encoder input's
    embedding has `mask_zero=True`.

    Args:
        model: a functional `keras.Model` built from keras_attn layers as above.
        inputs: int token ids `(batch, prompt_length)` for a one-input
            (decoder-only) model, or a list (in `model.inputs` order) or dict
            (by input name) for an encoder-decoder model, whose decoder-side
            entry is the prefix to extend (e.g. a start token).
        max_length: int. Length of the returned sequences, prompt included.
        method: `"greedy"` (argmax), `"sample"` (from the softmax, after
            `temperature`, `top_k` and `top_p`) or `"beam"` (beam search).
            Defaults to `"greedy"`.
        temperature: float > 0. Divides the logits before sampling.
        top_k: int. Sample only among the `top_k` most likely tokens.
        top_p: float in (0, 1]. Sample only among the most likely tokens whose
            probabilities add up to `top_p` (nucleus sampling).
        seed: int. Seed of `"sample"`; the same seed gives the same tokens.
            Defaults to a draw from Python's `random` (which
            `keras.utils.set_random_seed` seeds).
        num_beams: int. Beams of `"beam"`. Defaults to `4`.
        length_penalty: float. `"beam"` ranks finished beams by
            `log p / length**length_penalty`. Defaults to `1.0`.
        end_token_id: int. A sequence stops after generating it; the positions
            after it hold `pad_token_id`. Defaults to `None` (no stop).
        pad_token_id: int. Padding id of the prompts and of the output.
            Defaults to `0`.

    Returns:
        numpy int32 array `(batch, max_length)`: each prompt followed by its
        generated tokens.

    Example:
    >>> ids = keras.Input((None,), dtype="int32")
    >>> x = keras_attn.SinusoidalEmbedding(
    ...     vocabulary_size=20, embedding_dim=16, mask_zero=True)(ids)
    >>> x = keras_attn.TransformerDecoder(intermediate_dim=32, num_heads=2)(x)
    >>> model = keras.Model(ids, keras.layers.Dense(20)(x))
    >>> tokens = keras_attn.generation.generate(model, np.array([[3, 4, 5]]), 8)
    >>> tokens.shape, tokens[0, :3].tolist()
    ((1, 8), [3, 4, 5])
    """
    settings = _check_settings(
        method, temperature, top_k, top_p, seed, num_beams, length_penalty,
        end_token_id, pad_token_id, max_length,
    )  # fmt: skip
    plan = _DecodingPlan(model)
    prompt, encoder_inputs = plan.split_inputs(inputs)
    prompt, pads, right_padded = _left_pad(prompt, pad_token_id, max_length)
    _check_token_ids(
        prompt,
        plan.vocabulary_size,
        pad_token_id=pad_token_id,
        end_token_id=end_token_id,
    )
    length = max_length + (int(pads.max()) if right_padded else 0)
    # One generator per prompt width: its loops are built for that width (the
    # segment lengths depend on it), and TensorFlow would otherwise retrace a
    # second width with a relaxed, unknown width.
    generator = _generator(model, plan, length, settings, prompt.shape[1])
    seed = random.randrange(2**31 - 1) if seed is None else seed
    batch = {
        "prompt": prompt,
        "pads": pads,
        "seed": np.array([seed, 0], "int32"),
        **{f"encoder_{i}": x for i, x in enumerate(encoder_inputs)},
    }
    tokens = np.asarray(generator.predict_on_batch(batch)).astype("int32")
    if right_padded:  # Back to the user's layout: prompt first, then new tokens.
        tokens = np.stack(
            [row[p : p + max_length] for row, p in zip(tokens, pads, strict=True)]
        )
    return tokens[:, :max_length]


def _check_settings(
    method,
    temperature,
    top_k,
    top_p,
    seed,
    num_beams,
    length_penalty,
    end_token_id,
    pad_token_id,
    max_length,
):
    if method not in METHODS:
        raise ValueError(f"`method` must be one of {METHODS}. Received: {method!r}.")
    _check_int("max_length", max_length, minimum=1)
    _check_int("num_beams", num_beams, minimum=1)
    _check_int("pad_token_id", pad_token_id, minimum=0)
    if end_token_id is not None:
        _check_int("end_token_id", end_token_id, minimum=0)
    if seed is not None:
        _check_int("seed", seed, minimum=0, maximum=2**31 - 1)
    if top_k is not None:
        _check_int("top_k", top_k, minimum=1)
    if not isinstance(temperature, int | float) or not temperature > 0:
        raise ValueError(
            "`temperature` must be a number > 0. "
            f"Received: temperature={temperature!r}."
        )
    if top_p is not None and (not isinstance(top_p, int | float) or not 0 < top_p <= 1):
        raise ValueError(f"`top_p` must be in (0, 1]. Received: top_p={top_p!r}.")
    if not isinstance(length_penalty, int | float):
        raise TypeError(
            f"`length_penalty` must be a number. Received: {length_penalty!r}."
        )
    if not math.isfinite(length_penalty):
        raise ValueError(
            "`length_penalty` must be finite. "
            f"Received: length_penalty={length_penalty!r}."
        )
    return (
        method,
        float(temperature),
        top_k if method == "sample" else None,
        float(top_p) if method == "sample" and top_p is not None else None,
        num_beams if method == "beam" else 1,
        float(length_penalty),
        end_token_id,
        pad_token_id,
    )


def _check_int(name, value, minimum, maximum=None):
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(
            f"`{name}` must be an int. Received: {name}={value!r} "
            f"of type {type(value).__name__}."
        )
    if value < minimum:
        raise ValueError(f"`{name}` must be >= {minimum}. Received: {name}={value}.")
    if maximum is not None and value > maximum:
        raise ValueError(f"`{name}` must be <= {maximum}. Received: {name}={value}.")


def _check_token_ids(prompt, vocabulary_size, **ids):
    """Raise unless the ids are in `[0, vocabulary_size)` of the token embedding."""
    for name, value in ids.items():
        if value is not None and value >= vocabulary_size:
            raise ValueError(
                f"`{name}` must be a token id < vocabulary_size={vocabulary_size} "
                f"of the model's embedding. Received: {name}={value}."
            )
    if prompt.size and (prompt.min() < 0 or prompt.max() >= vocabulary_size):
        raise ValueError(
            "The prompt's token ids must be in [0, vocabulary_size="
            f"{vocabulary_size}) of the model's embedding. Received: ids from "
            f"{prompt.min()} to {prompt.max()}."
        )


def _left_pad(prompt, pad_token_id, max_length):
    """Left-pad every row; return `(prompt, pads per row, was right-padded)`."""
    prompt = np.asarray(keras.ops.convert_to_numpy(prompt))
    if prompt.ndim != 2 or prompt.dtype.kind not in "iu":
        raise ValueError(
            "The prompt must be int token ids `(batch, length)`. Received: "
            f"shape={prompt.shape}, dtype={prompt.dtype}."
        )
    if prompt.shape[1] > max_length:
        raise ValueError(
            "`max_length` must be at least the prompt length. Received: "
            f"max_length={max_length}, prompt length={prompt.shape[1]}."
        )
    real = prompt != pad_token_id
    lengths = real.sum(axis=1)
    if np.any(lengths == 0):
        raise ValueError(
            f"Every prompt needs at least one token that is not pad_token_id="
            f"{pad_token_id}. Received empty rows: {np.flatnonzero(lengths == 0)}."
        )
    run_starts = real & ~np.pad(real, [(0, 0), (1, 0)])[:, :-1]
    left, right = real[:, -1], real[:, 0]  # rows ending / starting with tokens
    if np.any(run_starts.sum(axis=1) != 1) or not np.all(left | right):
        raise ValueError(
            f"Prompts must be padded with pad_token_id={pad_token_id} on one side "
            "(left or right), with no padding between tokens."
        )
    if np.any(~left) and np.any(~right):
        raise ValueError(
            "Prompts must be all left-padded or all right-padded, not a mix."
        )
    pads = (real.shape[1] - lengths).astype("int32")
    right_padded = bool(np.any(~left))
    if right_padded:
        prompt = np.stack(
            [np.roll(row, p) for row, p in zip(prompt, pads, strict=True)]
        )
    return prompt.astype("int32"), pads, right_padded


class _DecodingPlan:
    """Where the embedding, decoders, head and encoder sit in a model's graph."""

    def __init__(self, model):
        if not isinstance(model, keras.Model) or not hasattr(model, "inputs"):
            raise ValueError(
                "`generate` needs a functional keras.Model built from keras_attn "
                f"layers. Received: {type(model).__name__}."
            )
        if len(model.outputs) != 1:
            raise ValueError(
                "`generate` needs a model with one output, the token logits. "
                f"Received a model with {len(model.outputs)} outputs."
            )
        if not any(isinstance(layer, TransformerDecoder) for layer in model.layers):
            raise ValueError(
                "`generate` found no TransformerDecoder in the model: it decodes "
                "models whose logits come from keras_attn decoder blocks."
            )
        self.model = model
        self._producers = _producers(model)
        self.head, self.body, self.embedding, prompt = self._trace(model.outputs[0])
        self.prompt_index = _input_index(model, prompt)
        encoder_outputs = {id(t): t for _, t in self.body if t is not None}
        if len(encoder_outputs) > 1:
            raise ValueError(
                "`generate` needs every TransformerDecoder to attend to the same "
                "encoder output."
            )
        self.encoder = None
        self.encoder_indices, self.encoder_mask_input = [], None
        if encoder_outputs:
            self._plan_encoder(next(iter(encoder_outputs.values())))

    def _trace(self, logits):
        """Walk back from the logits: head layers, decoder blocks, embedding."""
        head, tensor = [], logits
        layer, inputs, kwargs = self._producer(tensor)
        while not isinstance(layer, TransformerDecoder):
            if not _is_tied_head(layer, kwargs):
                self._check_per_token(layer, inputs, "after the last decoder")
            head.insert(0, (layer, kwargs))
            layer, inputs, kwargs = self._producer(inputs[0])
        body = []
        while not _is_token_embedding(layer, kwargs):
            if isinstance(layer, TransformerDecoder):
                # The node's tensors: the decoder sequence, then the encoder
                # sequence if any (float, rank 3), then masks (bool).
                sequences = [t for t in inputs[1:] if _is_sequence(t)]
                body.insert(0, (layer, sequences[0] if sequences else None))
            else:
                self._check_per_token(
                    layer, inputs, "between the embedding and decoders"
                )
                body.insert(0, (layer, None))
            layer, inputs, kwargs = self._producer(inputs[0])
        self.vocabulary_size = getattr(layer, "vocabulary_size", None)
        if not isinstance(layer, SinusoidalEmbedding):
            self.vocabulary_size = layer.input_dim
        if self.vocabulary_size is None:
            raise ValueError(
                f"`generate` needs the decoder's SinusoidalEmbedding ({layer.name}) to "
                "embed token ids (`vocabulary_size` set)."
            )
        return head, body, layer, inputs[0]

    def _producer(self, tensor):
        found = self._producers.get(id(tensor))
        if found is None:
            raise ValueError(
                "`generate` found no chain of a token embedding (SinusoidalEmbedding, "
                "Embedding or ReversibleEmbedding) and TransformerDecoders between "
                "the model's token-id input and its logits."
            )
        return found

    def _check_per_token(self, layer, inputs, where):
        if not isinstance(layer, PER_TOKEN_LAYERS) or len(inputs) != 1:
            raise ValueError(
                f"`generate` runs the layers {where} one token at a time, so they "
                "must act on each position alone: one of "
                f"{[c.__name__ for c in PER_TOKEN_LAYERS]}. "
                f"Received: {layer.name} ({type(layer).__name__})."
            )

    def _plan_encoder(self, encoder_output):
        sources = _ancestors(encoder_output, self._producers, self.model.inputs)
        if self.prompt_index in sources:
            raise ValueError(
                "`generate` needs the encoder output to depend only on the "
                "encoder inputs, not on the decoder's token ids."
            )
        self.encoder_indices = sorted(sources)
        self.encoder = keras.Model(
            [self.model.inputs[i] for i in self.encoder_indices], encoder_output
        )
        self.encoder_mask_input = self._mask_zero_source(encoder_output)

    def _mask_zero_source(self, tensor):
        """The model input whose id 0 pads the encoder output, if any."""
        while id(tensor) in self._producers:
            layer, inputs, _ = self._producers[id(tensor)]
            if getattr(layer, "mask_zero", False):
                return self.encoder_indices.index(_input_index(self.model, inputs[0]))
            tensor = inputs[0]
        return None

    def split_inputs(self, inputs):
        """`(prompt, [encoder inputs])` from what the user passed."""
        model = self.model
        if isinstance(inputs, dict):
            names = [t.name for t in model.inputs]
            unknown = sorted(set(inputs) - set(names))
            if unknown or len(inputs) != len(names):
                raise ValueError(
                    f"`inputs` must have the model's input names {names}. "
                    f"Received: {sorted(inputs)}."
                )
            inputs = [inputs[name] for name in names]
        elif not isinstance(inputs, list | tuple):
            inputs = [inputs]
        if len(inputs) != len(model.inputs):
            raise ValueError(
                f"`inputs` must match the model's {len(model.inputs)} inputs "
                f"({[t.name for t in model.inputs]}). Received {len(inputs)}."
            )
        encoder_inputs = [inputs[i] for i in self.encoder_indices]
        return inputs[self.prompt_index], encoder_inputs


def _is_token_embedding(layer, kwargs):
    """A `SinusoidalEmbedding`, or a Keras `Embedding` called forward."""
    if isinstance(layer, SinusoidalEmbedding):
        return True
    return isinstance(layer, keras.layers.Embedding) and not kwargs.get("reverse")


def _is_tied_head(layer, kwargs):
    return isinstance(layer, _REVERSIBLE_EMBEDDING) and bool(kwargs.get("reverse"))


def _is_sequence(tensor):
    return len(tensor.shape) == 3 and "float" in str(tensor.dtype)


def _producers(model):
    """`id(output tensor) -> (layer, flat input tensors, call kwargs)` over the
    model's layers. Each layer is called once, but for a tied
    `ReversibleEmbedding`: once forward and once `reverse=True`."""
    producers = {}
    for layer in model.layers:
        if isinstance(layer, keras.layers.InputLayer):
            continue
        nodes = getattr(layer, "_inbound_nodes", ())
        if len(nodes) > 1 and not _tied_embedding(layer, nodes):
            raise ValueError(
                f"`generate` needs each layer used once; {layer.name} is shared."
            )
        for node in nodes:
            kwargs = {  # the settings, such as `reverse=True`; not the tensors
                k: v
                for k, v in node.arguments.kwargs.items()
                if not isinstance(v, keras.KerasTensor)
            }
            for output in node.output_tensors:
                producers[id(output)] = (layer, list(node.input_tensors), kwargs)
    return producers


def _tied_embedding(layer, nodes):
    """Whether `layer` is a `ReversibleEmbedding` called forward, then reversed."""
    reverse = sorted(bool(node.arguments.kwargs.get("reverse")) for node in nodes)
    return isinstance(layer, _REVERSIBLE_EMBEDDING) and reverse == [
        False,
        True,
    ]


def _ancestors(tensor, producers, model_inputs):
    """Indices of the model inputs `tensor` depends on."""
    indices, stack, seen = set(), [tensor], set()
    while stack:
        tensor = stack.pop()
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        for i, model_input in enumerate(model_inputs):
            if tensor is model_input:
                indices.add(i)
        if id(tensor) in producers:
            stack.extend(producers[id(tensor)][1])
    return indices


def _input_index(model, tensor):
    for i, model_input in enumerate(model.inputs):
        if tensor is model_input:
            return i
    raise ValueError(
        "`generate` needs the token embeddings to read a model input directly."
    )


def _generator(model, plan, length, settings, width):
    cache = _GENERATORS.setdefault(model, {})
    key = (length, settings, width)
    if key not in cache:
        cache[key] = _Generator(plan, length, settings)
    return cache[key]


class _Generator(keras.Model):
    """The decoding loop, as a model so `predict_on_batch` compiles it."""

    def __init__(self, plan, length, settings):
        super().__init__(name="keras_attn_generator")
        (
            self.method,
            self.temperature,
            self.top_k,
            self.top_p,
            self.num_beams,
            self.length_penalty,
            self.end_token_id,
            self.pad_token_id,
        ) = settings
        self.length = length
        self.plan = plan
        # Per decoder: its sliding window where a rolling cache of that many
        # positions is smaller than the sequence, else None.
        self.windows = [
            layer.sliding_window
            if layer.sliding_window and layer.sliding_window < length
            else None
            for layer, _ in plan.body
            if isinstance(layer, TransformerDecoder)
        ]
        # Tracked, so their variables are the compiled function's state.
        layers = [plan.embedding] + [layer for layer, _ in plan.body]
        layers += [layer for layer, _ in plan.head if layer is not plan.embedding]
        self.decoding_layers = layers + ([plan.encoder] if plan.encoder else [])
        self.seed_generator = keras.random.SeedGenerator(0)
        self.compile(jit_compile=keras.config.backend() != "torch")
        self.built = True

    def call(self, inputs):
        prompt, pads = inputs["prompt"], ops.cast(inputs["pads"], "int32")
        # Cache lengths of the decoding segments (see `_loop`).
        segments = _segments(prompt.shape[1] + 1, self.length)
        state = self._initial_state(inputs, prompt, pads, segments[0])
        if self.method == "beam":
            return self._beam_search(prompt, state, segments)
        return self._greedy_or_sample(prompt, state, inputs["seed"], segments)

    def _initial_state(self, inputs, prompt, pads, first):
        """The prompt's last logits, the caches, the key mask and the context."""
        plan, batch = self.plan, ops.shape(prompt)[0]
        memory, memory_mask = None, None
        if plan.encoder is not None:
            sources = [inputs[f"encoder_{i}"] for i in range(len(plan.encoder_indices))]
            memory = plan.encoder(sources)
            if plan.encoder_mask_input is not None:
                memory_mask = ops.not_equal(sources[plan.encoder_mask_input], 0)
        caches, cross = [], []  # per decoder: self-attention and cross caches
        for layer, encoder_output in plan.body:
            if isinstance(layer, TransformerDecoder):
                caches.append(layer.get_empty_self_attention_cache(batch, first))
                cross.append(
                    None
                    if encoder_output is None
                    else layer.compute_cross_attention_cache(memory)
                )
        positions = ops.arange(first)[None, :]
        keys = ops.greater_equal(positions, pads[:, None])  # (B, first): not padding
        if plan.embedding.mask_zero:
            keys = ops.logical_and(keys, _pad_to(prompt != 0, first, True))
        context = (pads, cross, memory_mask)
        logits, caches = self._step(prompt, 0, caches, keys, context, prefill=True)
        # Sliding-window decoders keep the last `w` positions from here on
        # (`_rolling_call`): slots for positions width - w + 1, ..., width.
        caches = [
            _last_positions(cache, prompt.shape[1], window) if window else cache
            for cache, window in zip(caches, self.windows, strict=True)
        ]
        return logits[:, -1], caches, keys, context

    def _loop(self, body, loop_vars, segments):
        """`ops.while_loop` over the segments; `loop_vars` start with
        `(index, tokens, logits, caches, keys)`.

        The caches and the key mask hold `segments[i]` positions while the
        index runs up to `segments[i]`, then grow (zero keys and values, not
        padding) to the next segment's length: each step attends over at most
        twice the positions written so far, not over all of `length`. Each
        segment's loop has static shapes, so it compiles.
        """
        for i, segment in enumerate(segments):
            if i > 0:
                index, tokens, logits, caches, keys, *rest = loop_vars
                caches = [
                    cache if window else _pad_to(cache, segment, 0, axis=3)
                    for cache, window in zip(caches, self.windows, strict=True)
                ]
                keys = _pad_to(keys, segment, True)
                loop_vars = (index, tokens, logits, caches, keys, *rest)

            def running(index, tokens, logits, caches, keys, done, *rest):
                # Positions left in this segment and some sequence not done.
                return ops.logical_and(
                    index < segment,  # noqa: B023 (called in this iteration)
                    ops.logical_not(ops.all(done)),
                )

            loop_vars = ops.while_loop(running, body, loop_vars)
        return loop_vars

    def _step(self, token_ids, index, caches, keys, context, prefill=False):
        """Embedding, decoders and head on new tokens at `index`: `(logits, caches)`.

        `keys` `(B, L)` marks the cache positions that are not padding;
        `context` is `(pads per row, cross-attention caches, source mask)`.
        In one-token steps, the caches of sliding-window decoders are rolling
        (see `_rolling_call`); in the `prefill` they are full.
        """
        pads, cross, memory_mask = context
        start = index - pads  # (B,): each row's position of the first new token
        x = self._embed(token_ids, start)
        positions = ops.expand_dims(start, 1) + ops.expand_dims(
            ops.arange(0, ops.shape(token_ids)[1], dtype="int32"), 0
        )  # (B, T), for rotary positions
        new_caches, decoder = [], 0
        for layer, _ in self.plan.body:
            if not isinstance(layer, TransformerDecoder):
                x = layer(x)
                continue
            kwargs = dict(
                encoder_padding_mask=memory_mask
                if cross[decoder] is not None
                else None,
                cross_attention_cache=cross[decoder],
                positions=positions if layer.rope_max_wavelength else None,
            )
            window = self.windows[decoder]
            if window and not prefill:
                x, cache = self._rolling_call(
                    layer, x, caches[decoder], keys, index, kwargs
                )
            else:
                x, cache, *_ = layer(
                    x,
                    decoder_padding_mask=keys,
                    self_attention_cache=caches[decoder],
                    self_attention_cache_update_index=index,
                    **kwargs,
                )
            new_caches.append(cache)
            decoder += 1
        for layer, kwargs in self.plan.head:
            x = layer(x, **kwargs)
        return ops.cast(x, "float32"), new_caches

    def _embed(self, token_ids, start):
        embedding = self.plan.embedding
        if isinstance(embedding, SinusoidalEmbedding):
            return embedding(token_ids, start_index=start)
        return embedding(token_ids)

    def _rolling_call(self, layer, x, cache, keys, index, kwargs):
        """One token at `index` through a sliding-window decoder whose cache
        holds only its window, `w` positions: `(output, cache)`.

        Slot `s` holds position `index - (w - 1) + s` and the new token goes
        into the last slot, so the layer's causal window, relative to that
        slot, allows every slot; `keys` gives which are real tokens. Rolling
        the cache by one then frees the last slot for the next position.
        Memory stays `w` positions however long the generation runs.
        """
        window = cache.shape[3]
        padded = ops.pad(keys, [[0, 0], [window, 0]], constant_values=False)
        slots = ops.slice(padded, [0, index + 1], [ops.shape(keys)[0], window])
        x, cache, *_ = layer(
            x,
            decoder_padding_mask=slots,
            self_attention_cache=cache,
            self_attention_cache_update_index=window - 1,
            **kwargs,
        )
        return x, ops.roll(cache, -1, axis=3)

    def _greedy_or_sample(self, prompt, state, seed, segments):
        logits, caches, keys, context = state
        tokens = _pad_to(prompt, self.length, self.pad_token_id)
        # False per row, computed from an input rather than a constant: XLA
        # from TensorFlow 2.21 fails on three while loops that pass a constant
        # through unchanged (tensorflow/tensorflow#122886), as greedy decoding
        # without an end token does.
        done = ops.less(context[0], 0)  # context[0]: the pads per row
        seed = ops.cast(seed, self.seed_generator.state.dtype)

        def body(index, tokens, logits, caches, keys, done, seed):
            token, seed = self._choose(logits, seed)
            token, done, tokens, keys = self._write(token, index, done, tokens, keys)
            logits, caches = self._step(token[:, None], index, caches, keys, context)
            return index + 1, tokens, logits[:, -1], caches, keys, done, seed

        loop_vars = (prompt.shape[1], tokens, logits, caches, keys, done, seed)
        loop_vars = (ops.convert_to_tensor(loop_vars[0], "int32"),) + loop_vars[1:]
        return self._loop(body, loop_vars, segments)[1]

    def _write(self, token, index, done, tokens, keys):
        """Put each row's token at `index` (padding once a row is done)."""
        token = ops.where(done, self.pad_token_id, ops.cast(token, "int32"))
        if self.end_token_id is not None:
            done = ops.logical_or(done, ops.equal(token, self.end_token_id))
        tokens = ops.slice_update(tokens, [0, index], token[:, None])
        if self.plan.embedding.mask_zero:  # id 0 is padding to the model too
            keys = ops.slice_update(keys, [0, index], ops.not_equal(token, 0)[:, None])
        return token, done, tokens, keys

    def _choose(self, logits, seed):
        """Next token per row from float32 logits `(B, V)`: argmax or a draw."""
        if self.method == "greedy":
            return ops.argmax(logits, axis=-1), seed
        logits = _filter_logits(logits / self.temperature, self.top_k, self.top_p)
        state = self.seed_generator.state
        with keras.StatelessScope(state_mapping=[(state, seed)]) as scope:
            token = keras.random.categorical(logits, 1, seed=self.seed_generator)
            seed = scope.get_current_value(state)
        return token[:, 0], seed

    def _beam_search(self, prompt, state, segments):
        logits, caches, keys, (pads, cross, memory_mask) = state
        batch, beams, width = ops.shape(prompt)[0], self.num_beams, prompt.shape[1]
        vocabulary = logits.shape[-1]

        def expand(x):  # (B, ...) -> (B * beams, ...), beams of a row adjacent
            return None if x is None else ops.repeat(x, beams, axis=0)

        tokens = expand(_pad_to(prompt, self.length, self.pad_token_id))
        logits, keys, caches = expand(logits), expand(keys), [expand(c) for c in caches]
        context = (expand(pads), [expand(c) for c in cross], expand(memory_mask))
        first_beam_only = ops.arange(beams) == 0  # identical beams start once
        scores = ops.where(first_beam_only, 0.0, -1e9)[None, :] * ops.ones((batch, 1))
        done = ops.zeros((batch * beams,), "bool")
        lengths = ops.zeros((batch * beams,), "float32")

        def body(index, tokens, logits, caches, keys, done, scores, lengths):
            log_probs = ops.log_softmax(logits, axis=-1)  # (B * beams, V)
            finished = ops.one_hot(self.pad_token_id, vocabulary) - 1.0  # 0 at pad
            log_probs = ops.where(done[:, None], finished * 1e9, log_probs)
            total = scores[:, :, None] + ops.reshape(log_probs, (batch, beams, -1))
            scores, best = ops.top_k(ops.reshape(total, (batch, -1)), beams)
            origin = ops.reshape(
                best // vocabulary + ops.arange(batch)[:, None] * beams, (-1,)
            )  # (B * beams,): the beam each new beam extends
            token = ops.reshape(best % vocabulary, (-1,))
            tokens, keys, done, lengths = (
                ops.take(x, origin, axis=0) for x in (tokens, keys, done, lengths)
            )
            caches = [ops.take(cache, origin, axis=0) for cache in caches]
            lengths = lengths + ops.cast(ops.logical_not(done), "float32")
            token, done, tokens, keys = self._write(token, index, done, tokens, keys)
            logits, caches = self._step(token[:, None], index, caches, keys, context)
            return index + 1, tokens, logits[:, -1], caches, keys, done, scores, lengths

        index = ops.convert_to_tensor(width, "int32")
        loop_vars = (index, tokens, logits, caches, keys, done, scores, lengths)
        _, tokens, _, _, _, _, scores, lengths = self._loop(body, loop_vars, segments)
        lengths = ops.reshape(ops.maximum(lengths, 1.0), (batch, beams))
        best = ops.argmax(scores / lengths**self.length_penalty, axis=-1)
        return ops.take(tokens, best + ops.arange(batch) * beams, axis=0)


def _segments(first, length, smallest=64):
    """Cache lengths of the decoding segments: powers of two, then `length`.

    The first holds `first` positions (the prompt and the first new token);
    each next one doubles, the last is `length`.
    """
    size = smallest
    while size < first:
        size *= 2
    segments = []
    while size < length:
        segments.append(size)
        size *= 2
    return segments + [length]


def _last_positions(cache, width, window):
    """The rolling cache after a prompt of `width` tokens: slots for positions
    `width - window + 1, ..., width` (the last one free; before 0, zeros)."""
    cache = _pad_to(cache, max(cache.shape[3], width + 1), 0, axis=3)
    padded = _pad_to(cache, cache.shape[3] + window, 0, axis=3, front=True)
    return ops.slice(  # position p sits at p + window
        padded, [0, 0, 0, width + 1, 0], (*ops.shape(cache)[:3], window, cache.shape[4])
    )


def _pad_to(x, size, value, axis=1, front=False):
    """`x` padded with `value` at the end (or the front) of `axis` to `size`
    positions."""
    widths = [[0, 0]] * len(x.shape)
    pad = size - x.shape[axis]
    widths[axis] = [pad, 0] if front else [0, pad]
    return ops.pad(x, widths, constant_values=value)


def _filter_logits(logits, top_k, top_p):
    """Keep the `top_k` largest logits and the smallest set of mass `top_p`."""
    lowest = np.finfo("float32").min
    if top_k is not None:
        kth = ops.top_k(logits, min(top_k, logits.shape[-1]))[0][:, -1:]
        logits = ops.where(logits < kth, lowest, logits)
    if top_p is not None:
        descending = ops.flip(ops.sort(logits, axis=-1), axis=-1)
        mass_before = ops.cumsum(ops.softmax(descending, axis=-1), axis=-1)
        mass_before = mass_before - ops.softmax(descending, axis=-1)
        kept = ops.where(mass_before < top_p, descending, np.inf)
        threshold = ops.min(kept, axis=-1, keepdims=True)
        logits = ops.where(logits < threshold, lowest, logits)
    return logits
