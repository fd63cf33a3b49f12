"""Keras' machinery on keras_attn layers: configs that explain themselves on
load, per-sublayer dtype policies, LoRA, and initializer clones."""

import inspect
import re

import keras

from keras_attn._checks import (
    check_config,
    check_positive_float,
    check_positive_int,
    get_keras_object,
)


class ConfigCheck:
    """Mixin giving a layer a `from_config` that explains configs it cannot read.

    A `.keras` file written by a newer keras_attn may carry arguments this
    version does not know; one written by an older version may lack ones it
    requires. Both raise a `ValueError` naming the layer, the keys and the
    installed version, instead of a `TypeError` from deep inside Keras.
    """

    @classmethod
    def from_config(cls, config):
        check_config(cls, config)
        return super().from_config(config)


def call_arguments(layer, args, kwargs):
    """The arguments of a call of `layer` by name, defaults included, as
    Keras passes them to `compute_output_spec` (symbolic calls only)."""
    bound = inspect.signature(layer.call).bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def clone_initializer(initializer):
    """A fresh copy of a Keras initializer, so sublayers never share a seed."""
    if isinstance(initializer, keras.initializers.Initializer):
        return initializer.__class__.from_config(initializer.get_config())
    return initializer


def dtype_config(layer):
    """The layer's `dtype` config entry, keeping its sublayers' own policies.

    After `model.quantize(...)`, or with a `DTypePolicyMap` as `dtype`, some
    sublayers have policies of their own, and `build()` must recreate them so
    (quantized sublayers have other variables). They are saved, as keras-hub
    does, in a `DTypePolicyMap`, keyed by each sublayer's path relative to
    `layer` (`.*/self_attention/query$`), so that they match wherever the layer
    sits after loading.
    """
    policy = _resolved_policy(layer)
    serialized = keras.dtype_policies.serialize(policy)
    overrides = {}
    for sublayer in layer._flatten_layers(include_self=False):
        own = _resolved_policy(sublayer)
        if keras.dtype_policies.serialize(own) != serialized:
            relative = sublayer.path.removeprefix(f"{layer.path}/")
            # Anchored: `.*/query` must not also match `.*/query_norm`.
            overrides[f".*/{re.escape(relative)}$"] = own
    if not overrides:
        return serialized
    policy_map = keras.dtype_policies.DTypePolicyMap(policy, overrides)
    return keras.dtype_policies.serialize(policy_map)


def leaf_dtype(layer, name):
    """The dtype policy for `layer`'s Keras sublayer `name`, created in `build`.

    A `DTypePolicyMap` is resolved at the sublayer's path rather than handed
    down: Keras' `EinsumDense` reads `dtype_policy.quantization_mode` when it
    saves, which for a layer holding a map is the map's default, and so it
    would save a quantized kernel without its scale. keras_attn sublayers
    (attention in the blocks) get the map itself, and resolve it for theirs.
    """
    policy = layer.dtype_policy
    if isinstance(policy, keras.dtype_policies.DTypePolicyMap):
        return policy[f"{layer.path}/{name}"]
    return policy


def _resolved_policy(layer):
    policy = layer.dtype_policy
    if isinstance(policy, keras.dtype_policies.DTypePolicyMap):
        return policy[layer.path] if layer.path else policy.default_policy
    return policy


def enable_lora(layer, targets, rank, lora_alpha, a_initializer, b_initializer):
    """Keras' LoRA on each of `targets`, then every other weight of `layer` frozen.

    Checked before anything changes: the layer is built, `rank` and
    `lora_alpha` are valid, and no target has LoRA already or a kernel
    constraint (Keras refuses both), nor a float8 kernel (Keras accepts it,
    then fails in `fit`).
    """
    if not layer.built:
        raise ValueError(
            f"{layer.name} must be built (called once) before `enable_lora`."
        )
    rank = check_positive_int("rank", rank)
    if lora_alpha is not None:
        lora_alpha = check_positive_float("lora_alpha", lora_alpha)
    for target in targets:
        if target.lora_enabled:
            raise ValueError(
                f"LoRA is already enabled on {layer.name} ({target.path}). "
                "It can be enabled once."
            )
        if getattr(target, "quantization_mode", None) == "float8":
            raise ValueError(
                f"LoRA cannot train on a float8 kernel, and {target.path} is "
                "quantized to float8: Keras 3.15 accepts the adapters, then "
                "fails in `fit`. Enable LoRA before `quantize('float8')`, or "
                "quantize to int8 or int4."
            )
        constraint = getattr(target, "kernel_constraint", None) or getattr(
            target, "embeddings_constraint", None
        )
        if constraint is not None:
            raise ValueError(
                f"LoRA cannot adapt a constrained kernel, and {target.path} has "
                f"the constraint {constraint}. Create {layer.name} without it."
            )
    for target in targets:
        target.enable_lora(
            rank,
            lora_alpha=lora_alpha,
            a_initializer=a_initializer,
            b_initializer=b_initializer,
        )
    for variable in layer.weights:
        if not variable.name.startswith("lora_"):
            variable.trainable = False


def set_keras_objects(layer, **identifiers):
    """Each initializer, regularizer and constraint as an attribute of
    `layer`, by its argument name (`kernel_initializer`, ...)."""
    for name, identifier in identifiers.items():
        get = _KINDS[name.split("_")[-1]].get
        setattr(layer, name, get_keras_object(name, get, identifier))


def keras_objects_config(layer, names):
    """The config entries of `layer`'s initializers, regularizers and
    constraints `names`."""
    return {
        name: _KINDS[name.split("_")[-1]].serialize(getattr(layer, name))
        for name in names
    }


_KINDS = {
    "initializer": keras.initializers,
    "regularizer": keras.regularizers,
    "constraint": keras.constraints,
}


def all_layers(model):
    """Every layer inside `model`, nested ones included, each once.

    Keras has no public walk over nested layers (`model.layers` lists the
    top level only); its private `_flatten_layers` is that walk, used here
    and nowhere else (tests/layers/test_keras_internals.py fails if a Keras
    release moves it)."""
    return list(model._flatten_layers(include_self=False, recursive=True))


def quantized_layers(model):
    """The names of `model`'s quantized layers (int8, float8, ...), nested
    ones included: the converters write and read float weights only."""
    return [
        layer.name
        for layer in all_layers(model)
        if getattr(layer, "quantization_mode", None)
    ]
