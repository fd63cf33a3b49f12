"""Model adapters: the only code of `generate` that knows about layers.

An adapter offers `prefill(prompt, pads, sources, size)`, `step(token, index,
state)` and `grow(state, size)` on a model state (a dict of tensors, batch first). The
decoding loop and its strategies see only logits and that opaque state.
"""

import keras
from keras import ops

from keras_attn._checks import checked_upstream
from keras_attn.generation.graph import is_decoder
from keras_attn.layers import PositionEmbedding, SinusoidalEmbedding
from keras_attn.layers._kv_cache import caches_written_by
from keras_attn.layers._lean_call import call_sublayer, direct_call


class ModelAdapter:
    """Runs a `GraphPlan`'s layers with key/value caches.

    The caches grow in segments (`grow`): a step attends over at most the
    segment's positions, not the whole `length`. Decoders with a sliding
    window shorter than `length` keep a rolling cache of their window instead
    (and of their attention sinks, each row's first positions, before it).

    Model state: `caches` (per decoder, `(B, 2, heads, L, head_dim)`), `keys`
    (`(B, L)`, True where a cache position is a real token), `pads` (`(B,)`,
    left padding per row), `cross` (cross-attention caches by decoder) and,
    with a padded source, `source_mask`.

    On PyTorch a step writes its new keys and values into the caches in
    place (`_torch.keys_and_values_writer`), as gpt-fast does: the caches are the
    adapter's own, and a copy per step would move the whole cache. Rolling
    caches are rolled into new ones.
    """

    def __init__(self, plan, length, roll=True):
        self.plan = plan
        self.layers = plan.layers
        # Per decoder: whether its cache rolls over its window (see
        # `_rolling_call`): sinks and window fewer than the positions.
        # `roll=False` keeps full caches (speculative decoding moves the index
        # back, which a rolled cache cannot undo).
        self.rolling = [
            bool(
                roll
                and layer.sliding_window
                and layer.sliding_window + _sinks(layer) < length
            )
            for layer in plan.decoders
        ]
        self.writer = None  # `keras.ops.slice_update`
        if keras.config.backend() == "torch":
            from keras_attn.generation import _torch

            self.writer = _torch.keys_and_values_writer

    def prefill(self, prompt, pads, sources, size):
        """Run the encoder and the prompt: `(last logits (B, V), state)` with
        caches of `size` positions (at least the prompt's width + 1)."""
        batch, width = ops.shape(prompt)[0], prompt.shape[1]
        state = {"pads": pads, "cross": {}}
        if self.plan.encoder is not None:
            state.update(self._encode(sources))
        state["caches"] = [
            layer.get_empty_self_attention_cache(batch, size)
            for layer in self.plan.decoders
        ]
        keys = ops.greater_equal(ops.arange(size)[None, :], pads[:, None])
        mask = padding_mask(self.plan.embedding, prompt)
        if mask is not None:
            keys = ops.logical_and(keys, pad_to(mask, size, True))
        state["keys"] = keys
        logits, state = self._run(prompt, 0, state, prefill=True)
        state["caches"] = [  # rolling caches keep the sinks and the window
            _rolling_cache(cache, width, layer, pads) if rolls else cache
            for cache, layer, rolls in zip(
                state["caches"], self.plan.decoders, self.rolling, strict=True
            )
        ]
        return logits[:, -1], state

    def step(self, token, index, state):
        """One new token per row `(B,)` at position `index`: `(logits (B, V),
        state)`.

        The layers skip their call checks (`checked_upstream`): `generate`
        checked its inputs, and a step reads no tensor back to the host.
        """
        logits, state = self.extend(token[:, None], index, state)
        return logits[:, -1], state

    def extend(self, token_ids, index, state):
        """New tokens `(B, T)` at positions `index, ..., index + T - 1`:
        `(logits (B, T, V), state)`. Speculative decoding verifies a draft's
        `T` tokens in one pass; the causal mask is offset by `index`."""
        mask = padding_mask(self.plan.embedding, token_ids)
        if mask is not None:  # a padding id is padding to the model, too
            state = {**state, "keys": ops.slice_update(state["keys"], [0, index], mask)}
        with checked_upstream():
            return self._run(token_ids, index, state)

    def grow(self, state, size):
        """Caches and key mask padded to `size` positions (zeros, not padding);
        rolling caches keep their window."""
        caches = [
            cache if rolls else pad_to(cache, size, 0, axis=3)
            for cache, rolls in zip(state["caches"], self.rolling, strict=True)
        ]
        return {**state, "caches": caches, "keys": pad_to(state["keys"], size, True)}

    def _encode(self, sources):
        memory = self.plan.encoder(sources)
        cross = {
            str(i): layer.compute_cross_attention_cache(memory)
            for i, (layer, attends) in enumerate(
                zip(self.plan.decoders, self.plan.cross_attends, strict=True)
            )
            if attends
        }
        encoded = {"cross": cross}
        if self.plan.source_embedding is not None:
            position, embedding = self.plan.source_embedding
            encoded["source_mask"] = padding_mask(embedding, sources[position])
        return encoded

    def _run(self, token_ids, index, state, prefill=False):
        """Embedding, decoders and head on new tokens at `index`."""
        start = index - state["pads"]  # (B,): each row's first new position
        positions = None  # the rotary positions, for decoders that rotate
        if any(layer.rope_max_wavelength for layer in self.plan.decoders):
            positions = start[:, None] + ops.arange(token_ids.shape[1], dtype="int32")
        x = self._embed(token_ids, start)
        write = None if prefill else self._writer(index, token_ids)
        caches, decoder = [], 0
        for layer, _ in self.plan.body:
            if isinstance(layer, PositionEmbedding):
                x = layer(x, start_index=start)
                continue
            if not is_decoder(layer):
                x = layer(x)
                continue
            kwargs = self._decoder_kwargs(layer, decoder, state, positions)
            if self.rolling[decoder] and not prefill:
                x, cache = _rolling_call(layer, x, state, decoder, index, kwargs)
            else:
                x, cache = self._decoder_call(
                    layer, x, state, decoder, index, kwargs, write
                )
            caches.append(cache)
            decoder += 1
        return ops.cast(self._head(x), "float32"), {**state, "caches": caches}

    def _head(self, x):
        """The head's layers on the decoders' output. Keras' own projections
        and norms run as their torch calls on PyTorch (`direct_call`); a
        layer called through `__call__` gets a new tensor, without the
        padding mask that rides on `x` (TensorFlow, PyTorch): the head acts on
        each position alone, and a Softmax would apply the `(B, T)` mask
        across the vocabulary."""
        fresh = False
        for layer, kwargs in self.plan.head:
            y = None if kwargs else direct_call(layer, x)
            if y is None:
                y = layer(x if fresh else ops.copy(x), **kwargs)
            x, fresh = y, True
        return x

    def _writer(self, index, token_ids):
        """How a step's decoders write their caches: in place on PyTorch
        (the positions made once for all of them), else `None` (Keras'
        `slice_update`)."""
        if self.writer is None:
            return None
        return self.writer(index, token_ids.shape[1], token_ids.device)

    def _decoder_call(self, layer, x, state, decoder, index, kwargs, write):
        """A decoder on the new tokens, its cache written at `index` by
        `write` (`None`: by `slice_update`): `(output, cache)`. Through the
        lean path: every argument is explicit, masks included."""
        with caches_written_by(write):
            x, cache, *_ = call_sublayer(
                layer,
                x,
                decoder_padding_mask=state["keys"],
                self_attention_cache=state["caches"][decoder],
                self_attention_cache_update_index=index,
                **kwargs,
            )
        return x, cache

    def _decoder_kwargs(self, layer, decoder, state, positions):
        cross = state["cross"].get(str(decoder))
        return dict(
            encoder_padding_mask=state.get("source_mask")
            if cross is not None
            else None,
            cross_attention_cache=cross,
            positions=positions if layer.rope_max_wavelength else None,
        )

    def _embed(self, token_ids, start):
        embedding = self.plan.embedding
        if isinstance(embedding, SinusoidalEmbedding):  # through the lean path:
            return call_sublayer(embedding, token_ids, start_index=start)
        return embedding(token_ids)


