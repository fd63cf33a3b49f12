"""The decoding loop: the adapter's model state, the logits processors and a
strategy, wired into compiled `ops.while_loop`s, one per cache segment (on
PyTorch, a Python loop over one step, compiled once per shape)."""

import contextlib
import functools
import time

import keras
import numpy as np
from keras import ops

from keras_attn.generation import processors, strategies
from keras_attn.generation.adapter import FunctionAdapter, pad_to
from keras_attn.generation.settings import NUMBERS
from keras_attn.generation.tiers import StepForms
from keras_attn.layers._lean_call import SublayerCalls
from keras_attn.ops.constants import constant


class Generator(keras.Model):
    """Decodes one prompt width to one length with one `Settings`; a model,
    so `predict_on_batch` compiles it (JAX, TensorFlow).

    `traces` counts how often the loop body was traced (or, where nothing
    compiles it, run).

    Its own dtype policy is float32, whatever the global one: the loop's
    numbers (temperature, penalties, probabilities, beam scores) are computed
    in float32, and Keras does not cast its float inputs to a mixed policy's
    compute dtype. The model's layers keep their own policies; the adapter
    casts their logits to float32.
    """

    def __init__(self, adapter, settings, width, length, jit_compile):
        super().__init__(name="keras_attn_generator", dtype="float32")
        self.adapter, self.settings = adapter, settings
        self.strategy = strategies.strategy(settings)
        self.width, self.length = width, length
        # Tracked, so their variables are the compiled function's state.
        self.decoding_layers = adapter.layers
        self.traces = 0
        torch = keras.config.backend() == "torch"
        # PyTorch's compiled steps, by shape (`jit_compile` True or "auto").
        self.forms = StepForms(jit_compile) if jit_compile and torch else None
        # PyTorch writes each step's tokens (and scores) into the loop's own
        # buffers in place, as the caches (`_torch.write_in_place`): Keras'
        # `slice_update` there clones the buffer and builds a meshgrid.
        self.write_in_place = None
        if torch:
            from keras_attn import _torch_eager

            self.write_in_place = _torch_eager.write_in_place
        self.compile(jit_compile=bool(jit_compile) and not torch)
        self.built = True

    def call(self, inputs):
        return self.decode(inputs)

    def decode(self, inputs, on_token=None):
        """`{"tokens"}`, and `"scores"` if asked for, each `(batch, length)`,
        left-padded rows.

        `on_token(step, tokens)` is called after each step with the new
        tokens `(batch,)`, from a Python loop (so not inside `predict`).
        """
        segments = _segments(self.width + 1, self.length)
        if isinstance(self.adapter, FunctionAdapter) or (
            self.forms is not None and self.forms.jit_compile is True
        ):
            segments = [self.length]  # PyTorch: one compile per `generate` shape
        sources = numbered(inputs, "encoder_")
        pads = ops.cast(inputs["pads"], "int32")
        calls = SublayerCalls()  # bound once for every step of this call
        logits, model = self.adapter.prefill(
            inputs["prompt"], pads, sources, segments[0], calls
        )
        state = self.strategy.start(
            self._initial_state(inputs["prompt"], pads, logits, model)
        )
        numbers = {key: inputs[key] for key in NUMBERS}
        with self._steps_held() as lease:
            pace = _Pace(self.forms, _shape_of(inputs), lease)
            for i, size in enumerate(segments):
                if pace.finished(state, bool(self.settings.end_token_ids)):
                    break
                step = pace.compiles(state, self.length) and self._compiled(
                    state, numbers, calls, pace.key
                )
                if step:  # the rest, compiled over the whole length
                    state["model"] = self.adapter.grow(state["model"], self.length)
                    state = self._python_loop(state, self.length, step, on_token)
                    break
                if i > 0:
                    state["model"] = self.adapter.grow(state["model"], size)
                timing = pace.start(state)
                state = self._segment(state, size, numbers, on_token, calls)
                pace.stop(state, timing)
            results = self.strategy.finish(state, numbers)
            if self.forms is not None:  # off the compiled step's buffers,
                results = [None if r is None else ops.copy(r) for r in results]
        tokens, scores = results  # which the next call of this shape writes into
        return {"tokens": tokens, **({"scores": scores} if scores is not None else {})}

    def _initial_state(self, prompt, pads, logits, model):
        batch, vocabulary = ops.shape(prompt)[0], logits.shape[-1]
        state = {
            "index": ops.convert_to_tensor(self.width, "int32"),
            "tokens": pad_to(
                ops.cast(prompt, "int32"), self.length, self.settings.pad_token_id
            ),
            "logits": logits,
            # False per row, computed from an input rather than a constant: XLA
            # from TensorFlow 2.21 fails on three while loops that pass a
            # constant through unchanged (tensorflow/tensorflow#122886).
            "done": ops.less(pads, 0),
            "model": model,
        }
        if self.settings.return_scores:
            state["scores"] = ops.zeros((batch, self.length), "float32")
        if self.settings.penalized:
            state["seen"] = _seen(prompt, pads, vocabulary)
        return state

    def _segment(self, state, size, numbers, on_token, calls):
        """Steps while the index is below `size` and some row is not done."""

        def running(state):
            return ops.logical_and(
                state["index"] < size, ops.logical_not(ops.all(state["done"]))
            )

        def body(state):
            return self._step(state, numbers, calls)

        if on_token is None and self.jit_compile:  # JAX, TensorFlow
            return ops.while_loop(running, body, state)
        return self._python_loop(state, size, body, on_token)

    def _python_loop(self, state, size, step, on_token):
        """`step(state)` from Python to `size` (PyTorch, or to call
        `on_token`): the index is a Python int. `done` is read back once per
        step where end tokens can finish rows early; otherwise a step reads
        nothing back to the host."""
        index = int(ops.convert_to_numpy(state["index"]))
        ends = bool(self.settings.end_token_ids)
        while index < size and not (
            ends and ops.convert_to_numpy(ops.all(state["done"]))
        ):
            state = step(state)
            if on_token is not None:
                on_token(
                    index - self.width, ops.convert_to_numpy(state["tokens"])[:, index]
                )
            index += 1
        return state

    def _steps_held(self):
        """PyTorch's compiled steps keep their state in buffers of their own:
        one decoding at a time may use them (`StepForms.held`)."""
        return contextlib.nullcontext() if self.forms is None else self.forms.held()

    def _compiled(self, state, numbers, calls, key):
        """PyTorch: `step(state)`, the step compiled once per `generate`
        shape (`key`) over the whole length: by Inductor, or as a CUDA graph
        where `"auto"` chose one (on a GPU); `None` where `"auto"` could not
        compile it."""

        def make(form):
            from keras_attn.generation import _torch

            grown = {**state, "model": self.adapter.grow(state["model"], self.length)}
            build = _torch.capture_step if form == "graph" else _torch.compile_step
            step = functools.partial(self._step, calls=calls)
            return build(step, self.decoding_layers, grown, numbers)

        compiled = self.forms.compiled_step(key, make, _form(state))
        return compiled and (lambda state: compiled(state, numbers))

    def _step(self, state, numbers, calls):
        """Choose and write one token per row, then run the model on it."""
        self.traces += 1
        logits = self._process(state, numbers)
        token, log_prob, state = self.strategy.choose(logits, state, numbers)
        token, state = self._write(token, log_prob, state)
        logits, model = self.adapter.step(token, state["index"], state["model"], calls)
        return {**state, "index": state["index"] + 1, "logits": logits, "model": model}

    def _process(self, state, numbers):
        """The logits processors the settings ask for, in Hugging Face's order."""
        logits = state["logits"]
        if self.settings.penalized:
            logits = processors.repetition_penalty(
                logits, state["seen"], numbers["repetition_penalty"]
            )
        if self.settings.end_token_ids:
            allowed = state["index"] - self.width >= numbers["min_new_tokens"]
            logits = processors.suppress_end_tokens(
                logits, self._end_tokens(logits), allowed
            )
        if self.settings.method == "sample":
            logits = processors.temperature(logits, numbers["temperature"])
            sorted_logits = processors.descending(logits)
            logits, sorted_logits = processors.top_k(
                logits, sorted_logits, numbers["top_k"]
            )
            logits = processors.top_p(logits, sorted_logits, numbers["top_p"])
        return logits

    def _end_tokens(self, logits):
        """bool `(V,)`: True at the end tokens' ids."""
        ends = _end_token_mask(logits.shape[-1], tuple(self.settings.end_token_ids))
        return ops.convert_to_tensor(ends)

    def _write(self, token, log_prob, state):
        """Each row's token (padding once the row is done) at `index`, and
        what the settings keep of it: its log-probability, that it was seen."""
        done, index = state["done"], state["index"]
        token = ops.cast(token, "int32")
        ends = self.settings.end_token_ids  # without them, no row is ever done
        if ends:
            token = ops.where(done, self.settings.pad_token_id, token)
        state = {**state, "tokens": self._put(state["tokens"], token, index)}
        if ends:
            state["done"] = ops.logical_or(done, is_end_token(token, ends))
        if self.settings.return_scores:
            log_prob = ops.where(done, 0.0, log_prob) if ends else log_prob
            state["scores"] = self._put(state["scores"], log_prob, index)
        if self.settings.penalized:
            new = ops.one_hot(token, state["seen"].shape[-1]) > 0
            state["seen"] = ops.logical_or(state["seen"], new)
        return token, state

    def _put(self, buffer, column, index):
        """`column` `(B,)` written into the loop's `buffer` `(B, L)` at
        `index`: in place on PyTorch, else a new buffer."""
        if self.write_in_place is not None:
            return self.write_in_place(buffer, column[:, None], index)
        return ops.slice_update(buffer, [0, index], column[:, None])


