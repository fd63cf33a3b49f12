"""The decoding step compiled on PyTorch: `torch.export`, then TorchInductor.

The one place `generate` imports a backend module: Keras has no public way to
compile a function on PyTorch but `Model.compile(jit_compile=True)`, whose
`torch.compile` of Keras' layer machinery breaks the step into 26 graphs (31
graph breaks) and runs slower than eager. `torch.export(strict=False)` runs
the step's Python once and keeps only the tensor operations: one graph, with
the layers' weights as parameters (the same tensors, so later weight updates
are seen). Inductor then compiles it: to C++ on a CPU, to Triton kernels
replayed as a CUDA graph on a GPU. The step takes and returns a flat tuple of
tensors, so a call checks no nested structure.
`benchmarks/generation.py` measures it.
"""

import torch
from torch.utils import _pytree as pytree

no_grad = torch.no_grad


class _FlatStep(torch.nn.Module):
    """`function(state, numbers) -> state` on flat tuples of tensors; the
    state keeps its structure."""

    def __init__(self, function, layers, state, numbers):
        super().__init__()
        self.function = function
        self.spec = pytree.tree_structure((state, numbers))
        self.state_spec = pytree.tree_structure(state)
        self.decoding_layers = torch.nn.ModuleList(layers)  # their parameters

    def forward(self, *flat):
        state = self.function(*pytree.tree_unflatten(flat, self.spec))
        leaves, spec = pytree.tree_flatten(state)
        if spec != self.state_spec:
            raise ValueError(f"The step changed the state's structure to {spec}.")
        return tuple(leaves)


def inductor_options(device):
    """Inductor's options for the step on `device`.

    On a GPU a step is bound by kernel launches, not by the GPU: CUDA graphs
    (what `mode="reduce-overhead"` turns on) replay the step's kernels as one
    launch. The step's shapes are fixed per segment, so one graph is
    recorded per segment. On a CPU, the C++ wrapper calls the kernels without
    Python in between.
    """
    if device.type == "cuda":
        return {"triton.cudagraphs": True}
    return {"cpp_wrapper": True}


def replays_cuda_graphs(device):
    """Whether the compiled step replays as a CUDA graph on `device`."""
    return device.type == "cuda"


def compile_step(function, layers, state, numbers):
    """`function(state, numbers) -> state`, exported for these shapes and
    compiled; `layers` hold the weights it reads.

    A CUDA graph's replay writes its outputs into the memory of the previous
    replay's outputs (torch: "accessing tensor output of CUDAGraphs that has
    been overwritten by a subsequent run"; `../shared/gpu/FINDINGS.md`,
    section 1), and each step's outputs are the next step's inputs: they are
    copied out of the graph's memory after each replay.
    """
    module = _FlatStep(function, layers, state, numbers)
    with torch.no_grad():
        exported = torch.export.export(
            module, tuple(pytree.tree_leaves((state, numbers))), strict=False
        )
    device = pytree.tree_leaves(state)[0].device
    compiled = torch.compile(
        exported.module(), dynamic=False, options=inductor_options(device)
    )
    graphs = replays_cuda_graphs(device)

    def step(state, numbers):
        if graphs:  # the last step's outputs are this step's inputs, no more
            torch.compiler.cudagraph_mark_step_begin()
        with torch.no_grad():
            leaves = compiled(*pytree.tree_leaves((state, numbers)))
            if graphs:
                leaves = tuple(leaf.clone() for leaf in leaves)
        return pytree.tree_unflatten(leaves, module.state_spec)

    return step
