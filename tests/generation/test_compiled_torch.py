"""The compiled decoding step on PyTorch, held on a CPU to what a GPU does to
it: its replays as CUDA graphs overwrite the previous replay's outputs
(`tests/helpers/doubles.py`)."""

import numpy as np
import pytest

from keras_attn.generation import generate
from tests.helpers.backend import BACKEND, to_numpy, torch_tensor
from tests.helpers.builders import GENERATION_VOCAB as VOCAB
from tests.helpers.builders import GENERATION_WIDTH as WIDTH
from tests.helpers.builders import decoder_only_model, encoder_decoder_model
from tests.helpers.doubles import compile_with_inductor

pytestmark = pytest.mark.skipif(
    BACKEND != "torch", reason="PyTorch's compiled step (jit_compile=True)"
)
PROMPTS = np.array([[0, 3, 4, 5], [6, 7, 8, 9]])


def test_cuda_graph_replays_decode_like_eager(cuda_graphs):
    """Greedy and sampling: the tokens of eager decoding, though each replay
    overwrites the last one's outputs. One graph per `generate` shape (not
    one per cache segment), replayed again by a second call; the caches are
    written in place at static addresses (the double raises otherwise) and
    never copied out."""
    model = decoder_only_model(VOCAB, WIDTH, num_key_value_heads=2)
    for kwargs in ({"method": "sample", "seed": 3, "top_k": 4}, {}):
        compiled = generate(model, PROMPTS, 70, jit_compile=True, **kwargs)
        eager = generate(model, PROMPTS, 70, jit_compile=False, **kwargs)
        np.testing.assert_array_equal(compiled, eager)
    with pytest.raises(RuntimeError, match="already decoding"):  # its buffers
        generate(  # are in use: a callback may not decode on them again
            model, PROMPTS, 70, jit_compile=True,
            on_token=lambda *_: generate(model, PROMPTS, 70, jit_compile=True),
        )  # fmt: skip
    again = generate(model, PROMPTS[::-1], 70, jit_compile=True)  # new caches
    np.testing.assert_array_equal(again, compiled[::-1])
    assert len(cuda_graphs) == 2  # greedy: two calls, and the refused one's step
    assert cuda_graphs[1].replays == 2 * (70 - 4) + 1
    assert all(len(x.shape) < 5 for r in cuda_graphs for x in r.outputs)
    assert all(r.written for r in cuda_graphs)  # the caches, in place


def test_an_eager_torch_step_writes_its_caches_in_place():
    """No copy of a cache per step: the state's caches are the given ones."""
    import torch

    from keras_attn.generation.adapter import ModelAdapter
    from keras_attn.generation.graph import GraphPlan
    from keras_attn.layers._lean_call import SublayerCalls

    adapter = ModelAdapter(GraphPlan(decoder_only_model(VOCAB, WIDTH)), 8)
    calls = SublayerCalls()
    with torch.no_grad():
        pads = torch_tensor([0, 0], dtype=torch.int32)
        _, state = adapter.prefill(torch_tensor(PROMPTS), pads, [], 8, calls)
        caches = [cache.kv for cache in state["caches"]]
        token = torch_tensor([1, 2])
        index = torch_tensor(4, dtype=torch.int32)
        _, state = adapter.step(token, index, state, calls)
    kept = [cache.kv for cache in state["caches"]]
    assert all(a is b for a, b in zip(kept, caches, strict=True))
    assert all(bool(c[:, :, :, 4].any()) for c in caches)


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


def test_the_cuda_graph_double_refuses_a_moved_written_input(cuda_graphs):
    """The double can fail: an input written in place must stay put."""
    import torch

    from tests.helpers.doubles import CudaGraphReplays

    replay = CudaGraphReplays(lambda cache: (cache.add_(1).sum(),))
    cache = torch.zeros(2)
    torch._dynamo.mark_static_address(cache)
    replay(cache)
    replay(cache)
    moved = torch.zeros(2)
    torch._dynamo.mark_static_address(moved)
    with pytest.raises(AssertionError, match="mutated inputs"):
        replay(moved)
    with pytest.raises(AssertionError, match="mutated inputs"):
        CudaGraphReplays(lambda cache: (cache.add_(1).sum(),))(torch.zeros(2))


