"""Helpers shared by the layers: argument checks (one message style, raised
before any state changes), config checks on load, initializer cloning, the
`dtype` config entry and LoRA."""

import inspect
import numbers
import re

import keras
from keras import ops


def clone_initializer(initializer):
    """A fresh copy of a Keras initializer, so sublayers never share a seed."""
    if isinstance(initializer, keras.initializers.Initializer):
        return initializer.__class__.from_config(initializer.get_config())
    return initializer


def check_seed(seed):
    """Raise unless `seed` is `None` or an int >= 0."""
    if seed is None:
        return None
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise TypeError(
            "`seed` must be None or an int >= 0. "
            f"Received: seed={seed!r} of type {type(seed).__name__}."
        )
    if seed < 0:
        raise ValueError(f"`seed` must be None or an int >= 0. Received: seed={seed}.")
    return int(seed)


def check_positive_int(name, value, allow_none=False):
    """Raise unless `value` is a positive int (or `None` when allowed)."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        expected = "a positive int or None" if allow_none else "a positive int"
        raise TypeError(
            f"`{name}` must be {expected}. "
            f"Received: {name}={value!r} of type {type(value).__name__}."
        )
    if value <= 0:
        raise ValueError(f"`{name}` must be a positive int. Received: {name}={value}.")
    return int(value)


def check_shape_argument(name, value):
    """`None`, or a tuple of positive ints from a positive int or a list/tuple."""
    if value is None:
        return None
    dims = (value,) if isinstance(value, numbers.Integral) else value
    if (
        isinstance(value, bool)
        or not isinstance(dims, list | tuple)
        or not dims
        or not all(
            isinstance(d, numbers.Integral) and not isinstance(d, bool) for d in dims
        )
    ):
        raise TypeError(
            f"`{name}` must be None, an int or a tuple of ints. "
            f"Received: {name}={value!r} of type {type(value).__name__}."
        )
    if any(d <= 0 for d in dims):
        raise ValueError(
            f"`{name}` must hold positive ints. Received: {name}={value!r}."
        )
    return tuple(int(d) for d in dims)


def check_rate(name, value):
    """Raise unless `value` is a float in [0, 1)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"`{name}` must be a float in [0, 1). "
            f"Received: {name}={value!r} of type {type(value).__name__}."
        )
    if not 0.0 <= value < 1.0:
        raise ValueError(f"`{name}` must be in [0, 1). Received: {name}={value}.")
    return float(value)


