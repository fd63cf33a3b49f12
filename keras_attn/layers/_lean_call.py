"""Calling a built Keras sublayer from inside its parent's `call`, without
the cost of `Layer.__call__` where that costs nothing but time.

On PyTorch's eager steps Python bounds a block, and `Layer.__call__` (about
80 us a call on a CPU, nine calls a block) is half of a small block's
forward. Inside a parent's `call`, for a built sublayer, most of its work
is already done or does nothing: the parent's call context holds
`training`, the inputs are checked and of the compute dtype, the outputs'
Keras masks are never read. `call_sublayer` runs the sublayer's `call`
directly where `__call__` would do nothing else, and `__call__` otherwise:

- a quantized sublayer (`__call__` dispatches to `quantized_call`), one
  under a `RematScope`, or one with an activity regularizer;
- under a `keras.distribution` (`__call__` lays out the outputs by path);
- an argument that `__call__` converts: a numpy array, or (for a sublayer
  that autocasts) a float tensor not of its compute dtype;
- for a sublayer that autocasts: an autocast scope that `__call__` would change
  (the sublayer's own dtype policy, a `DTypePolicyMap` entry, differs from
  the scope its parent set, or no scope is set: `stateless_call`, a direct
  `call`); for one that does not (`autocast=False`, Keras' norms): a
  variable of its own that a scope would cast.

The arguments go to `call` as passed: the parent passes `training` (and the
masks) explicitly where the sublayer's `call` uses them.

On PyTorch a lean call of Keras' own `Dense`, `EinsumDense`,
`LayerNormalization` (over the last axis) or `RMSNormalization` goes one
step further: the torch calls its `call` makes, without `keras.ops`'
dispatch around each (`keras_attn.ops.kernels.torch_eager`, which says for
which dtypes; Keras' `call` elsewhere). The kernel comes from the layer's
own `kernel` property, LoRA included.
"""

import keras

try:  # Keras' autocast scope: no public way to ask for it (Keras 3.15).
    from keras.src.backend.common.variables import get_autocast_scope
except ImportError:  # another Keras: every sublayer through `__call__`
    get_autocast_scope = None

if keras.config.backend() == "torch":
    from keras_attn.ops.kernels import torch_eager
else:
    torch_eager = None


def call_sublayer(layer, inputs, *args, **kwargs):
    """`layer(inputs, *args, **kwargs)`, through `layer.call` where that is
    the same (the module docstring says when)."""
    if not lean(layer, inputs, *args, *kwargs.values()):
        return layer(inputs, *args, **kwargs)
    outputs = None if args or kwargs else _direct(layer, inputs)
    return layer.call(inputs, *args, **kwargs) if outputs is None else outputs


def direct_call(layer, inputs):
    """`layer(inputs)` as the torch calls of Keras' own `call` (PyTorch: a
    `Dense`, `EinsumDense`, `LayerNormalization` or `RMSNormalization` on a
    lean call, from inside a parent's `call` or from no layer's), or `None`
    for the caller to call the layer."""
    if type(layer).call not in _DIRECT or not lean(layer, inputs):
        return None
    return _direct(layer, inputs)


def _direct(layer, inputs):
    """The torch calls of a lean layer's Keras `call`, or `None` (another
    layer, or a case Keras' `call` keeps)."""
    direct = _DIRECT.get(type(layer).call)
    return None if direct is None else direct(layer, inputs)


def lean(layer, inputs, *arguments):
    """Whether `layer.call(inputs, *arguments)` computes what
    `layer(inputs, *arguments)` computes, from inside a parent's `call`
    (the arguments flat: tensors, Python values or `None`)."""
    return (
        layer.built
        and layer.quantization_mode is None
        and layer.activity_regularizer is None
        and getattr(layer, "_remat_mode", True) is None  # Keras' RematScope
        and keras.distribution.distribution() is None
        and keras.ops.is_tensor(inputs)
        and _arguments_kept(layer, (inputs, *arguments))
        and (_scope_kept(layer) if layer.autocast else _no_autocast(layer))
    )