class FunctionAdapter:
    """A user's own `(prefill, step)` pair, for models the graph walk cannot
    read; see `generate`. One segment: the user's state keeps its shapes."""

    def __init__(self, functions, length):
        self.prefill_function, self.step_function = functions
        self.length = length
        self.layers = _layers_of(functions)

    def prefill(self, prompt, pads, sources, size):
        logits, state = self.prefill_function(prompt, self.length)
        return _last(logits), state

    def step(self, token, index, state):
        logits, state = self.step_function(token[:, None], index, state)
        return _last(logits), state

    def grow(self, state, size):
        return state


def padding_mask(embedding, token_ids):
    """The embedding's own mask of `token_ids` (None without one).

    Keras' `ReversibleEmbedding` masks inside `call` and its `compute_mask`
    returns None, so Keras embeddings answer by `Embedding`'s rule.
    """
    if isinstance(embedding, keras.layers.Embedding):
        return keras.layers.Embedding.compute_mask(embedding, token_ids)
    return embedding.compute_mask(token_ids)


def _layers_of(functions):
    """The Keras layers the functions are methods of or close over: the
    compiled loop reads their weights as state, not as constants."""
    found = []
    for function in functions:
        cells = [c.cell_contents for c in getattr(function, "__closure__", None) or ()]
        for value in [getattr(function, "__self__", None), *cells]:
            if isinstance(value, keras.layers.Layer) and value not in found:
                found.append(value)
    return found


def _last(logits):
    logits = ops.cast(logits, "float32")
    return logits[:, -1] if len(logits.shape) == 3 else logits


def _sinks(layer):
    return layer.attention_sinks or 0


