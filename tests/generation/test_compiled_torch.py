"""The compiled decoding step on PyTorch, held on a CPU to what a GPU does to
it: its replays as CUDA graphs overwrite the previous replay's outputs
(`tests/helpers/doubles.py`)."""

import numpy as np
import pytest

from keras_attn.generation import generate
from tests.helpers.backend import BACKEND
from tests.helpers.builders import GENERATION_VOCAB as VOCAB
from tests.helpers.builders import GENERATION_WIDTH as WIDTH
from tests.helpers.builders import decoder_only_model

pytestmark = pytest.mark.skipif(
    BACKEND != "torch", reason="PyTorch's compiled step (jit_compile=True)"
)
PROMPTS = np.array([[0, 3, 4, 5], [6, 7, 8, 9]])


def test_cuda_graph_replays_decode_like_eager(cuda_graphs):
    """Two cache segments (two graphs), greedy and sampling: the tokens of
    eager decoding, though each replay overwrites the last one's outputs."""
    model = decoder_only_model(VOCAB, WIDTH, num_key_value_heads=2)
    for kwargs in ({}, {"method": "sample", "seed": 3, "top_k": 4}):
        compiled = generate(model, PROMPTS, 70, jit_compile=True, **kwargs)
        eager = generate(model, PROMPTS, 70, jit_compile=False, **kwargs)
        np.testing.assert_array_equal(compiled, eager)
    assert len(cuda_graphs) >= 2 and all(r.replays > 1 for r in cuda_graphs)


def test_the_cuda_graph_double_overwrites_what_it_returned(cuda_graphs):
    """The double can fail: a kept output is garbage after the next replay."""
    import torch

    from tests.helpers.doubles import CudaGraphReplays

    replay = CudaGraphReplays(lambda x: (x + 1,))
    (first,) = replay(torch.zeros(2))
    kept = first
    replay(torch.ones(2))
    assert kept is replay.outputs[0] and torch.equal(kept, torch.full((2,), 2.0))
    (second,) = replay(kept)  # the last outputs as inputs: overwritten first
    assert torch.isnan(second).all()
