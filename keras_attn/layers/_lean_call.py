"""Calling a built Keras sublayer from inside its parent's `call`, without
the cost of `Layer.__call__` where that costs nothing but time.

On PyTorch's eager steps Python bounds a block, and `Layer.__call__` (nine
calls a block) is about half of a small block's forward
(`benchmarks/results/torch_overhead.md`). Inside a parent's `call`, for a
built sublayer, most of its work is already done or does nothing: the
parent's call context holds `training`, the inputs are checked and of the
compute dtype, the outputs' Keras masks are never read. `call_sublayer`
runs the sublayer's `call` directly where `__call__` would do nothing else,
and `__call__` otherwise:

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

Which to use: a layer's `call` calls its sublayers through `call_sublayer`
(whose test is `lean`); a decoding step through its decoding's
`SublayerCalls`, which binds each sublayer's call once, from the same rules.

On PyTorch a lean call of Keras' own `Dense`, `EinsumDense`,
`LayerNormalization` (over the last axis) or `RMSNormalization` goes one
step further: the torch calls its `call` makes, without `keras.ops`'
dispatch around each (`keras_attn._torch_eager`, which says for
which dtypes; Keras' `call` elsewhere). The kernel comes from the layer's
own `kernel` property, LoRA included.
"""

import keras

from keras_attn._keras_compat import get_autocast_scope
from keras_attn.ops.dtypes import dtype_name

if keras.config.backend() == "torch":
    from keras_attn import _torch_eager as torch_eager
else:
    torch_eager = None


def call_sublayer(layer, inputs, *args, **kwargs):
    """`layer(inputs, *args, **kwargs)`, through `layer.call` where that is
    the same (the module docstring says when)."""
    if not lean(layer, inputs, *args, *kwargs.values()):
        return layer(inputs, *args, **kwargs)
    outputs = None if args or kwargs else _direct(layer, inputs)
    return layer.call(inputs, *args, **kwargs) if outputs is None else outputs


def _direct(layer, inputs):
    """The torch calls of a lean layer's Keras `call`, or `None` (another
    layer, or a case Keras' `call` keeps)."""
    call = _torch_call(layer)
    return None if call is None else call(inputs)


def _torch_call(layer):
    """The torch calls of `layer`'s Keras `call`, bound as a function of its
    input (which returns `None` where Keras' `call` must run), or `None`:
    not one of Keras' own layers `_BINDERS` knows, or not on PyTorch."""
    binder = _BINDERS.get(type(layer).call)
    return None if binder is None else binder(layer)


def lean(layer, inputs, *arguments):
    """Whether `layer.call(inputs, *arguments)` computes what
    `layer(inputs, *arguments)` computes, from inside a parent's `call`
    (the arguments flat: tensors, Python values or `None`)."""
    return (
        keras.ops.is_tensor(inputs)
        and _arguments_kept(layer, (inputs, *arguments))
        and _state_kept(layer)
    )


def _state_kept(layer):
    """Whether `Layer.__call__` would add nothing to `layer.call` whatever
    tensors of its compute dtype it is given: see the module docstring."""
    return (
        layer.built
        and layer.quantization_mode is None
        and layer.activity_regularizer is None
        and getattr(layer, "_remat_mode", True) is None  # Keras' RematScope
        and keras.distribution.distribution() is None
        and _scope_kept(layer)
    )


class SublayerCalls:
    """What one decoding (a `generate` call) binds once for all its steps:
    its sublayers' calls, each bound at its first use, and constants
    (`once`).

    `calls(layer, x)` is `layer(x)` for `x`, a tensor of the layer's compute
    dtype made by the decoding itself (no array to convert, no Keras mask
    riding on it).

    What `Layer.__call__` and the lean path decide per call (is the layer
    quantized, under a distribution, of mixed dtypes; which torch call its
    Keras `call` makes, on which weight tensors) is decided at the first
    step, for every step after it: the decoding's steps change no layer.
    The weights are the variables' own tensors, so a later update of their
    values is read; a layer quantized or given LoRA after this decoding
    began is not, and the next `generate` call binds anew.
    """

    def __init__(self):
        self._bound, self._constants = {}, {}

    def __call__(self, layer, x):
        function = self._bound.get(id(layer))
        if function is None:
            function = self._bound[id(layer)] = _bind(layer)
        return function(x)

    def once(self, key, make):
        """`make()`, made at the first call with `key` in this decoding (e.g.
        a position table, which no step changes)."""
        if key not in self._constants:
            self._constants[key] = make()
        return self._constants[key]


def _bind(layer):
    """`layer`'s call on one tensor, as a function: its Keras `call` (on
    PyTorch, Keras' own layers as their torch calls) where `__call__` would
    add nothing, else `__call__`, its output copied: a fresh tensor carries
    no Keras mask (an `Embedding(mask_zero=True)` sets one on its output,
    and a `Softmax` would apply it across the vocabulary; a decoding step
    passes its masks explicitly)."""
    if not _state_kept(layer):
        return lambda x: keras.ops.copy(layer(x))
    direct = _torch_call(layer)
    if direct is None:
        return layer.call

    def call(x):
        y = direct(x)
        return layer.call(x) if y is None else y

    return call


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
            if dtype_name(x.dtype) != layer.input_dtype:
                return False
    return True