def test_sources_of_another_length_get_a_step_of_their_own(cuda_graphs):
    """The cross-attention caches are kept (static) leaves: a source of
    another length is another shape, so another compiled step, not a copy
    into the first one's buffers."""
    model = encoder_decoder_model(VOCAB, WIDTH)
    for length in (3, 5):
        sources = np.arange(1, 2 * length + 1).reshape(2, length) % VOCAB
        inputs = {"source": sources, "target": PROMPTS[:, :2]}
        compiled = generate(model, inputs, 6, jit_compile=True)
        np.testing.assert_array_equal(
            compiled, generate(model, inputs, 6, jit_compile=False)
        )
    assert len(cuda_graphs) == 2


def test_the_step_compiles_once_for_a_generate_shape(monkeypatch):
    """Dynamo guards a compiled function on its inputs' strides (a "stride
    mismatch" recompiles it): the first step reads the prefill's last logits,
    a view of all of them, so its inputs are made contiguous; before, the
    second step recompiled (14 s on a CPU). Traced by a counting backend
    (`torch._dynamo.testing.CompileCounter`: dynamo only, no C++)."""
    import torch
    from torch._dynamo.testing import CompileCounter

    counter, compile_ = CompileCounter(), torch.compile

    def counted(model, dynamic=None, options=None):
        return compile_(model, backend=counter, dynamic=dynamic)

    monkeypatch.setattr(torch, "compile", counted)
    compile_with_inductor(monkeypatch)
    torch._dynamo.reset()
    model = decoder_only_model(VOCAB, WIDTH)
    try:
        compiled = generate(model, PROMPTS, 12, jit_compile=True)
    finally:
        torch._dynamo.reset()
    np.testing.assert_array_equal(compiled, generate(model, PROMPTS, 12))
    assert counter.frame_count == 1


def test_returned_tokens_are_not_the_compiled_steps_buffers(cuda_graphs, monkeypatch):
    """The compiled step writes tokens and scores in place into buffers it
    keeps for every call of its shape (CUDA graphs' static inputs): what a
    call returns is copied off them before the next call may decode, so a
    second call does not overwrite the first one's results."""
    from keras_attn.generation import loop

    returned, decode = [], loop.Generator.decode

    def kept(self, inputs, on_token=None):
        outputs = decode(self, inputs, on_token)
        returned.append(outputs)
        return outputs

    monkeypatch.setattr(loop.Generator, "decode", kept)
    model = decoder_only_model(VOCAB, WIDTH)
    first = generate(model, PROMPTS, 12, jit_compile=True, return_scores=True)
    generate(model, PROMPTS[::-1], 12, jit_compile=True, return_scores=True)
    np.testing.assert_array_equal(to_numpy(returned[0]["tokens"]), first[0])
    np.testing.assert_array_equal(to_numpy(returned[0]["scores"]), first[1])


def test_auto_captures_a_cuda_graph_once_eager_steps_cost_more(
    captured_graphs, monkeypatch
):
    """`jit_compile="auto"` on a GPU (held to CUDA graph capture's rules on a
    CPU): eager steps over the first cache segment (64 positions), timed;
    they have cost what a capture does (here nothing), so the rest of the
    call runs captured, over the whole length; the next call replays from
    its first step. The tokens of eager decoding, greedy and sampled."""
    from keras_attn.generation import tiers

    monkeypatch.setattr(tiers, "cost", lambda form: 0.0)
    monkeypatch.setattr(tiers, "_MEASURED", {})  # this test's own measures
    model = decoder_only_model(VOCAB, WIDTH, num_key_value_heads=2)
    for kwargs in ({"method": "sample", "seed": 3, "top_k": 4}, {}):
        auto = generate(model, PROMPTS, 80, **kwargs)
        eager = generate(model, PROMPTS, 80, jit_compile=False, **kwargs)
        np.testing.assert_array_equal(auto, eager)
    np.testing.assert_array_equal(generate(model, PROMPTS, 80), eager)
    greedy = captured_graphs.graphs[-1]
    # 76 steps a call: 60 eager (to position 64), 16 replays; then 76.
    assert len(captured_graphs.graphs) == 2 and greedy.replays == 16 + 76


