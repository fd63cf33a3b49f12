"""Training on several processes, with each backend's own engine, against one.

`examples/distributed_training.py` trains a tiny model for 3 steps: once in one
process on one device (the reference), and across 2 processes that talk
through 127.0.0.1, each feeding its share of every global batch:

- JAX (in the JAX run): `keras.distribution` over 2 processes of 4 CPU devices
  each (gloo): `DataParallel` on 8 devices, `ModelParallel` on a 2 x 4 mesh,
  fully sharded weights, and `MixtureOfExperts` blocks with their experts
  split over the model axis; the example is its own launcher.
- TensorFlow (in its run): `MultiWorkerMirroredStrategy`, 2 workers.
- PyTorch (in its run): `torchrun --nproc_per_node=2`, DDP and FSDP2.

In float64, so that "trains like one process" is exact up to rounding, and
JAX's data parallelism in float32 too (its fused attention path): there Adam
turns the rounding noise of the key biases' gradient, zero in exact arithmetic
(softmax ignores a shift of every score), into differences of ~1e-5.
"""

import json
import re
import time

import keras
import numpy as np
import pytest

from tests.helpers.backend import BACKEND
from tests.helpers.processes import ROOT, finish_process, start_process, stop_process

pytestmark = pytest.mark.processes  # every test reads the runs of the example

EXAMPLE = "examples/distributed_training.py"
TINY = [
    "--steps=3",
    "--batch-size=8",
    "--embedding-dim=16",
    "--num-heads=4",
    "--intermediate-dim=16",
    "--learning-rate=1e-2",
]
TIMEOUT = 420  # Seconds for all the runs of a backend, started together.
FLOAT64 = "--dtype=float64"
KEY_BIAS = re.compile(r".*/key/bias")
EXPERTS = "--num-experts=4"  # One per device of the model axis (4).


def start(out, *args):
    """A run of the example, on CPU devices only, in its own process group."""
    flags = [*TINY, f"--output={out}", f"--backend={BACKEND}", f"--timeout={TIMEOUT}"]
    # The example adds its JAX devices to the suite's XLA flags (one thread,
    # LLVM unoptimized: the 11 JAX processes share two cores).
    return start_process([*args, *flags], cwd=ROOT)


def torchrun(out, *args):
    """Started as a cluster would: `torchrun`, which sets RANK, WORLD_SIZE..."""
    from examples.distributed_training import free_port

    command = [
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        "--max-restarts=0",
    ]
    return start(out, *command, EXAMPLE, *args)


