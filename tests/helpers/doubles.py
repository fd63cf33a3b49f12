"""Test doubles that hold our code, on a CPU, to an accelerator's documented
rules: what a GPU would refuse or do differently, made to happen here. Each
names its rule and the rule's source; the fixtures in tests/conftest.py
install them."""

import math
import re

import keras

from keras_attn.ops import attention as attention_module


def hold_sdpa_to_cuda(monkeypatch):
    """torch's `scaled_dot_product_attention` held to what it accepts on CUDA,
    with the plan told that the tensors are on a GPU. Records each call.

    The rules, with their sources:
    - "An error is thrown if both attn_mask and is_causal are set" (torch's
      documentation of `scaled_dot_product_attention`). A CPU accepts both; a
      GPU raised (`../shared/gpu/FINDINGS.md`, section 1).
    - `enable_gqa` runs fused on CUDA only in half precision: the flash and
      cuDNN kernels take float16 and bfloat16 only, the memory-efficient one
      takes no `enable_gqa` (torch's `sdp_utils.cpp`); float32 with it falls
      to the composite kernel, which materializes the logits (FINDINGS.md,
      section 1: kernel 0 on an H100).
    """
    import torch
    from torch.nn import functional

    original = functional.scaled_dot_product_attention
    calls = []

    def on_cuda(query, key, value, attn_mask=None, is_causal=False, **kwargs):
        if attn_mask is not None and is_causal:
            raise RuntimeError(
                "Explicit attn_mask should not be set when is_causal=True"
            )
        half = query.dtype in (torch.float16, torch.bfloat16)
        if kwargs.get("enable_gqa") and not half:
            raise RuntimeError(
                f"enable_gqa in {query.dtype}: no fused CUDA kernel, the "
                "composite one would materialize the logits"
            )
        calls.append({"key": tuple(key.shape), "is_causal": is_causal, **kwargs})
        return original(
            query, key, value, attn_mask=attn_mask, is_causal=is_causal, **kwargs
        )

    monkeypatch.setattr(functional, "scaled_dot_product_attention", on_cuda)
    monkeypatch.setattr(attention_module, "platform_of", lambda tensor: "gpu")
    return calls


class CudaGraphReplays:
    """A compiled function that replays like a CUDA graph: every replay
    writes its outputs into the same memory, so the previous replay's outputs
    are overwritten (here: NaN, -1 or True) before the next replay runs, even
    where they are its inputs.

    The rule: torch's CUDA graph trees ("accessing tensor output of CUDAGraphs
    that has been overwritten by a subsequent run"; torch's documentation of
    `mode="reduce-overhead"`: clone outputs that must outlive the next call).
    It crashed `generate(jit_compile=True)` on CUDA (FINDINGS.md, section 1).

    A second rule: a graph replays only if the inputs it writes in place are
    static inputs (parameters, buffers, or tensors marked by
    `torch._dynamo.mark_static_address`), at the address they had when it
    was recorded (torch's `check_for_mutation` in
    `torch/_inductor/cudagraph_utils.py`; otherwise "skipping cudagraphs due
    to mutated inputs", and the step runs without a graph). Here an input
    written in place unmarked, or at another address, raises.
    """

    def __init__(self, function):
        self.function, self.outputs, self.replays = function, None, 0
        self.written = None  # {input position: its address}, from the recording

    def __call__(self, *inputs):
        if self.outputs is not None:
            for output in self.outputs:
                output.fill_(_garbage(output))
        versions = [x._version for x in inputs]
        results = self.function(*inputs)
        self._check_static(inputs, versions)
        if self.outputs is None:
            self.outputs = tuple(result.clone() for result in results)
        else:
            for output, result in zip(self.outputs, results, strict=True):
                output.copy_(result)
        self.replays += 1
        return self.outputs

    def _check_static(self, inputs, versions):
        written = {
            i: x.data_ptr()
            for i, (x, version) in enumerate(zip(inputs, versions, strict=True))
            if x._version != version
        }
        if self.written is None:
            self.written = written
        moved = [i for i in written if self.written.get(i) != written[i]]
        moved += [  # static: marked by `torch._dynamo.mark_static_address`
            i for i in written if not hasattr(inputs[i], "_dynamo_static_input_type")
        ]
        if moved:
            raise AssertionError(
                f"skipping cudagraphs due to mutated inputs: inputs {moved} were "
                "written in place away from their recorded addresses."
            )