def test_auto_stays_eager_while_a_compile_costs_more(captured_graphs, monkeypatch):
    """The eager time a shape has cost adds up over calls; below the cost of
    a capture nothing is captured."""
    from keras_attn.generation import api, tiers

    monkeypatch.setattr(tiers, "cost", lambda form: 1e9)
    monkeypatch.setattr(tiers, "_MEASURED", {})
    model = decoder_only_model(VOCAB, WIDTH)
    first = generate(model, PROMPTS, 12)
    np.testing.assert_array_equal(generate(model, PROMPTS, 12), first)
    assert not captured_graphs.graphs
    (generator,) = api._GENERATORS[model].values()
    (spent,) = generator.forms.spent.values()
    assert spent > 0


def test_the_capture_double_refuses_what_cuda_cannot_capture(captured_graphs):
    """The double can fail: a read back to the host or a tensor made from
    Python data inside the captured call raises, as stream capture does; a
    replay overwrites the last one's outputs."""
    import torch

    x = torch.ones(3)
    for bad in (lambda x: (x * x.sum().item(),), lambda x: (x + torch.tensor(1.0),)):
        with pytest.raises(RuntimeError, match="not permitted when stream is"):
            captured_graphs(bad, [x], warmups=1)
    graph, (out,) = captured_graphs(lambda x: (x.add_(1) * 2,), [x], warmups=0)
    assert torch.isnan(out).all() and torch.equal(x, torch.ones(3))  # not run
    graph.replay()
    kept = out.clone()
    graph.replay()
    assert torch.equal(kept, torch.full((3,), 4.0)) and torch.equal(out, kept + 2)


def test_a_decoding_inside_another_leaves_its_buffers_alone(
    captured_graphs, monkeypatch
):
    """`"auto"`'s compiled buffers belong to one decoding at a time (a
    lease): a `generate` called again from `on_token`, of the same shape,
    goes on eagerly while the outer one replays; both give eager's tokens."""
    from keras_attn.generation import tiers

    monkeypatch.setattr(tiers, "cost", lambda form: 0.0)
    monkeypatch.setattr(tiers, "_MEASURED", {})
    model = decoder_only_model(VOCAB, WIDTH)
    eager = generate(model, PROMPTS, 80, jit_compile=False)
    generate(model, PROMPTS, 80)  # the shape captured: the next call replays
    inner = []

    def again(step, tokens):
        if step == 70:
            inner.append(generate(model, PROMPTS, 80))

    np.testing.assert_array_equal(generate(model, PROMPTS, 80, on_token=again), eager)
    np.testing.assert_array_equal(inner[0], eager)


def test_a_step_that_cannot_compile_stays_eager(captured_graphs, monkeypatch):
    """`"auto"` keeps decoding eagerly where the export or compile fails (a
    model `torch.export` cannot trace), and tries that shape no more;
    `jit_compile=True` raises."""
    from keras_attn.generation import _torch, tiers

    monkeypatch.setattr(tiers, "cost", lambda form: 0.0)
    monkeypatch.setattr(tiers, "_MEASURED", {})
    tries = []

    def fails(*arguments):
        tries.append(1)
        raise RuntimeError("untraceable")

    monkeypatch.setattr(_torch, "capture_step", fails)
    monkeypatch.setattr(_torch, "compile_step", fails)
    model = decoder_only_model(VOCAB, WIDTH)
    eager = generate(model, PROMPTS, 80, jit_compile=False)
    for _ in range(2):
        np.testing.assert_array_equal(generate(model, PROMPTS, 80), eager)
    assert len(tries) == 1
    with pytest.raises(RuntimeError, match="untraceable"):
        generate(model, PROMPTS, 80, jit_compile=True)


def test_no_compile_once_every_row_has_ended(captured_graphs, monkeypatch):
    """Rows that all end inside the first segment leave nothing to compile
    for, however cheap a compile is."""
    from keras_attn.generation import tiers

    monkeypatch.setattr(tiers, "cost", lambda form: 0.0)
    monkeypatch.setattr(tiers, "_MEASURED", {})
    model = decoder_only_model(VOCAB, WIDTH)
    eager = generate(model, PROMPTS, 80, jit_compile=False)
    ends = sorted({int(eager[0, 6]), int(eager[1, 6])})
    generate(model, PROMPTS, 80, end_token_id=ends)
    assert not captured_graphs.graphs