# name: (how it is started, the example's flags), per backend.
RUNS = {
    "jax": {
        "single": ("launcher", "--processes=1", "--mesh=1x1", FLOAT64),
        "single32": ("launcher", "--processes=1", "--mesh=1x1"),
        "data32": ("launcher", "--processes=2", "--strategy=data"),
        "model": ("launcher", "--processes=2", "--strategy=model", FLOAT64),
        "fsdp": ("launcher", "--processes=2", "--strategy=fsdp", FLOAT64),
        "sparse": ("launcher", "--processes=1", "--mesh=1x1", EXPERTS, FLOAT64),
        "expert": ("launcher", "--processes=2", "--strategy=expert", EXPERTS, FLOAT64),
    },
    "tensorflow": {
        "single": ("launcher", "--processes=1", FLOAT64),
        "data": ("launcher", "--processes=2", FLOAT64),
    },
    "torch": {
        "single": ("launcher", "--processes=1", FLOAT64),
        "data": ("torchrun", "--strategy=data", FLOAT64),
        "fsdp": ("torchrun", "--strategy=fsdp", FLOAT64),
    },
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every run of this backend, started together so that they overlap."""
    root = tmp_path_factory.mktemp("multi_process")
    processes = {}
    for name, (how, *flags) in RUNS[BACKEND].items():
        if how == "torchrun":
            processes[name] = torchrun(root / name, *flags)
        else:
            processes[name] = start(root / name, EXAMPLE, *flags)
    deadline = time.monotonic() + TIMEOUT
    yield {"root": root, "processes": processes, "deadline": deadline, "logs": {}}
    for process in processes.values():
        if process.poll() is None:  # Its test was deselected or failed.
            stop_process(process)


def result(runs, name):
    """The results and the saved model of one run, once it has finished."""
    if name not in runs["logs"]:
        timeout = runs["deadline"] - time.monotonic()
        runs["logs"][name] = finish_process(runs["processes"][name], timeout)
    out = runs["root"] / name
    results = json.loads((out / "results.json").read_text())
    return results, keras.saving.load_model(out / "model.keras")


def assert_trains_like_one_process(runs, name, reference="single", key_bias=1e-5):
    results, model = result(runs, name)
    single, expected_model = result(runs, reference)
    assert (results["processes"], single["processes"]) == (2, 1)
    np.testing.assert_allclose(results["losses"], single["losses"], atol=1e-5)
    assert single["losses"][-1] < single["losses"][0]
    for weight, expected in zip(model.weights, expected_model.weights, strict=True):
        np.testing.assert_allclose(
            keras.ops.convert_to_numpy(weight),
            keras.ops.convert_to_numpy(expected),
            atol=key_bias if KEY_BIAS.fullmatch(weight.path) else 1e-5,
            err_msg=weight.path,
        )
    return results


def only(backend):
    return pytest.mark.skipif(
        BACKEND != backend, reason=f"runs once, in the {backend} run of the suite"
    )


# The float64 models load in float32 here (JAX without 64-bit types).
JAX_FLOAT64 = pytest.mark.filterwarnings("ignore:Explicitly requested dtype float64")


@only("jax")
@JAX_FLOAT64
@pytest.mark.parametrize("strategy", ["model", "fsdp"])
def test_jax_two_processes_of_4_devices_train_like_one(runs, strategy):
    assert assert_trains_like_one_process(runs, strategy)["devices"] == 8


@only("jax")
def test_jax_data_parallel_on_8_devices_in_float32_trains_like_one(runs):
    """Adam moves the key biases by rounding noise (see the module docstring)."""
    results = assert_trains_like_one_process(
        runs, "data32", reference="single32", key_bias=1e-4
    )
    assert results["devices"] == 8


# What fully sharded weights keep whole: the feed-forward intermediate biases
# (split over the model axis already; a layout gives a dimension one axis) and
# the optimizer's counters. Everything else, Adam's moments too, is halved.
WHOLE = re.compile(
    r".*(feedforward_intermediate_dense[/_]bias|iteration|learning_rate)"
)


@only("jax")
@JAX_FLOAT64
def test_jax_fully_sharded_weights_halve_each_devices_share(runs):
    model_parallel = result(runs, "model")[0]["bytes_on_a_device"]
    fully_sharded = result(runs, "fsdp")[0]["bytes_on_a_device"]
    assert model_parallel.keys() == fully_sharded.keys()
    assert sum("momentum" in path for path in fully_sharded) > 40
    for path, size in model_parallel.items():
        halved = not WHOLE.match(path)
        assert fully_sharded[path] == (size // 2 if halved else size), path
    assert sum(fully_sharded.values()) < 0.51 * sum(model_parallel.values())


@only("jax")
@JAX_FLOAT64
def test_jax_model_saved_across_processes_predicts_the_same_on_one_device(runs):
    assert keras.distribution.distribution() is None  # One device here.
    _, model = result(runs, "fsdp")
    _, reference = result(runs, "single")
    from examples.distributed_training import global_batch, parse_args

    inputs, _ = global_batch(parse_args(TINY), step=100)
    np.testing.assert_allclose(
        model.predict(list(inputs), verbose=0),
        reference.predict(list(inputs), verbose=0),
        atol=1e-5,
    )
    assert int(model.optimizer.iterations) == 3  # Its optimizer state came along.


# The stacked expert weights and their Adam moments.
EXPERT_KERNEL = re.compile(r".*feedforward[/_](intermediate|gate|output)_kernel.*")


@only("jax")
@JAX_FLOAT64
def test_jax_experts_split_over_two_processes_train_like_one(runs):
    """`--strategy expert`: each device of the model axis, across the two
    processes, holds one of the 4 experts."""
    results = assert_trains_like_one_process(runs, "expert", reference="sparse")
    whole = result(runs, "sparse")[0]["bytes_on_a_device"]
    split = {
        path: size
        for path, size in results["bytes_on_a_device"].items()
        if EXPERT_KERNEL.fullmatch(path)
    }
    assert len(split) >= 3 * 2 * 3  # 3 kernels (with moments), 2 blocks.
    assert all(size == whole[path] // 4 for path, size in split.items()), split


@only("tensorflow")
def test_tensorflow_multi_worker_mirrored_trains_like_one_process(runs):
    assert_trains_like_one_process(runs, "data")
    _, model = result(runs, "data")
    assert int(model.optimizer.iterations) == 3  # Its optimizer state came along.


@only("torch")
@pytest.mark.parametrize("strategy", ["data", "fsdp"])
def test_torchrun_ddp_and_fsdp2_train_like_one_process(runs, strategy):
    assert_trains_like_one_process(runs, strategy)