def check_positive_float(name, value, allow_none=False):
    """Raise unless `value` is a real number > 0 (or `None` when allowed)."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"`{name}` must be a positive float. "
            f"Received: {name}={value!r} of type {type(value).__name__}."
        )
    if not value > 0:
        raise ValueError(f"`{name}` must be positive. Received: {name}={value}.")
    return float(value)


def check_bool(name, value, allow_none=False):
    """Raise unless `value` is a bool (or `None` when allowed)."""
    if value is None and allow_none:
        return None
    if not isinstance(value, bool):
        expected = "a bool or None" if allow_none else "a bool"
        raise TypeError(
            f"`{name}` must be {expected}. "
            f"Received: {name}={value!r} of type {type(value).__name__}."
        )
    return value


def check_one_of(name, value, options):
    """Raise unless `value` is one of the strings `options`."""
    if not isinstance(value, str):
        raise TypeError(
            f"`{name}` must be one of {list(options)}. "
            f"Received: {name}={value!r} of type {type(value).__name__}."
        )
    if value not in options:
        raise ValueError(
            f"`{name}` must be one of {list(options)}. Received: {name}={value!r}."
        )
    return value


def check_rank(name, shape, rank, description):
    """Raise unless `shape` has `rank` dimensions."""
    if len(shape) != rank:
        raise ValueError(
            f"`{name}` must have rank {rank}, {description}. "
            f"Received: {name}.shape={tuple(shape)}."
        )


def check_float(name, tensor):
    """Raise unless `tensor` has a floating dtype."""
    dtype = keras.backend.standardize_dtype(tensor.dtype)
    if "float" not in dtype:
        raise TypeError(
            f"`{name}` must be a float tensor. Received: {name}.dtype={dtype}."
        )


def check_width(name, shape, width):
    """Raise unless the last dimension of `shape` is the `width` built for."""
    if _known(shape[-1]) and _known(width) and shape[-1] != width:
        raise ValueError(
            f"`{name}` must have the width the layer was built with. "
            f"Received: {name}.shape={tuple(shape)}, built width={width}."
        )


def check_flash_attention(flash_attention, dropout, logit_soft_cap=None):
    """Raise if `flash_attention=True` comes with dropout or soft-capped
    logits, which the flash kernel cannot compute."""
    if flash_attention and dropout > 0:
        raise ValueError(
            "`flash_attention=True` needs the fused flash kernel, which "
            "cannot apply dropout to the attention weights. Received: "
            f"flash_attention=True, dropout={dropout}. Pass dropout=0.0, or "
            "flash_attention=None (fused kernels where possible)."
        )
    if flash_attention and logit_soft_cap is not None:
        raise ValueError(
            "`flash_attention=True` needs the fused flash kernel, which "
            "cannot soft-cap the logits. Received: flash_attention=True, "
            f"logit_soft_cap={logit_soft_cap}. Pass flash_attention=None."
        )


def check_key_value_heads(num_heads, num_key_value_heads):
    """`num_key_value_heads`, checked: `None` or a positive divisor of
    `num_heads` (grouped-query attention)."""
    num_key_value_heads = check_positive_int(
        "num_key_value_heads", num_key_value_heads, allow_none=True
    )
    if num_key_value_heads and num_heads % num_key_value_heads:
        raise ValueError(
            "`num_key_value_heads` must divide `num_heads`. Received: "
            f"num_heads={num_heads}, num_key_value_heads={num_key_value_heads}."
        )
    return num_key_value_heads


def check_modern_attention(
    rope_max_wavelength, rope_scaling_factor, normalize_qk, logit_soft_cap
):
    """The attention options of today's families, checked, by name: rotary
    positions, QK-norm and logit soft-capping."""
    options = dict(
        rope_max_wavelength=check_positive_float(
            "rope_max_wavelength", rope_max_wavelength, allow_none=True
        ),
        rope_scaling_factor=check_positive_float(
            "rope_scaling_factor", rope_scaling_factor
        ),
        normalize_qk=check_bool("normalize_qk", normalize_qk),
        logit_soft_cap=check_positive_float(
            "logit_soft_cap", logit_soft_cap, allow_none=True
        ),
    )
    if rope_max_wavelength is None and options["rope_scaling_factor"] != 1.0:
        raise ValueError(
            "`rope_scaling_factor` scales rotary positions, and there are none "
            "without `rope_max_wavelength`. Received: rope_scaling_factor="
            f"{rope_scaling_factor}, rope_max_wavelength=None."
        )
    return options


class CallArguments:
    """A call's `locals()` as attributes, without `self`.

    A plain class: `torch.compile` traces it, not `types.SimpleNamespace`.
    """

    def __init__(self, arguments):
        for name, value in arguments.items():
            if name != "self":
                setattr(self, name, value)


def check_positions(positions, batch, length, rope_max_wavelength):
    """Raise unless `positions` is a real tensor `(length,)` or `(batch, length)`
    for a layer with rotary positions."""
    if positions is None:
        return
    if rope_max_wavelength is None:
        raise ValueError(
            "`positions` are rotary positions, and this layer has none: create "
            "it with `rope_max_wavelength`. Received: positions of shape "
            f"{tuple(getattr(positions, 'shape', ()))}, rope_max_wavelength=None."
        )
    if not hasattr(positions, "dtype"):
        positions = ops.convert_to_tensor(positions)
    dtype = keras.backend.standardize_dtype(positions.dtype)
    if dtype == "bool" or "complex" in dtype:
        raise TypeError(
            "`positions` must hold int or float positions. "
            f"Received: positions.dtype={dtype}."
        )
    check_mask("positions", positions, {1: (length,), 2: (batch, length)})


def compiled_by_torch():
    """Whether `torch.compile` is tracing this call: its tensors have no
    values yet, and reading one breaks the graph (the read then runs eagerly).

    The one backend import of the layers: Keras has no public way to ask.
    """
    if keras.config.backend() != "torch":
        return False
    import torch  # loaded already: it is the backend

    return torch.compiler.is_compiling()


def concrete_value(tensor):
    """`tensor` as numpy where it holds values (an eager call), else `None`:
    tracers, graph tensors, torch.export's fake tensors and the tensors
    `torch.compile` traces have none yet."""
    if compiled_by_torch():
        return None
    try:
        return ops.convert_to_numpy(tensor)
    except (TypeError, NotImplementedError, RuntimeError):
        return None


def check_index(name, index, length, size):
    """Raise unless `index` is an int (or scalar int tensor) where `length`
    positions fit in `size`; where both are known, for Python ints."""
    if isinstance(index, bool) or not (
        isinstance(index, numbers.Integral) or hasattr(index, "dtype")
    ):
        raise TypeError(
            f"`{name}` must be an int or a scalar int tensor. "
            f"Received: {name}={index!r} of type {type(index).__name__}."
        )
    if not isinstance(index, numbers.Integral):
        dtype = keras.backend.standardize_dtype(index.dtype)
        if "int" not in dtype or len(index.shape) != 0:
            raise TypeError(
                f"`{name}` must be an int or a scalar int tensor. Received: "
                f"{name}.dtype={dtype}, {name}.shape={tuple(index.shape)}."
            )
        index = concrete_value(index)  # checked in eager calls only
        if index is None:
            return
        index = int(index)
    if index < 0 or (_known(length) and _known(size) and index + length > size):
        raise ValueError(
            f"`{name}` must leave room for the {length} new positions in the "
            f"cache of length {size}: 0 <= {name} <= {size} - {length}. "
            f"Received: {name}={index}."
        )


def dtype_config(layer):
    """The layer's `dtype` config entry, keeping its sublayers' own policies.

    After `model.quantize(...)`, or with a `DTypePolicyMap` as `dtype`, some
    sublayers have policies of their own, and `build()` must recreate them so
    (quantized sublayers have other variables). They are saved, as keras-hub
    does, in a `DTypePolicyMap`, keyed by each sublayer's path relative to
    `layer` (`.*/self_attention/query`), so that they match wherever the layer
    sits after loading.
    """
    policy = _resolved_policy(layer)
    serialized = keras.dtype_policies.serialize(policy)
    overrides = {}
    for sublayer in layer._flatten_layers(include_self=False):
        own = _resolved_policy(sublayer)
        if keras.dtype_policies.serialize(own) != serialized:
            relative = sublayer.path.removeprefix(f"{layer.path}/")
            overrides[f".*/{re.escape(relative)}"] = own
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
    constraint (Keras refuses both).
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


def check_broadcastable(name, tensor, shape, description):
    """Raise unless `tensor` is a float tensor broadcastable to `shape`
    (dims compared where both are known)."""
    if tensor is None:
        return
    check_float(name, tensor)
    got = tuple(tensor.shape)
    if len(got) > len(shape) or any(
        _known(a) and _known(b) and a not in (1, b)
        for a, b in zip(got[::-1], shape[::-1], strict=False)
    ):
        raise ValueError(
            f"`{name}` must be broadcastable to {description} = "
            f"{_describe(shape)}. Received: {name}.shape={got}."
        )


def get_keras_object(name, get, identifier):
    """`get(identifier)` (e.g. `keras.initializers.get`), naming `name` on error."""
    try:
        return get(identifier)
    except (TypeError, ValueError) as error:
        kind = name.split("_")[-1]  # kernel_initializer -> initializer
        error_class = ValueError if isinstance(identifier, str | dict) else TypeError
        raise error_class(
            f"`{name}` must be a Keras {kind}, or the name or config of one. "
            f"Received: {name}={identifier!r}."
        ) from error


def check_mask(name, mask, expected_shape, broadcast=False):
    """Raise unless `mask` fits `expected_shape`, dims compared where both are known.

    `expected_shape` is a shape, or a dict `rank -> shape` for masks that may
    come in several ranks. With `broadcast`, dims of size 1 are accepted.
    """
    if mask is None:
        return
    if not hasattr(mask, "shape"):
        mask = ops.convert_to_tensor(mask)
    shape = tuple(mask.shape)
    shapes = (
        expected_shape
        if isinstance(expected_shape, dict)
        else {len(expected_shape): expected_shape}
    )
    if len(shape) not in shapes:
        options = " or ".join(_describe(s) for s in shapes.values())
        raise ValueError(
            f"`{name}` must have rank {' or '.join(map(str, shapes))}: {options}. "
            f"Received: {name}.shape={shape}."
        )
    expected = shapes[len(shape)]
    for got, want in zip(shape, expected, strict=True):
        if (
            _known(got)
            and _known(want)
            and got != want
            and not (broadcast and got == 1)
        ):
            raise ValueError(
                f"`{name}` does not match the inputs: expected shape "
                f"{_describe(expected)}. Received: {name}.shape={shape}."
            )


def _known(dim):
    return isinstance(dim, int)


def _describe(shape):
    return "(" + ", ".join(str(d) if _known(d) else "None" for d in shape) + ")"


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


def check_config(cls, config):
    """Raise unless `cls(**config)` gets only arguments it accepts, and all it needs.

    Accepted: the named arguments of every `__init__` from `cls` to
    `keras.layers.Layer`. A subclass from elsewhere taking `**kwargs` may accept
    anything, so then only missing arguments are checked.
    """
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    accepted, open_ended = {"input_dim", "input_shape"}, False
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
    from keras_attn import __version__  # here: the package imports this module

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