def _garbage(tensor):
    if tensor.dtype.is_floating_point:
        return math.nan
    return True if str(tensor.dtype) == "torch.bool" else -1


def hold_compiled_steps_to_cuda_graphs(monkeypatch):
    """`generate`'s compiled torch steps replay as `CudaGraphReplays` (the
    exported step itself, without Inductor); returns the replays made."""
    from keras_attn.generation import _torch as torch_generation

    replays = []

    def compile_(module, **options):
        replays.append(CudaGraphReplays(module))
        return replays[-1]

    monkeypatch.setattr(torch_generation.torch, "compile", compile_)
    monkeypatch.setattr(torch_generation, "replays_cuda_graphs", lambda device: True)
    compile_with_inductor(monkeypatch)
    return replays


def compile_with_inductor(monkeypatch):
    """`jit_compile` compiles `generate`'s PyTorch steps with Inductor on any
    device: on a real GPU `"auto"` would capture CUDA graphs instead
    (`loop._form`), and the Inductor path these doubles hold would go
    untested (an H100 run, 2026-11-28: no compile seen)."""
    from keras_attn.generation import loop

    monkeypatch.setattr(loop, "_form", lambda state: "inductor")


# Ops a CUDA graph cannot capture (NVIDIA's "CUDA Graphs" guide, "Quick
# Checklist", docs.nvidia.com/dl-cuda-graph; PyTorch's notes on CUDA Graphs,
# "Constraints"): a read back to the host (`.item()`, a Python bool of a
# tensor), a tensor made on the device from Python data (`torch.tensor`,
# `as_tensor`: `lift_fresh`, a copy from host memory; an exported graph's
# constants were made on the device at export, and its `lift_fresh_copy` of
# them is a copy on the device), and an output whose shape depends on the
# data (which the host must read).
UNCAPTURABLE = (
    "aten::_local_scalar_dense",
    "aten::lift_fresh",
    "aten::nonzero",
    "aten::masked_select",
    "aten::unique_consecutive",
    "aten::_unique2",
)


class CudaGraphCapture:
    """`torch.cuda.CUDAGraph` capture and replay, as a CPU can hold them.

    The rules: a captured call may do nothing of `UNCAPTURABLE` (it raises
    here, as CUDA's stream capture does); the capture runs no kernel, so the
    captured call writes nothing and its outputs hold garbage until the
    first replay (here: its inputs are restored and its outputs NaN, -1 or
    True); a replay reads and writes the very tensors it was captured with
    and writes its outputs into the same memory (the previous replay's
    outputs overwritten).
    """

    def __init__(self):
        self.graphs = []

    def __call__(self, module, inputs, warmups):
        for _ in range(warmups):  # they run, uncaptured: anything goes
            module(*inputs)
        before = [x.clone() for x in inputs]
        with _Capturing():
            outputs = module(*inputs)
        for x, saved in zip(inputs, before, strict=True):
            x.copy_(saved)  # the capture ran no kernel
        graph = _ReplayedGraph(module, inputs, outputs)
        self.graphs.append(graph)
        return graph, outputs


class _ReplayedGraph:
    def __init__(self, module, inputs, outputs):
        self.module, self.inputs, self.outputs = module, inputs, outputs
        self.replays = 0
        for output in outputs:
            output.fill_(_garbage(output))

    def replay(self):
        for output in self.outputs:
            output.fill_(_garbage(output))
        with _Capturing():
            results = self.module(*self.inputs)
        for output, result in zip(self.outputs, results, strict=True):
            output.copy_(result)
        self.replays += 1