def _sink_positions(pads, sinks):
    """`(B, s)`: each row's sink positions, `pads, ..., pads + s - 1` (its
    first `s` tokens)."""
    return pads[:, None] + ops.arange(sinks, dtype="int32")


def _rolling_call(layer, x, state, decoder, index, kwargs):
    """One token at `index` through a sliding-window decoder whose cache holds
    only its sinks and its window, `s + w` positions: `(output, cache)`.

    Sink slot `k < s` holds each row's position `pads + k` (its `k`-th token);
    window slot `s + k` holds position `index - (w - 1) + k`, and the new
    token goes into the last slot, so the layer's causal window, relative to
    that slot, allows every window slot and its sinks every sink slot;
    `_slot_keys` gives which hold real tokens, each once. Rolling the window
    by one then frees the last slot for the next position. Memory stays
    `s + w` positions however long the generation runs.
    """
    cache, sinks = state["caches"][decoder], _sinks(layer)
    window = cache.shape[3] - sinks
    slots = _slot_keys(state["keys"], state["pads"], index, window, sinks)
    x, cache, *_ = call_sublayer(  # written by `slice_update`: the roll copies
        layer,
        x,
        decoder_padding_mask=slots,
        self_attention_cache=cache,
        self_attention_cache_update_index=sinks + window - 1,
        **kwargs,
    )
    return x, _rolled(cache, state["pads"], index, sinks)


def _slot_keys(keys, pads, index, window, sinks):
    """`(B, s + w)`: which slots of a rolling cache hold real tokens that the
    token at `index` may see (`keys`, `(B, L)`, by position).

    A sink slot counts once written (its position before `index`); a window
    slot whose position is also a written sink does not (seen there, once).
    """
    padded = ops.pad(keys, [[0, 0], [window, 0]], constant_values=False)
    recent = ops.take(padded, index + 1 + ops.arange(window), axis=1)  # (B, w)
    if not sinks:
        return recent
    first = _sink_positions(pads, sinks)  # (B, s)
    at = ops.minimum(first, keys.shape[1] - 1)
    written = ops.logical_and(first < index, ops.take_along_axis(keys, at, axis=1))
    positions = index - (window - 1) + ops.arange(window, dtype="int32")  # (w,)
    unique = ops.logical_or(
        positions[None, :] >= (pads + sinks)[:, None],  # past the sinks
        ops.arange(window) == window - 1,  # the new token: in no sink slot yet
    )  # (B, w)
    return ops.concatenate([written, ops.logical_and(recent, unique)], axis=1)


def _rolled(cache, pads, index, sinks):
    """The cache after a step: its window rolled by one (the last slot free);
    where the new position is one of a row's sinks (`pads + k == index`), the
    new keys and values also kept in that sink slot."""
    if not sinks:
        return ops.roll(cache, -1, axis=3)
    first, recent = cache[:, :, :, :sinks], cache[:, :, :, sinks:]
    arrives = _sink_positions(pads, sinks) == index  # (B, s)
    first = ops.where(arrives[:, None, None, :, None], recent[:, :, :, -1:], first)
    return ops.concatenate([first, ops.roll(recent, -1, axis=3)], axis=3)


def _rolling_cache(cache, width, layer, pads):
    """The rolling cache after a prompt of `width` tokens: the sink slots
    (`_first_positions`), then the window's (`_last_positions`)."""
    recent = _last_positions(cache, width, layer.sliding_window)
    sinks = _sinks(layer)
    if not sinks:
        return recent
    return ops.concatenate([_first_positions(cache, pads, sinks), recent], axis=3)


def _first_positions(cache, pads, sinks):
    """The sink slots after the prompt: each row's positions `pads, ...,
    pads + sinks - 1`; those past the prompt are filled as they are
    generated (`_rolled`), and not seen before (`_slot_keys`)."""
    first = _sink_positions(pads, sinks)  # (B, s)
    at = ops.minimum(first, cache.shape[3] - 1)[:, None, None, :, None]
    shape = (*ops.shape(cache)[:3], sinks, cache.shape[4])
    return ops.take_along_axis(cache, ops.broadcast_to(at, shape), axis=3)


def _last_positions(cache, width, window):
    """The rolling cache after a prompt of `width` tokens: slots for positions
    `width - window + 1, ..., width` (the last one free; before 0, zeros)."""
    cache = pad_to(cache, max(cache.shape[3], width + 1), 0, axis=3)
    padded = pad_to(cache, cache.shape[3] + window, 0, axis=3, front=True)
    return ops.slice(  # position p sits at p + window
        padded, [0, 0, 0, width + 1, 0], (*ops.shape(cache)[:3], window, cache.shape[4])
    )


def pad_to(x, size, value, axis=1, front=False):
    """`x` padded with `value` at the end (or the front) of `axis` to `size`
    positions."""
    widths = [[0, 0]] * len(x.shape)
    pad = size - x.shape[axis]
    widths[axis] = [pad, 0] if front else [0, pad]
    return ops.pad(x, widths, constant_values=value)
