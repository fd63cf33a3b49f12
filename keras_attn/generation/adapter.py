"""Model adapters: the only code of `generate` that knows about layers.

An adapter offers `prefill(prompt, pads, sources, size, calls)`, `step(token,
index, state, calls)` and `grow(state, size)` on a model state (a dict of
tensors and caches, batch first). The decoding loop and its strategies see
only logits and that opaque state. `calls` (`SublayerCalls`) is what one
decoding binds once for all its steps.
"""

import keras
from keras import ops

from keras_attn.cache import DenseCache, RollingCache, as_cache
from keras_attn.generation.graph import is_decoder
from keras_attn.layers import PositionEmbedding, SinusoidalEmbedding


class ModelAdapter:
    """Runs a `GraphPlan`'s layers over key/value caches (`keras_attn.cache`
    objects), through their unchecked twins (`decode_unchecked`,
    `call_unchecked`): `generate` checked its inputs once, and a step reads
    nothing back to the host.

    The caches grow in segments (`grow`): a step attends over at most the
    segment's positions, not the whole `length`. Decoders with a sliding
    window shorter than `length` keep a `RollingCache` of their sinks and
    window instead. With `cache_dtype="int8"` the self-attention caches are
    `Int8Cache`s.

    Model state: `caches` (a cache object per decoder), `keys` (`(B, L)`,
    True where a position holds a real token), `pads` (`(B,)`, left padding
    per row), `cross` (cross-attention caches by decoder) and, with a padded
    source, `source_mask`.
    """

    def __init__(self, plan, length, roll=True, cache_dtype=None):
        self.plan, self.length, self.cache_dtype = plan, length, cache_dtype
        self.layers = plan.layers
        # Per decoder: whether its cache rolls (sinks and window fewer than
        # the positions). `roll=False` keeps dense caches (speculative
        # decoding moves the index back, which a rolling cache cannot undo).
        self.rolling = [
            bool(
                roll
                and layer.sliding_window
                and layer.sliding_window + (layer.attention_sinks or 0) < length
            )
            for layer in plan.decoders
        ]

    def prefill(self, prompt, pads, sources, size, calls):
        """Run the encoder and the prompt: `(last logits (B, V), state)` with
        caches of `size` positions (at least the prompt's width + 1)."""
        batch, width = ops.shape(prompt)[0], prompt.shape[1]
        state = {"pads": pads, "cross": {}}
        if self.plan.encoder is not None:
            state.update(self._encode(sources))
        state["caches"] = [
            as_cache(
                layer.get_empty_self_attention_cache(batch, size, self.cache_dtype)
            )
            for layer in self.plan.decoders
        ]
        keys = ops.greater_equal(ops.arange(size)[None, :], pads[:, None])
        mask = padding_mask(self.plan.embedding, prompt)
        if mask is not None:
            keys = ops.logical_and(keys, pad_to(mask, size, True))
        state["keys"] = keys
        logits, state = self._run(prompt, 0, state, calls)
        state["caches"] = [  # rolling caches keep the sinks and the window
            RollingCache.from_prefill(
                cache, width, pads, layer.sliding_window, layer.attention_sinks or 0
            )
            if rolls
            else cache
            for cache, layer, rolls in zip(
                state["caches"], self.plan.decoders, self.rolling, strict=True
            )
        ]
        return logits[:, -1], state

    def step(self, token, index, state, calls):
        """One new token per row `(B,)` at position `index`: `(logits (B, V),
        state)`."""
        logits, state = self.extend(token[:, None], index, state, calls)
        return logits[:, -1], state

    def extend(self, token_ids, index, state, calls):
        """New tokens `(B, T)` at positions `index, ..., index + T - 1`:
        `(logits (B, T, V), state)`. Speculative decoding verifies a draft's
        `T` tokens in one pass; the causal mask is offset by `index`."""
        mask = padding_mask(self.plan.embedding, token_ids)
        if mask is not None:  # a padding id is padding to the model, too
            state = {**state, "keys": ops.slice_update(state["keys"], [0, index], mask)}
        return self._run(token_ids, index, state, calls)

    def grow(self, state, size):
        """Caches and key mask padded to `size` positions (zeros, not padding);
        rolling caches keep their window."""
        caches = [
            cache if rolls else cache.grown(size)
            for cache, rolls in zip(state["caches"], self.rolling, strict=True)
        ]
        return {**state, "caches": caches, "keys": pad_to(state["keys"], size, True)}

    def _encode(self, sources):
        """The encoder output's cross-attention caches, and the source's
        padding mask `(B, 1, S)` where its embedding has one."""
        memory = self.plan.encoder(sources)
        cross = {
            str(i): DenseCache(layer.compute_cross_attention_cache(memory))
            for i, (layer, attends) in enumerate(
                zip(self.plan.decoders, self.plan.cross_attends, strict=True)
            )
            if attends
        }
        encoded = {"cross": cross}
        if self.plan.source_embedding is not None:
            position, embedding = self.plan.source_embedding
            mask = padding_mask(embedding, sources[position])
            encoded["source_mask"] = None if mask is None else mask[:, None, :]
        return encoded

    def _run(self, token_ids, index, state, calls):
        """Embedding, decoders and head on new tokens at `index`."""
        start = index - state["pads"]  # (B,): each row's first new position
        positions = None  # the rotary positions, for decoders that rotate
        if any(_rotates(layer) for layer in self.plan.decoders):
            positions = start[:, None] + ops.arange(token_ids.shape[1], dtype="int32")
        x = self._embed(token_ids, start, calls)
        masks, caches = {}, []  # a mask per kind of cache, made once a step
        for layer, _ in self.plan.body:
            if isinstance(layer, PositionEmbedding):
                x = layer.call_unchecked(x, start)
            elif not is_decoder(layer):
                x = calls(layer, x)
            else:
                decoder = len(caches)
                cache = state["caches"][decoder]
                mask = _mask(masks, cache, layer, index, token_ids.shape[1], state)
                x, cache = layer.decode_unchecked(
                    x, cache, index,
                    positions=positions if _rotates(layer) else None,
                    mask=mask,
                    cross_cache=state["cross"].get(str(decoder)),
                    cross_mask=state.get("source_mask"),
                    calls=calls,
                )  # fmt: skip
                caches.append(cache)
        return ops.cast(self._head(x, calls), "float32"), {**state, "caches": caches}

    def _head(self, x, calls):
        """The head's layers on the decoders' output (a tied embedding with
        its `reverse=True`)."""
        for layer, kwargs in self.plan.head:
            x = layer(x, **kwargs) if kwargs else calls(layer, x)
        return x

    def _embed(self, token_ids, start, calls):
        """The token embedding at each row's `start`: a `SinusoidalEmbedding`
        gathers its positions from a table made once a decoding."""
        embedding = self.plan.embedding
        if not isinstance(embedding, SinusoidalEmbedding):
            return calls(embedding, token_ids)
        table = calls.once(
            (id(embedding), "positions"),
            lambda: embedding.position_table(self.length),
        )
        return embedding.call_unchecked(token_ids, start, table=table, calls=calls)


