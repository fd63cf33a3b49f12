"""The check of a saved config against the layer that reads it."""

import inspect

import keras

from keras_attn._version import __version__


def check_config(cls, config):
    """Raise unless `cls(**config)` gets only arguments it accepts, and all it needs.

    Accepted: the named arguments of every `__init__` from `cls` to
    `keras.layers.Layer`, and the names in `cls.keyword_arguments` (options it
    takes through `**kwargs`). A subclass from elsewhere taking `**kwargs` may
    accept anything, so then only missing arguments are checked.
    """
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    accepted = {"input_dim", "input_shape", *getattr(cls, "keyword_arguments", ())}
    open_ended = False
    for klass in cls.__mro__:
        if "__init__" not in vars(klass):
            continue
        parameters = inspect.signature(klass.__init__).parameters.values()
        accepted |= {p.name for p in parameters if p.kind in named}
        if klass is keras.layers.Layer:
            break
        open_ended |= not klass.__module__.startswith("keras_attn.") and any(
            p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters
        )
    unknown = [] if open_ended else sorted(set(config) - accepted - {"self"})
    missing = sorted(
        p.name
        for p in list(inspect.signature(cls.__init__).parameters.values())[1:]
        if p.kind in named and p.default is p.empty and p.name not in config
    )
    if not unknown and not missing:
        return
    received, advice = [], []
    if unknown:
        received.append(f"unknown arguments {unknown}")
        advice.append("a newer keras_attn saved it: upgrade keras_attn")
    if missing:
        received.append(f"missing required arguments {missing}")
        advice.append(
            "an older keras_attn saved it: install the version that saved it "
            "(downgrade keras_attn)"
        )
    raise ValueError(
        f"Cannot create {cls.__name__} from its saved config with keras_attn "
        f"{__version__}. Received: {' and '.join(received)}. "
        f"Probably {'; or '.join(advice)}."
    )
