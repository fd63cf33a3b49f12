"""Keras' `EinsumDense` and `Dense` with int8 contractions that XLA's GPU dot
computes right.

XLA's GPU int8 x int8 dot returns garbage (an H100) or fails to compile (an
H200) when a contracted size is not a multiple of 4 (`shared/gpu/FINDINGS.md`,
section 2; Keras 3.15.1's own layers have the fault). On a GPU, on the
backends whose GPU dots XLA compiles (JAX, TensorFlow), these subclasses
zero-pad each contracted axis of the quantized inputs and kernel to a
multiple of 4 just before that dot. Zeros add nothing to an integer sum, so
every number is Keras' own. Elsewhere (CPUs, PyTorch) nothing is padded.

Only that one contraction is rewritten, where Keras makes it
(`keras_attn._keras_compat.INT8_ROUTE`): on Keras 3.15 in `_int8_call`, the
forward pass of Keras' custom gradient, whose quantizing, inputs' gradient,
LoRA, bias and activation follow Keras' code line for line; on Keras 3.16 in
the `contract` of the layer's quantization geometry, which Keras' int8 (and
int4, whose unpacked kernel is int8) strategies call, so all else is Keras'
strategy. Every other mode (float, float8, weight-only int8) is Keras' layer
untouched. Keras 3.15 refuses to quantize a subclass (`type_check`, meant for
subclasses that change `call`); these change no `call`, so they quantize as
their parents do.

A Keras with neither route is refused where padding is needed (an XLA GPU),
never silently left with its fault.
"""

import functools

import keras
from keras import ops

from keras_attn import _keras_compat
from keras_attn.ops.plan import platform_of

MULTIPLE = 4  # XLA's GPU int8 dot: contracted sizes that are multiples of 4
XLA_BACKENDS = ("jax", "tensorflow")


def padding(equation, kernel_shape, inputs):
    """`{letter: pad}` for each contracted axis of `equation` (inputs, kernel
    -> output) whose size is not a multiple of 4; empty but on an XLA GPU."""
    if keras.config.backend() not in XLA_BACKENDS or platform_of(inputs) != "gpu":
        return {}
    inputs_spec, rest = equation.split(",")
    kernel_spec, output_spec = rest.split("->")
    pads = {
        letter: -kernel_shape[axis] % MULTIPLE
        for axis, letter in enumerate(kernel_spec)
        if letter in inputs_spec and letter not in output_spec
    }
    return {letter: pad for letter, pad in pads.items() if pad}


def pad_axes(x, spec, pads):
    """`x` (axes named by `spec`, which may hold `...`) zero-padded at the end
    of each axis named in `pads`."""
    rank = len(x.shape)
    head, _, tail = spec.partition("...")
    axes = {letter: axis for axis, letter in enumerate(head)}
    axes.update({letter: rank - len(tail) + i for i, letter in enumerate(tail)})
    widths = [[0, 0] for _ in range(rank)]
    for letter, pad in pads.items():
        widths[axes[letter]][1] = pad
    return ops.pad(x, widths)


def _require_route(mode):
    """Refuses int8 on an XLA GPU with a Keras whose int8 contraction `_int8`
    cannot reach (`_keras_compat.INT8_ROUTE`)."""
    if _keras_compat.INT8_ROUTE is not None or mode not in ("int8", "int4"):
        return
    if keras.config.backend() not in XLA_BACKENDS:  # PyTorch: nothing to pad
        return
    devices = keras.distribution.list_devices()
    if any(device.lower().startswith(("gpu", "cuda")) for device in devices):
        raise NotImplementedError(
            "keras_attn pads the int8 contractions of its projections on XLA "
            "GPUs (whose int8 dot is wrong for contracted sizes that are not "
            f"multiples of 4), and Keras {keras.version()} makes them where it "
            f"cannot reach. Received: mode={mode!r}. Use Keras 3.15 or 3.16, "
            "or another quantization mode."
        )


@functools.cache
def _padded_geometry(geometry_class):
    """Keras 3.16's projection geometry `geometry_class`, its int8 x int8
    contractions padded on XLA GPUs."""

    class PaddedGeometry(geometry_class):
        def contract(self, inputs, kernel):
            dtypes = {
                keras.backend.standardize_dtype(x.dtype) for x in (inputs, kernel)
            }
            pads = {}
            if dtypes == {"int8"}:  # int8 x int8: an int8 dot
                pads = padding(self.layer.contraction, kernel.shape, inputs)
            if pads:
                inputs_spec, rest = self.layer.contraction.split(",")
                inputs = pad_axes(inputs, inputs_spec, pads)
                kernel = pad_axes(kernel, rest.split("->")[0], pads)
            return super().contract(inputs, kernel)

    return PaddedGeometry