def _scope_kept(layer):
    """Whether `Layer.__call__` would keep Keras' autocast scope as it is
    (Keras 3.15, `Layer.__call__`'s step 7), or change nothing `call`
    reads: without a scope, a layer of mixed dtypes enters its own; with
    one, a layer that does not autocast (or computes in no float) clears it,
    which matters only where a variable of its own would be cast, and
    another enters its own unless the scope's dtype is its compute dtype."""
    if get_autocast_scope is None:
        return False
    scope = get_autocast_scope()
    if scope is None:
        return layer.compute_dtype == layer.variable_dtype
    if not layer.autocast or not keras.backend.is_float_dtype(layer.compute_dtype):
        return _no_autocast(layer)
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


def _bind_dense(layer, equation=None):
    """`Dense.call` (`EinsumDense.call` with `equation`) as a function of
    its input, returning `None` where Keras' own call must run."""
    bias = None if layer.bias is None else _value(layer.bias)
    if _plain_kernel(layer):
        project = torch_eager.bound_projection(_value(layer._kernel), bias, equation)
        if project is None:
            return None
    else:  # the layer's own `kernel` property, asked at each call

        def project(x):
            return torch_eager.projection(x, layer.kernel, bias, equation)

    activation = layer.activation
    if activation is None or activation is keras.activations.linear:
        return project

    def call(x):
        y = project(x)
        return y if y is None else activation(y)

    return call


def _plain_kernel(layer):
    """Whether the layer's kernel is its variable `_kernel` (Keras 3.15's
    name) as it is: Keras' own property returns it so without LoRA (after
    checks that a decoding need not repeat), adds the adapters with it; a
    subclass's own property is asked."""
    return (
        type(layer).kernel in _KERAS_KERNELS
        and not layer.lora_enabled
        and hasattr(layer, "_kernel")
    )


def _bind_einsum_dense(layer):
    return _bind_dense(layer, layer.equation)


def _bind_layer_norm(layer):
    """`LayerNormalization.call` over the last axis (`None`: Keras' call)."""
    if layer.rms_scaling:
        return None
    gamma = None if layer.gamma is None else _value(layer.gamma)
    beta = None if layer.beta is None else _value(layer.beta)
    dtype = layer.compute_dtype

    def call(x):
        if layer.axis not in ([-1], [x.dim() - 1]):
            return None
        if dtype_name(x.dtype) != dtype:
            return None  # Keras casts the output to the compute dtype
        return torch_eager.layer_norm(x, gamma, beta, layer.epsilon)

    return call


def _bind_rms_norm(layer):
    """`RMSNormalization.call` over the last axis (`None`: Keras' call)."""
    epsilon = keras.config.epsilon() if layer.epsilon is None else layer.epsilon
    scale = _value(layer.scale)

    def call(x):
        if layer.axis not in (-1, x.dim() - 1, [-1], [x.dim() - 1]):
            return None
        return torch_eager.rms_norm(x, scale, epsilon)

    return call


def _bind_embedding(layer):
    """`Embedding.call` of a table without LoRA (`None`: Keras' call)."""
    if layer.lora_enabled or type(layer).embeddings is not _KERAS_TABLE:
        return None
    table, dtype = _value(layer._embeddings), layer.compute_dtype
    return lambda ids: torch_eager.embedding(ids, table, dtype)


def activate(function, x):
    """`function(x)` for an activation (`keras.activations.get`'s): on
    PyTorch, Keras' own `relu`, `silu`, `gelu` and `tanh` as the torch call
    their backend makes (Keras 3.15, `keras/src/backend/torch/nn.py`: each
    converts its input, then calls it), without `keras.ops`' dispatch."""
    direct = _ACTIVATIONS.get(function)
    return function(x) if direct is None else direct(x)


_KERAS_TABLE = keras.layers.Embedding.embeddings
_KERAS_KERNELS = (keras.layers.Dense.kernel, keras.layers.EinsumDense.kernel)
# Keras' `call` functions -> binders of their torch calls; none but on PyTorch.
_BINDERS = {
    keras.layers.Dense.call: _bind_dense,
    keras.layers.EinsumDense.call: _bind_einsum_dense,
    keras.layers.Embedding.call: _bind_embedding,
    keras.layers.LayerNormalization.call: _bind_layer_norm,
    keras.layers.RMSNormalization.call: _bind_rms_norm,
}
# Keras' activations with their defaults -> the torch call they make.
_ACTIVATIONS = {}
if torch_eager is None:
    _BINDERS = {}
else:
    from torch.nn import functional

    _ACTIVATIONS = {
        keras.activations.relu: functional.relu,
        keras.activations.silu: functional.silu,
        keras.activations.gelu: functional.gelu,  # Keras' default: exact
        keras.activations.tanh: functional.tanh,
    }
