"""Reading a functional model's graph: where its token embedding, decoders,
head and encoder are. Done once per model; `adapter.py` runs what it finds."""

import dataclasses
import warnings

import keras
import numpy as np

from keras_attn.layers import (
    PositionEmbedding,
    SinusoidalEmbedding,
    TransformerDecoder,
)

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
        "Rescaling",
        "Softmax",
    )
    if hasattr(keras.layers, name)
)
EMBEDDINGS = (
    "a token embedding read from the token-id input: SinusoidalEmbedding("
    "vocabulary_size=...) (positions included), or keras.layers.Embedding or "
    "ReversibleEmbedding (positions from the decoders' `rope_max_wavelength`, "
    "or a PositionEmbedding after it)"
)

# Decoder call arguments a one-token step cannot be given.
STEP_UNSAFE = (
    "decoder_padding_mask",
    "decoder_attention_mask",
    "decoder_attention_bias",
    "encoder_attention_mask",
    "encoder_attention_bias",
    "encoder_padding_mask",
    "positions",
    "segment_ids",  # packed rows: a step would attend across their documents
)

# Keras' tied embedding (`reverse=True` gives logits), where Keras has it.
_REVERSIBLE_EMBEDDING = getattr(keras.layers, "ReversibleEmbedding", ())


class GraphPlan:
    """The decoding-relevant layers of a functional model, in order.

    Attributes: `embedding` (the decoder-side token embedding), `body` (list
    of `(layer, encoder output or None)` from the embedding to the last
    decoder), `head` (list of `(layer, call kwargs)` after it),
    `vocabulary_size`, `prompt_index` (the token-id input), and for
    encoder-decoder models `encoder` (a `keras.Model` of the encoder inputs),
    `encoder_indices`, `source_embedding` (whose mask pads the source) and
    `source_specs` (what `generate` checks each encoder input against).
    """

    def __init__(self, model):
        _check_model(model)
        self.inputs = list(model.inputs)  # not the model: it keys the caches
        self._producers = _producers(model)
        self.head, self.body, self.embedding, prompt = self._trace(model.outputs[0])
        self.prompt_index = _input_index(self.inputs, prompt)
        self.decoders = [layer for layer, _ in self.body if is_decoder(layer)]
        # Per decoder: whether it cross-attends to the encoder output.
        self.cross_attends = [
            memory is not None for layer, memory in self.body if is_decoder(layer)
        ]
        encoder_outputs = {id(t): t for _, t in self.body if t is not None}
        if len(encoder_outputs) > 1:
            raise ValueError(
                "`generate` needs every TransformerDecoder to attend to the same "
                "encoder output."
            )
        self.encoder, self.encoder_indices, self.source_embedding = None, [], None
        self.source_specs = []
        if encoder_outputs:
            self._plan_encoder(next(iter(encoder_outputs.values())))
        self.outputs_probabilities = _ends_in_softmax(self.head)
        # The longest sequence a learned position table holds, if any.
        tables = [x for x, _ in self.body if isinstance(x, PositionEmbedding)]
        self.max_positions = min((t.sequence_length for t in tables), default=None)
        self._warned = False
        _check_logits_width(model.outputs[0], self.embedding, self.vocabulary_size)

    @property
    def layers(self):
        """Every layer decoding runs, once each."""
        layers = [self.embedding] + [layer for layer, _ in self.body]
        layers += [layer for layer, _ in self.head if layer is not self.embedding]
        return layers + ([self.encoder] if self.encoder else [])

    def warn_if_probabilities(self, method):
        """Warn once per model when a sampling or beam method meets a softmax
        head: it reads the head's output as logits."""
        if method != "greedy" and self.outputs_probabilities and not self._warned:
            self._warned = True
            warnings.warn(
                f"`generate(method={method!r})` reads the model's output as "
                "logits, but its head ends in a softmax (probabilities), so the "
                "distribution it samples or ranks is flattened. Remove the "
                "softmax from the model passed to `generate`.",
                stacklevel=3,
            )

    def _trace(self, logits):
        """Walk back from the logits: head layers, decoder blocks, embedding."""
        head, (layer, inputs, kwargs, tensors) = [], self._producer(logits)
        while not is_decoder(layer):
            if not _is_tied_head(layer, kwargs):
                _check_per_token(layer, inputs, "after the last TransformerDecoder")
            head.insert(0, (layer, kwargs))
            layer, inputs, kwargs, tensors = self._producer(inputs[0])
        body = []
        while not _is_token_embedding(layer, kwargs):
            if is_decoder(layer):
                _check_decoder_call(layer, kwargs, tensors)
                # The node's tensors: the decoder sequence, then the encoder
                # sequence if any (float, rank 3), then masks (bool).
                sequences = [t for t in inputs[1:] if _is_sequence(t)]
                body.insert(0, (layer, sequences[0] if sequences else None))
            else:
                _check_before_decoders(layer, inputs)
                body.insert(0, (layer, None))
            layer, inputs, kwargs, tensors = self._producer(
                inputs[0], before_decoders=True
            )
        self.vocabulary_size = _vocabulary_size(layer)
        return head, body, layer, inputs[0]

    def _producer(self, tensor, before_decoders=False):
        found = self._producers.get(id(tensor))
        if found is None:
            where = " before the TransformerDecoders" if before_decoders else ""
            raise ValueError(
                f"`generate` found no token embedding{where}. It needs "
                f"{EMBEDDINGS}, then TransformerDecoders, then per-position "
                "layers up to the logits."
            )
        return found

    def _plan_encoder(self, encoder_output):
        sources = _ancestors(encoder_output, self._producers, self.inputs)
        if self.prompt_index in sources:
            raise ValueError(
                "`generate` needs the encoder output to depend only on the "
                "encoder inputs, not on the decoder's token ids."
            )
        self.encoder_indices = sorted(sources)
        self.encoder = keras.Model(
            [self.inputs[i] for i in self.encoder_indices], encoder_output
        )
        self.source_embedding = self._masking_embedding(encoder_output)
        self.source_specs = [self._source_spec(i) for i in self.encoder_indices]

    def _source_spec(self, index):
        """`SourceSpec` of model input `index`: its name, shape and dtype,
        and the vocabulary of the token embeddings that read it, if any."""
        model_input = self.inputs[index]
        sizes = [
            _token_vocabulary(layer, kwargs)
            for layer, inputs, kwargs, _ in self._producers.values()
            if any(t is model_input for t in inputs)
        ]
        sizes = [size for size in sizes if size is not None]
        return SourceSpec(
            name=model_input.name,
            shape=tuple(model_input.shape),
            integer="int" in str(model_input.dtype),
            vocabulary_size=min(sizes) if sizes else None,
        )

    def _masking_embedding(self, tensor):
        """`(encoder input position, embedding)` of the first layer on the
        way back from `tensor` whose mask pads the source, if any."""
        while id(tensor) in self._producers:
            layer, inputs, *_ = self._producers[id(tensor)]
            if getattr(layer, "mask_zero", False):
                index = _input_index(self.inputs, inputs[0])
                return self.encoder_indices.index(index), layer
            tensor = inputs[0]
        return None

    def split_inputs(self, inputs):
        """`(prompt, [encoder inputs])` from what the user passed: one array
        (nested lists too) for a one-input model, else a list in
        `model.inputs` order or a dict by input name."""
        names = [t.name for t in self.inputs]
        if isinstance(inputs, dict):
            unknown = sorted(set(inputs) - set(names))
            if unknown or len(inputs) != len(names):
                raise ValueError(
                    f"`inputs` must have the model's input names {names}. "
                    f"Received: {sorted(inputs)}."
                )
            inputs = [inputs[name] for name in names]
        elif len(names) == 1:
            inputs = [_one_input(inputs)]
        elif not isinstance(inputs, list | tuple) or len(inputs) != len(names):
            count = len(inputs) if isinstance(inputs, list | tuple) else 1
            raise ValueError(
                f"`inputs` must be a list or dict of the model's {len(names)} "
                f"inputs ({names}). Received {count}."
            )
        encoder_inputs = [inputs[i] for i in self.encoder_indices]
        return inputs[self.prompt_index], encoder_inputs