class _Pace:
    """The eager pace of a PyTorch decoding, timed segment by segment, and
    whether the rest of it runs compiled (`StepForms.compiles`)."""

    def __init__(self, forms, key, lease):
        self.forms, self.key, self.lease = forms, key, lease
        self.seconds_per_step = None

    def finished(self, state, ends):
        """Whether every row is done (PyTorch, where end tokens end rows):
        no segment, compiled or not, is left to run."""
        if self.forms is None or not ends:
            return False
        return bool(ops.convert_to_numpy(ops.all(state["done"])))

    def compiles(self, state, length):
        if self.forms is None:
            return False
        remaining = length - _index(state)
        return self.forms.compiles(
            self.key, remaining, self.seconds_per_step, _form(state), self.lease
        )

    def start(self, state):
        """`(index, time)` as a segment of eager steps begins."""
        if self.forms is None:
            return None
        return _index(state), time.perf_counter()

    def stop(self, state, timing):
        """The segment begun at `timing` ended: its time is spent."""
        if timing is None:
            return
        seconds, steps = time.perf_counter() - timing[1], _index(state) - timing[0]
        self.forms.spend(self.key, seconds)
        self.seconds_per_step = seconds / max(steps, 1)


def _index(state):
    return int(ops.convert_to_numpy(state["index"]))