def _rotates(decoder):
    """Whether a decoder's self-attention rotates its queries and keys (its
    own sublayer's option: a block's, or a custom self-attention's)."""
    return decoder.self_attention.rope_max_wavelength is not None


def _mask(masks, cache, layer, index, count, state):
    """The cache slots a decoder's new tokens see (`cache.mask`), made once
    a step for every cache of one kind (class, slots, window, sinks)."""
    window, sinks = layer.sliding_window, layer.attention_sinks
    kind = (type(cache), cache.length, window, sinks)
    if kind not in masks:
        masks[kind] = cache.mask(index, count, state["keys"], window, sinks)
    return masks[kind]


class FunctionAdapter:
    """A user's own `(prefill, step)` pair, for models the graph walk cannot
    read; see `generate`. One segment: the user's state keeps its shapes."""

    def __init__(self, functions, length):
        self.prefill_function, self.step_function = functions
        self.length = length
        self.layers = _layers_of(functions)

    def prefill(self, prompt, pads, sources, size, calls=None):
        logits, state = self.prefill_function(prompt, self.length)
        return _last(logits), state

    def step(self, token, index, state, calls=None):
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


def pad_to(x, size, value, axis=1):
    """`x` padded with `value` at the end of `axis` to `size` positions."""
    widths = [[0, 0]] * len(x.shape)
    widths[axis] = [0, size - x.shape[axis]]
    return ops.pad(x, widths, constant_values=value)