@dataclasses.dataclass(frozen=True)
class SourceSpec:
    """What an encoder input of the model expects: `shape` (the `keras.Input`'s,
    batch first), int ids or not, and ids below `vocabulary_size` (None: no
    token embedding reads it)."""

    name: str
    shape: tuple
    integer: bool
    vocabulary_size: int | None


def _token_vocabulary(layer, kwargs):
    """The number of ids `layer` embeds, if it is a token embedding (a Keras
    `Embedding` called forward, or a layer with an int `vocabulary_size`)."""
    if isinstance(layer, keras.layers.Embedding) and not kwargs.get("reverse"):
        return layer.input_dim
    size = getattr(layer, "vocabulary_size", None)
    return size if isinstance(size, int) and not isinstance(size, bool) else None


def _one_input(inputs):
    """A one-input model's ids: `[array]` (Keras' list form) is unwrapped;
    nested Python lists are the ids themselves."""
    if isinstance(inputs, list | tuple) and len(inputs) == 1:
        if not isinstance(inputs[0], list | tuple) and np.ndim(inputs[0]) == 2:
            return inputs[0]
    return inputs


def _check_model(model):
    if not isinstance(model, keras.Model) or not hasattr(model, "inputs"):
        raise ValueError(
            "`generate` needs a functional keras.Model built from keras_attn "
            f"layers, or a `(prefill, step)` pair. Received: {type(model).__name__}."
        )
    if len(model.outputs) != 1:
        raise ValueError(
            "`generate` needs a model with one output, the token logits. "
            f"Received a model with {len(model.outputs)} outputs."
        )
    if not any(is_decoder(layer) for layer in model.layers):
        raise ValueError(
            "`generate` found no TransformerDecoder in the model: it decodes "
            "models whose logits come from keras_attn decoder blocks. Pass a "
            "`(prefill, step)` pair for other models."
        )


