"""The decoding step compiled on PyTorch: `torch.export`, then TorchInductor
(`compile_step`) or a CUDA graph of the exported step (`capture_step`).

The one place `generate` imports a backend module: Keras has no public way to
compile a function on PyTorch but `Model.compile(jit_compile=True)`, whose
`torch.compile` of Keras' layer machinery breaks the step into 26 graphs (31
graph breaks) and runs slower than eager. `torch.export(strict=False)` runs
the step's Python once and keeps only the tensor operations: one graph, with
the layers' weights as parameters (the same tensors, so later weight updates
are seen). Inductor then compiles it: to C++ on a CPU, to Triton kernels
replayed as a CUDA graph on a GPU. Or, on a GPU, the exported step is
captured as it is into one `torch.cuda.CUDAGraph`, with no Inductor compile:
the export takes seconds, and each step after it is one graph launch. The
step takes and returns a flat tuple of tensors, so a call checks no nested
structure.

As in gpt-fast and Hugging Face's static cache, the key/value caches are
written in place (`keras_attn.cache`): a step copies one position per layer
and returns only what changed (the tokens, logits, index, ...), never a
cache. `benchmarks/generation.py` measures it.
"""

import torch
from torch.utils import _pytree as pytree

no_grad = torch.no_grad


class _FlatStep(torch.nn.Module):
    """`function(state, numbers) -> state` on flat tuples of tensors; the
    state keeps its structure.

    It returns only the leaves of the state that changed: a leaf the step
    hands back as the very tensor it was given (a cache written in place, the
    padding, cross-attention caches) is kept (`_Kept`) and not returned, so
    it is neither copied out of the graph nor replaced."""

    def __init__(self, function, layers, state, numbers, report):
        super().__init__()
        self.function, self.report = function, report
        self.spec = pytree.tree_structure((state, numbers))
        self.state_spec = pytree.tree_structure(state)
        self.decoding_layers = torch.nn.ModuleList(layers)  # their parameters

    def forward(self, *flat):
        state = self.function(*pytree.tree_unflatten(flat, self.spec))
        leaves, spec = pytree.tree_flatten(state)
        if spec != self.state_spec:
            raise ValueError(f"The step changed the state's structure to {spec}.")
        given = flat[: len(leaves)]  # the state's leaves, then the numbers'
        kept = tuple(out is g for out, g in zip(leaves, given, strict=True))
        self.report(kept)  # a callback: export restores the module's attributes
        return tuple(leaf for leaf, k in zip(leaves, kept, strict=True) if not k)


class _Kept:
    """Which state leaves the traced step keeps, and the state after a step."""

    def __init__(self, state):
        self.state_spec = pytree.tree_structure(state)
        self.kept = None

    def found(self, kept):
        self.kept = kept

    def state(self, given, returned):
        """The new state: the kept leaves of `given` (the step's inputs), the
        others from `returned` (in order)."""
        returned, given = iter(returned), given[: len(self.kept)]
        leaves = [
            g if kept else next(returned)
            for g, kept in zip(given, self.kept, strict=True)
        ]
        return pytree.tree_unflatten(leaves, self.state_spec)


def inductor_options(device):
    """Inductor's options for the step on `device`.

    On a GPU a step is bound by kernel launches, not by the GPU: CUDA graphs
    (what `mode="reduce-overhead"` turns on) replay the step's kernels as one
    launch. The step's shapes are fixed for a `generate` shape, so one graph
    is recorded per shape. On a CPU, the C++ wrapper calls the kernels
    without Python in between.
    """
    if device.type == "cuda":
        return {"triton.cudagraphs": True}
    return {"cpp_wrapper": True}


def replays_cuda_graphs(device):
    """Whether the compiled step replays as a CUDA graph on `device`."""
    return device.type == "cuda"


def device_type(state):
    """`"cuda"`, `"cpu"`, ...: where the state's tensors are."""
    return pytree.tree_leaves(state)[0].device.type


def compile_step(function, layers, state, numbers):
    """`function(state, numbers) -> state`, exported for these shapes and
    compiled; `layers` hold the weights it reads.

    Two rules of CUDA graphs (torch's CUDA graph trees), held on a CPU by
    `tests/helpers/doubles.py`:

    - A replay writes its outputs into the memory of the previous replay's
      outputs (torch: "accessing tensor output of CUDAGraphs that has been
      overwritten by a subsequent run"; `../shared/gpu/FINDINGS.md`, section
      1), and each step's outputs are the next step's inputs: they are
      copied out after each replay (the small leaves only: caches are kept).
    - A graph replays only if every input it writes in place is static, at
      one address for good (torch's `check_for_mutation`: otherwise
      "skipping cudagraphs due to mutated inputs"); other inputs are copied
      into the graph's own memory at every replay. So the kept leaves live
      in `_StaticLeaves`, marked static.
    """
    kept, exported, leaves = _export(function, layers, state, numbers)
    device = leaves[0].device
    static = _StaticLeaves(leaves, kept.kept) if replays_cuda_graphs(device) else None
    compiled = torch.compile(exported, dynamic=False, options=inductor_options(device))

    def step(state, numbers):
        leaves = _contiguous(pytree.tree_leaves((state, numbers)))
        if static is not None:  # the last outputs are these inputs, no more
            leaves = static.place(leaves)
            torch.compiler.cudagraph_mark_step_begin()
        with torch.no_grad():
            returned = compiled(*leaves)
            if static is not None:
                returned = tuple(leaf.clone() for leaf in returned)
        return kept.state(leaves, returned)

    return step