class PaddedInt8:
    """The int8 call of a Keras `EinsumDense` or `Dense` subclass, its int8
    contraction padded on XLA backends; everything else is the parent's."""

    def quantize(self, mode=None, type_check=True, **kwargs):
        _require_route(mode)
        super().quantize(mode, type_check=False, **kwargs)

    def build(self, input_shape):  # built quantized: a loaded model
        _require_route(self.quantization_mode)
        super().build(input_shape)

    def _quantization_geometry(self):  # Keras 3.16's route
        geometry = super()._quantization_geometry()
        return _padded_geometry(type(geometry))(self)

    def _int8_call(self, inputs, training=None):  # Keras 3.15's route
        pads = padding(self.contraction, self._kernel.shape, inputs)
        route = pads and _keras_compat.INT8_ROUTE == "int8_call"
        if not (route and self.inputs_quantizer):  # weight-only: no int8 dot
            return super()._int8_call(inputs, training)
        x = self.padded_int8_contraction(pads)(
            inputs,
            ops.convert_to_tensor(self._kernel),
            ops.convert_to_tensor(self.kernel_scale),
        )
        if self.lora_enabled:  # Keras' tail: LoRA, bias, activation
            lora_x = self.contract(inputs, self.lora_kernel_a)
            lora_x = ops.matmul(lora_x, self.lora_kernel_b)
            x = ops.add(x, (self.lora_alpha / self.lora_rank) * lora_x)
            x = ops.cast(x, dtype=self.compute_dtype)
        if self.bias is not None:
            x = ops.add(x, self.bias)
        if self.activation is not None:
            x = self.activation(x)
        return x


@keras.saving.register_keras_serializable(package="keras_attn")
class EinsumDense(PaddedInt8, keras.layers.EinsumDense):
    """`keras.layers.EinsumDense`, its int8 contraction padded for XLA."""

    @property
    def contraction(self):
        return self.equation

    def contract(self, x, kernel):
        return ops.einsum(self.equation, x, kernel)

    def padded_int8_contraction(self, pads):
        """Keras' int8 forward with a custom inputs' gradient, padded."""
        inputs_spec, rest = self.equation.split(",")
        kernel_spec = rest.split("->")[0]

        @ops.custom_gradient
        def einsum_with_inputs_gradient(inputs, kernel, kernel_scale):
            def grad_fn(*args, upstream=None):
                upstream = args[0] if upstream is None else upstream
                scale = self._adjust_scale_for_dequant(kernel_scale)
                float_kernel = ops.divide(ops.cast(kernel, self.compute_dtype), scale)
                gradient = ops.einsum(
                    self._custom_gradient_equation, upstream, float_kernel
                )
                return (gradient, None, None)

            inputs, inputs_scale = self.inputs_quantizer(
                inputs, axis=self.quantization_axis
            )
            inputs_scale = self._adjust_scale_for_quant(inputs_scale, "input")
            x = self.contract(
                pad_axes(inputs, inputs_spec, pads), pad_axes(kernel, kernel_spec, pads)
            )
            x = ops.cast(x, self.compute_dtype)
            return ops.divide(x, ops.multiply(inputs_scale, kernel_scale)), grad_fn

        return einsum_with_inputs_gradient


@keras.saving.register_keras_serializable(package="keras_attn")
class Dense(PaddedInt8, keras.layers.Dense):
    """`keras.layers.Dense`, its int8 contraction padded for XLA."""

    contraction = "...a,ab->...b"

    def contract(self, x, kernel):
        return ops.matmul(x, kernel)

    def padded_int8_contraction(self, pads):
        """Keras' int8 forward with a custom inputs' gradient, padded."""

        @ops.custom_gradient
        def matmul_with_inputs_gradient(inputs, kernel, kernel_scale):
            def grad_fn(*args, upstream=None):
                upstream = args[0] if upstream is None else upstream
                float_kernel = ops.divide(
                    ops.cast(kernel, self.compute_dtype), kernel_scale
                )
                return (ops.matmul(upstream, ops.transpose(float_kernel)), None, None)

            inputs, inputs_scale = self.inputs_quantizer(inputs, axis=-1)
            x = self.contract(
                pad_axes(inputs, "...a", pads), pad_axes(kernel, "ab", pads)
            )
            x = ops.cast(x, self.compute_dtype)
            return ops.divide(x, ops.multiply(kernel_scale, inputs_scale)), grad_fn

        return matmul_with_inputs_gradient