def _check_decoder_call(layer, kwargs, tensors):
    """Refuse decoder calls the cached steps cannot reproduce."""
    # Tensors, or constants the model was built with (e.g. numpy ids).
    given = [*tensors, *(k for k, v in kwargs.items() if v is not None)]
    extra = sorted(set(given) & set(STEP_UNSAFE))
    if extra:
        raise ValueError(
            f"`generate` cannot decode {layer.name}: it is called with {extra}, "
            "which a one-token step cannot be given. Padding reaches the "
            "decoders through the embedding's `mask_zero=True`; pass a "
            "`(prefill, step)` pair for other models."
        )
    if kwargs.get("use_causal_mask", True) is not True:
        raise ValueError(
            f"`generate` decodes one token at a time with a cache, which needs "
            f"causal self-attention, but {layer.name} is called with "
            "use_causal_mask=False: its outputs depend on later tokens. "
            "Decode it by re-running the model, or build it causal."
        )


def _is_per_token(layer, inputs):
    """One sequence in, through a layer that acts on the last axis alone."""
    tensors = [t for t in inputs if _is_sequence(t)]
    axis = getattr(layer, "axis", -1)
    last_axis = axis in (-1, 2) or (
        isinstance(axis, list | tuple) and list(axis) in ([-1], [2])
    )
    return isinstance(layer, PER_TOKEN_LAYERS) and len(tensors) == 1 and last_axis


def _check_per_token(layer, inputs, where):
    if not _is_per_token(layer, inputs):
        raise ValueError(
            f"`generate` runs the layers {where} one token at a time, so they "
            "must act on each position alone: one of "
            f"{[c.__name__ for c in PER_TOKEN_LAYERS]}. "
            f"Received: {layer.name} ({type(layer).__name__})."
        )


def _check_before_decoders(layer, inputs):
    if isinstance(layer, PositionEmbedding):  # `generate` passes `start_index`
        return
    if not _is_per_token(layer, inputs):
        raise ValueError(
            f"`generate` found {layer.name} ({type(layer).__name__}) between "
            "the token ids and the first TransformerDecoder. It supports there "
            f"{EMBEDDINGS}, then per-position layers "
            f"({[c.__name__ for c in PER_TOKEN_LAYERS]}). For other models, "
            "pass a `(prefill, step)` pair."
        )


def _vocabulary_size(embedding):
    if isinstance(embedding, SinusoidalEmbedding):
        if embedding.vocabulary_size is None:
            raise ValueError(
                f"`generate` needs the decoder's SinusoidalEmbedding "
                f"({embedding.name}) to embed token ids (`vocabulary_size` set)."
            )
        return embedding.vocabulary_size
    return embedding.input_dim


def _check_logits_width(logits, embedding, vocabulary_size):
    """Raise if the head scores more tokens than the embedding has: a chosen
    id past the vocabulary would index past the table (checked here, once,
    from shapes: the decoding steps check nothing)."""
    width = logits.shape[-1]
    if isinstance(width, int) and width > vocabulary_size:
        raise ValueError(
            f"`generate` feeds each chosen token id back to {embedding.name}, "
            f"which embeds {vocabulary_size} ids, but the model scores {width} "
            f"tokens per position: ids {vocabulary_size} to {width - 1} have no "
            "embedding. Give the head as many units as the vocabulary."
        )


def _ends_in_softmax(head):
    if not head:
        return False
    layer = head[-1][0]
    activation = getattr(layer, "activation", None)
    return isinstance(layer, keras.layers.Softmax) or (
        getattr(activation, "__name__", None) == "softmax"
    )


def is_decoder(layer):
    return isinstance(layer, TransformerDecoder)


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
    """`id(output tensor) -> (layer, flat input tensors, call kwargs that are
    not tensors, names of those that are)` over the
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
            tensors = [  # names of the tensors passed by keyword
                k
                for k, v in node.arguments.kwargs.items()
                if isinstance(v, keras.KerasTensor)
            ]
            for output in node.output_tensors:
                producers[id(output)] = (
                    layer, list(node.input_tensors), kwargs, tensors
                )  # fmt: skip
    return producers


def _tied_embedding(layer, nodes):
    """Whether `layer` is a `ReversibleEmbedding` called forward, then reversed."""
    reverse = sorted(bool(node.arguments.kwargs.get("reverse")) for node in nodes)
    return isinstance(layer, _REVERSIBLE_EMBEDDING) and reverse == [False, True]


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


def _input_index(model_inputs, tensor):
    for i, model_input in enumerate(model_inputs):
        if tensor is model_input:
            return i
    raise ValueError(
        f"`generate` needs {EMBEDDINGS}: the token embedding must read a model "
        "input directly."
    )