def capture_step(function, layers, state, numbers):
    """`function(state, numbers) -> state`, exported for these shapes and
    captured as one CUDA graph (`torch.cuda.CUDAGraph`): no Inductor
    compile, a replay a step.

    The rules of a captured graph, held on a CPU by `tests/helpers/doubles.py`
    (`CudaGraphCapture`), from PyTorch's "CUDA Graphs" notes and NVIDIA's
    checklist (docs.nvidia.com/dl-cuda-graph, "Quick Checklist"):

    - No host-device synchronization while capturing (`.item()`, a read back
      to the host) and no tensor made on the device from Python data: the
      exported step has neither (its constants are made once, at export).
    - A replay reads and writes the memory it was captured with: every input
      has a buffer of its own (`_CapturedGraph.inputs`), into which each
      step's leaves are copied unless they are those buffers already (the
      caches, written in place, stay there for good).
    - A replay writes its outputs into the memory of the previous replay's:
      they are the next step's inputs, copied into the input buffers before
      the next replay; `generate` copies its results off them.
    """
    kept, exported, leaves = _export(function, layers, state, numbers)
    graph = _CapturedGraph(exported, leaves)

    def step(state, numbers):
        leaves = _contiguous(pytree.tree_leaves((state, numbers)))
        return kept.state(graph.inputs, graph(leaves))

    return step


def _export(function, layers, state, numbers):
    """`(kept, exported module, leaves)`: the step exported for the shapes of
    `(state, numbers)`, whose contiguous leaves it takes."""
    kept = _Kept(state)
    module = _FlatStep(function, layers, state, numbers, kept.found)
    leaves = _contiguous(pytree.tree_leaves((state, numbers)))
    with torch.no_grad():
        exported = torch.export.export(module, tuple(leaves), strict=False)
    return kept, exported.module(), leaves


class _CapturedGraph:
    """An exported step captured once as a CUDA graph, replayed per call.

    Captured as PyTorch's notes on whole-network capture do it: a few
    warm-up calls on a side stream (the step writes the same values again
    at the same index), then the capture (`capture`), whose kernels do not
    run; each call then copies its leaves into the captured inputs and
    replays.
    """

    def __init__(self, module, leaves, warmups=2):
        self.inputs = [leaf.clone() for leaf in leaves]  # at fixed addresses
        self.graph, self.outputs = capture(module, self.inputs, warmups)

    def __call__(self, leaves):
        for buffer, leaf in zip(self.inputs, leaves, strict=True):
            if leaf is not buffer:
                buffer.copy_(leaf)
        self.graph.replay()
        return self.outputs


def capture(module, inputs, warmups):
    """`(graph, outputs)`: `module(*inputs)` captured as a
    `torch.cuda.CUDAGraph` after `warmups` calls on a side stream."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(stream):
        for _ in range(warmups):
            module(*inputs)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        outputs = module(*inputs)
    return graph, outputs


def _contiguous(leaves):
    """The leaves in contiguous memory (each one that is already, itself).

    Dynamo guards a compiled function on its inputs' strides: the first step
    reads the prefill's last logits as a view of all its logits (strides of
    `(prompt, vocabulary)` rows), the next ones a step's own, and that
    recompiled the step at its second call (a second compile as long as the
    first)."""
    return [leaf.contiguous() for leaf in leaves]


class _StaticLeaves:
    """The kept state leaves at fixed addresses: buffers of their own, marked
    static (`torch._dynamo.mark_static_address`, as Hugging Face's static
    cache does), into which each call's leaves are copied at its first step;
    after that, the step hands the same tensors back. A cache per kept leaf
    stays allocated while the compiled step is kept (with the model)."""

    def __init__(self, leaves, kept):
        self.tensors = {i: leaves[i].clone() for i, k in enumerate(kept) if k}
        for tensor in self.tensors.values():
            torch._dynamo.mark_static_address(tensor)

    def place(self, leaves):
        leaves = list(leaves)
        for i, tensor in self.tensors.items():
            if leaves[i] is not tensor:
                if leaves[i].shape != tensor.shape or leaves[i].dtype != tensor.dtype:
                    raise ValueError(  # `generate` keys its steps by every shape
                        f"The compiled step was recorded for {tensor.dtype} "
                        f"{tuple(tensor.shape)} at state leaf {i}; received "
                        f"{leaves[i].dtype} {tuple(leaves[i].shape)}."
                    )
                leaves[i] = tensor.copy_(leaves[i])
        return leaves