def _Capturing():  # noqa: N802 (the dispatch mode, made where torch is)
    """A dispatch mode that raises on what CUDA's stream capture refuses
    (`UNCAPTURABLE`)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Capturing(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func._schema.name
            if name in UNCAPTURABLE:
                raise RuntimeError(
                    f"operation not permitted when stream is capturing: {name} "
                    "(a CUDA graph captures no read back to the host, tensor "
                    "made from Python data, or shape that depends on data)"
                )
            return func(*args, **(kwargs or {}))

    return Capturing()


def hold_capture_to_cuda_graphs(monkeypatch):
    """`generate`'s PyTorch steps told they are on a GPU (`"auto"` then
    captures them as CUDA graphs), the capture being `CudaGraphCapture`;
    returns it."""
    from keras_attn.generation import _torch as torch_generation

    capture = CudaGraphCapture()
    monkeypatch.setattr(torch_generation, "capture", capture)
    monkeypatch.setattr(torch_generation, "device_type", lambda state: "cuda")
    return capture


def hold_int8_to_xla_gpu(monkeypatch):
    """keras_attn's int8 layers told that they run on a GPU, where XLA's int8
    dot needs contracted sizes that are multiples of 4 (the rule:
    `int8_contractions`), so that they pad on a CPU as they would there."""
    from keras_attn.layers import _int8

    monkeypatch.setattr(_int8, "platform_of", lambda tensor: "gpu")


def int8_contractions(function, *args):
    """The contracted sizes, one tuple per dot, of every int8 x int8
    `dot_general` that JAX traces for `function(*args)`, nested calls
    (custom gradients, jitted functions) included.

    The rule it serves: XLA's GPU int8 dot gives garbage (an H100) or fails
    to compile (an H200) when a contracted size is not a multiple of 4
    (`../shared/gpu/FINDINGS.md`, section 2; Keras' own int8 `EinsumDense`
    has the fault). A CPU computes these dots right, so only the shapes that
    reach the dot can show the fault here.
    """
    import jax

    return list(_int8_dots(jax.make_jaxpr(function)(*args).jaxpr))


def _int8_dots(jaxpr):
    for equation in equations(jaxpr):
        if equation.primitive.name == "dot_general":
            left, right = (variable.aval for variable in equation.invars)
            if str(left.dtype) == str(right.dtype) == "int8":
                (contracted, _), _ = equation.params["dimension_numbers"]
                yield tuple(left.shape[axis] for axis in contracted)


def equations(jaxpr):
    """Every equation of a jaxpr, those of nested jaxprs (loops, custom
    gradients, jitted calls) included."""
    for equation in jaxpr.eqns:
        yield equation
        for value in equation.params.values():
            for inner in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(inner, "jaxpr", inner)  # a ClosedJaxpr's
                if hasattr(inner, "eqns"):
                    yield from equations(inner)


def largest_array(function, *args):
    """The most elements of any array JAX traces for `function(*args)`,
    nested jaxprs included: what the program asks memory for, before XLA
    fuses anything away."""
    import jax

    jaxpr = jax.make_jaxpr(function)(*args).jaxpr
    sizes = [
        math.prod(variable.aval.shape)
        for equation in equations(jaxpr)
        for variable in equation.outvars
        if hasattr(variable.aval, "shape")
    ]
    return max(sizes)


def largest_xla_array(traced, *args):
    """The most elements of any array in the XLA program TensorFlow compiles
    for `traced(*args)` (a `tf.function(jit_compile=True)`): its optimized
    HLO text writes each array's shape, e.g. `f32[1,2,32,256]`."""
    hlo = traced.experimental_get_compiler_ir(*args)(stage="optimized_hlo")
    shapes = re.findall(r"\b(?:f32|pred|s32)\[([\d,]+)\]", hlo)
    return max(math.prod(int(n) for n in shape.split(",")) for shape in shapes)


def recorded(monkeypatch, owner, name, note, calls=None):
    """`owner.name` spied: each call first appends `note(*args, **kwargs)`
    to `calls` (a new list by default), which is returned, then runs as it
    would (so a call that raises is recorded too)."""
    calls = [] if calls is None else calls
    original = getattr(owner, name)

    def spy(*args, **kwargs):
        calls.append(note(*args, **kwargs))
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, spy)
    return calls


def count_key_widths(monkeypatch):
    """The products that make logits, spied: the key lengths of each
    chunk's logits as traced (once per loop on JAX and TensorFlow, once per
    chunk on PyTorch). `explicit.scores`, and on PyTorch also
    `torch_logits.masked_logits`, which adds the masks in the product."""
    from keras_attn.ops.kernels import explicit

    def width(query, key, options):
        return key.shape[2 if options.heads_major else 1]

    widths = recorded(monkeypatch, explicit, "scores", width)
    if keras.config.backend() == "torch":
        from keras_attn.ops.kernels import torch_logits

        def key_length(query, key, added, heads_major):
            return key.shape[2 if heads_major else 1]

        recorded(monkeypatch, torch_logits, "masked_logits", key_length, widths)
    return widths
