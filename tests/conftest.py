import gc

import keras
import pytest


def pytest_collection_modifyitems(config, items):
    """The modules that start subprocesses (`processes`) go first, each
    module's tests kept together and in order: pytest-xdist hands whole
    modules (`--dist loadfile`) to the workers in this order (the Makefile
    turns off its own, by count of tests), and these are the longest
    (the JAX multi-process module, about 160 s) and load both cores. Last,
    one would leave a worker idle while the other runs it."""
    heavy = {item.path for item in items if item.get_closest_marker("processes")}
    items.sort(key=lambda item: item.path not in heavy)


@pytest.fixture(autouse=True, scope="module")
def _module_memory_freed():
    """Each test module's models, traces and compiled programs are freed
    after it: a pytest-xdist worker runs a file after another for the whole
    suite, and on JAX each grew to 6 GiB of programs nothing would call
    again, on a 24 GiB CI machine beside the multi-process tests."""
    yield
    gc.unfreeze()  # first: what follows may raise
    keras.backend.clear_session(free_memory=False)
    if keras.backend.backend() == "jax":
        import jax

        jax.clear_caches()
    gc.collect()


@pytest.fixture(autouse=True)
def _collections_see_this_test_only():
    """The garbage collector skips what earlier tests of the module left
    (`gc.freeze`), so their cyclic garbage waits for the module's end:
    Keras runs a full collection each time a layer drops a variable
    (`Layer.__delattr__`, in every `quantize`), and over a worker's heap
    (on JAX, traces and compiled programs) each took 0.57 s (16 s of the
    67 s of test_multi_head_attention.py's three layer contracts on JAX)."""
    gc.freeze()


@pytest.fixture(autouse=True)
def _patches_reach_the_kernels(request):
    """On JAX an eager attention call runs a program compiled once per plan
    and shapes (`keras_attn/_jax_eager.py`), rotary positions too: a test
    that patches what they read while tracing (a spy, a smaller chunk) starts and
    ends with none compiled, so that none compiled without its patch runs
    in its place."""
    patches = "monkeypatch" in request.fixturenames
    if keras.backend.backend() != "jax" or not patches:
        yield
        return
    from keras_attn import _jax_eager

    _jax_eager.clear()
    yield
    _jax_eager.clear()


@pytest.fixture(autouse=True)
def _seeded():
    """Every test starts from the same random state and a fresh dtype policy."""
    keras.utils.set_random_seed(1234)
    yield
    keras.config.set_dtype_policy("float32")


@pytest.fixture
def fused_calls(monkeypatch):
    """Records the key shapes the fused kernel receives (`kernels.fused`:
    Keras' op, or torch's own on PyTorch)."""
    from keras_attn.ops.kernels import fused
    from tests.helpers.doubles import recorded

    def key_shape(query, key, *args, **kwargs):
        return tuple(key.shape)

    return recorded(monkeypatch, fused, "_kernel", key_shape)


@pytest.fixture
def sdpa_calls(monkeypatch):
    """PyTorch: records each `scaled_dot_product_attention` call as a dict of
    its arguments, the kernel torch chooses for them (`torch._fused_sdp_choice`)
    and whether every kernel was enabled (nothing pinned)."""
    import torch
    from torch.nn import functional

    from tests.helpers.doubles import recorded

    def arguments(query, key, value, **kwargs):
        backends = torch.backends.cuda
        return {
            "query": tuple(query.shape),
            "key": tuple(key.shape),
            **kwargs,
            "kernel": torch._fused_sdp_choice(query, key, value, **kwargs),
            "pinned": not all(
                enabled()
                for enabled in (
                    backends.flash_sdp_enabled,
                    backends.mem_efficient_sdp_enabled,
                    backends.cudnn_sdp_enabled,
                    backends.math_sdp_enabled,
                )
            ),
        }

    return recorded(monkeypatch, functional, "scaled_dot_product_attention", arguments)


@pytest.fixture
def small_chunks(monkeypatch):
    """The explicit path goes in chunks of 4 query rows at any size; returns
    `materialize()`, which turns chunking off again, and records the calls of
    the chunked path in `.calls`."""
    from keras_attn.ops import plan
    from keras_attn.ops.kernels import chunked
    from tests.helpers.doubles import recorded

    def query_shape(query, *args, **kwargs):
        return tuple(query.shape)

    calls = recorded(monkeypatch, chunked, "attention", query_shape)
    monkeypatch.setattr(plan, "CHUNKED_FROM", 1)
    monkeypatch.setattr(plan, "CHUNK_LOGITS", 1)
    monkeypatch.setattr(plan, "MIN_CHUNK_ROWS", 4)

    def materialize():
        monkeypatch.setattr(plan, "CHUNKED_FROM", float("inf"))

    materialize.calls = calls
    return materialize


@pytest.fixture
def cuda_sdpa(monkeypatch):
    """PyTorch: torch's SDPA held to CUDA's rules, the plan told it runs on a
    GPU (`tests/helpers/doubles.py`); records the calls."""
    from tests.helpers.doubles import hold_sdpa_to_cuda

    return hold_sdpa_to_cuda(monkeypatch)


@pytest.fixture
def xla_gpu(monkeypatch):
    """JAX and TensorFlow: keras_attn's int8 layers pad as on a GPU
    (`tests/helpers/doubles.py`)."""
    from tests.helpers.doubles import hold_int8_to_xla_gpu

    hold_int8_to_xla_gpu(monkeypatch)


@pytest.fixture
def cuda_graphs(monkeypatch):
    """PyTorch: `generate`'s compiled steps replay like CUDA graphs
    (`tests/helpers/doubles.py`); returns the replays."""
    from tests.helpers.doubles import hold_compiled_steps_to_cuda_graphs

    return hold_compiled_steps_to_cuda_graphs(monkeypatch)


@pytest.fixture
def captured_graphs(monkeypatch):
    """`generate`'s PyTorch steps taken to a GPU's CUDA graph capture, held on
    a CPU to its rules (`tests/helpers/doubles.py`); the graphs made."""
    from tests.helpers.doubles import hold_capture_to_cuda_graphs

    return hold_capture_to_cuda_graphs(monkeypatch)