def _arguments_kept(layer, arguments):
    """Whether `Layer.__call__` would pass each argument on as it is: no
    array to convert to a tensor, and (where the layer autocasts) no float
    tensor of another dtype than its compute dtype to cast (nested ones
    too: `__call__` maps over structures)."""
    for x in arguments:
        if isinstance(x, list | tuple | dict):
            if not _arguments_kept(layer, keras.tree.flatten(x)):
                return False
        elif not keras.ops.is_tensor(x):
            if hasattr(x, "__array__"):  # numpy: `__call__` converts it
                return False
        elif layer.autocast and keras.backend.is_float_dtype(x.dtype):
            if keras.backend.standardize_dtype(x.dtype) != layer.input_dtype:
                return False
    return True


def _scope_kept(layer):
    """Whether `Layer.__call__` would keep Keras' autocast scope as it is:
    without one, a sublayer of mixed dtypes enters its own; with one, a
    sublayer enters another unless the scope's dtype is its compute dtype."""
    if get_autocast_scope is None:
        return False
    scope = get_autocast_scope()
    if scope is None:
        return layer.compute_dtype == layer.variable_dtype
    return scope.dtype == layer.compute_dtype


def _no_autocast(layer):
    """Whether Keras' autocast scope is nothing to a layer that casts
    nothing itself (`autocast=False`, as Keras' norms): no variable of its
    own that a scope would cast."""
    # A variable's own switch has no public name (Keras 3.15: `_autocast`).
    return not any(getattr(weight, "_autocast", True) for weight in layer.weights)


# --- Keras' own calls as their torch calls (PyTorch only) --------------------


def _value(variable):
    """A weight as Keras' ops would read it (autocast, stateless scopes)."""
    return variable.value if isinstance(variable, keras.Variable) else variable


def _dense(layer, x, equation=None):
    """`Dense.call` (`EinsumDense.call` with `equation`), or `None`."""
    bias = None if layer.bias is None else _value(layer.bias)
    y = torch_eager.projection(x, _value(_kernel(layer)), bias, equation)
    if y is None or layer.activation is None:
        return y
    return layer.activation(y)


def _kernel(layer):
    """`layer.kernel`: Keras' own property returns its variable as it is
    where no LoRA adapter adds to it (a lean call has no quantized kernel),
    after about 3 us of checks on PyTorch (`_kernel`: Keras 3.15's name); a
    subclass's own property is asked."""
    if layer.lora_enabled or type(layer).kernel not in _KERAS_KERNELS:
        return layer.kernel
    return layer._kernel


def _einsum_dense(layer, x):
    return _dense(layer, x, layer.equation)


def _layer_norm(layer, x):
    """`LayerNormalization.call` over the last axis, or `None`."""
    if layer.rms_scaling or layer.axis not in ([-1], [len(x.shape) - 1]):
        return None
    if keras.backend.standardize_dtype(x.dtype) != layer.compute_dtype:
        return None  # Keras casts the output to the compute dtype
    gamma = None if layer.gamma is None else _value(layer.gamma)
    beta = None if layer.beta is None else _value(layer.beta)
    return torch_eager.layer_norm(x, gamma, beta, layer.epsilon)


def _rms_norm(layer, x):
    """`RMSNormalization.call` over the last axis, or `None`."""
    if layer.axis not in (-1, len(x.shape) - 1, [-1], [len(x.shape) - 1]):
        return None
    epsilon = keras.config.epsilon() if layer.epsilon is None else layer.epsilon
    return torch_eager.rms_norm(x, _value(layer.scale), epsilon)


_KERAS_KERNELS = (keras.layers.Dense.kernel, keras.layers.EinsumDense.kernel)
# Keras' `call` functions -> their torch calls; none but on PyTorch.
_DIRECT = {
    keras.layers.Dense.call: _dense,
    keras.layers.EinsumDense.call: _einsum_dense,
    keras.layers.LayerNormalization.call: _layer_norm,
    keras.layers.RMSNormalization.call: _rms_norm,
}
if torch_eager is None:
    _DIRECT = {}