def _shape_of(inputs):
    """What a compiled PyTorch step is made for: the shapes and dtypes of the
    inputs (batch, prompt width, encoder inputs)."""
    return tuple(
        (name, tuple(value.shape), str(value.dtype))
        for name, value in sorted(inputs.items())
    )


def _form(state):
    """What `jit_compile="auto"` compiles a PyTorch step to: a CUDA graph on
    a GPU, Inductor elsewhere."""
    from keras_attn.generation import _torch

    return "graph" if _torch.device_type(state) == "cuda" else "inductor"


def is_end_token(tokens, end_token_ids):
    """bool, of `tokens`' shape: where a token is one of `end_token_ids`."""
    ends = constant(end_token_ids, "int32", tokens)
    return ops.any(tokens[..., None] == ends, axis=-1)


@functools.lru_cache(maxsize=16)
def _end_token_mask(vocabulary_size, end_token_ids):
    """The numpy mask of `Generator._end_tokens`, made once (not an
    `np.isin` of the whole vocabulary at every eager step); read-only, as it
    is shared."""
    mask = np.isin(np.arange(vocabulary_size), end_token_ids)
    mask.flags.writeable = False
    return mask


def _seen(prompt, pads, vocabulary):
    """bool `(B, V)`: the tokens in each row's prompt (padding excluded)."""
    batch, width = ops.shape(prompt)[0], prompt.shape[1]
    real = ops.greater_equal(ops.arange(width)[None, :], pads[:, None])
    rows = ops.repeat(ops.arange(batch, dtype="int32")[:, None], width, axis=1)
    indices = ops.reshape(ops.stack([rows, ops.cast(prompt, "int32")], -1), (-1, 2))
    counts = ops.scatter(
        indices, ops.reshape(ops.cast(real, "float32"), (-1,)), (batch, vocabulary)
    )
    return counts > 0


def numbered(inputs, prefix):
    """The batch's entries `prefix0, prefix1, ...` in order (e.g. the encoder
    inputs, `"encoder_"`)."""
    count = sum(1 for key in inputs if key.startswith(prefix))
    return [inputs[f"{prefix}{i}"] for i in range(count)]


def shapes_key(state):
    """The shapes and dtypes of a state's tensors: what a step (or round)
    compiled on PyTorch is exported for."""
    return tuple((tuple(x.shape), str(x.dtype)) for x in keras.tree.flatten(state))


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
