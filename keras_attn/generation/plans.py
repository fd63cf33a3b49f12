"""What `generate` reads of its model, once: the layers of a functional
model (`GraphPlan`, kept per model), or a user's `(prefill, step)`
functions."""

import weakref

import keras

from keras_attn.generation.graph import GraphPlan

_PLANS = weakref.WeakKeyDictionary()  # model -> its GraphPlan, read once


def plan_of(model):
    """`(cache owner, plan)`: the model's graph, read once, or the user's
    `(prefill, step)` functions."""
    if is_function_pair(model):
        owner = getattr(model[0], "__self__", model[0])
        return owner, FunctionPlan(model)
    if not isinstance(model, keras.Model):  # GraphPlan says what it needs
        return None, GraphPlan(model)
    if model not in _PLANS:
        _PLANS[model] = GraphPlan(model)
    return model, _PLANS[model]


def is_function_pair(model):
    """Two callables that are not layers (a list of two models is a mistake)."""
    if not isinstance(model, tuple | list) or len(model) != 2:
        return False
    if any(isinstance(f, keras.layers.Layer) for f in model):
        raise TypeError(
            "`model` must be a functional keras.Model or a `(prefill, step)` "
            "pair of functions. Received a pair of "
            f"{[type(f).__name__ for f in model]}."
        )
    return all(map(callable, model))


class FunctionPlan:
    """A user's `(prefill, step)` pair in the place of a model's graph."""

    vocabulary_size = None
    max_positions = None
    encoder_indices = ()
    source_specs = ()

    def __init__(self, functions):
        self.functions = tuple(functions)

    def split_inputs(self, inputs):
        return inputs, []

    def warn_if_probabilities(self, method):
        pass
