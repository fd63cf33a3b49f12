"""Training on several processes, with each backend's own engine, against one.

`examples/distributed_training.py` trains a tiny model for 3 steps: once in one
process on one device (the reference), and across 2 processes that talk
through 127.0.0.1, each feeding its share of every global batch:

- JAX (in the JAX run): `keras.distribution` over 2 processes of 4 CPU devices
  each (gloo), `DataParallel`, `ModelParallel` on a 2 x 4 mesh, and fully
  sharded weights; the example is its own launcher.
- TensorFlow (in its run): `MultiWorkerMirroredStrategy`, 2 workers.
- PyTorch (in its run): `torchrun --nproc_per_node=2`, DDP and FSDP2.

In float64, so that "trains like one process" is exact up to rounding: in
float32, Adam turns the rounding noise of the key biases' gradient (zero in
exact arithmetic: softmax ignores a shift of every score) into differences of
~1e-5 (see the README).
"""

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest

from tests.helpers import BACKEND

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = "examples/distributed_training.py"
TINY = [
    "--steps=3",
    "--batch-size=8",
    "--embedding-dim=16",
    "--num-heads=4",
    "--intermediate-dim=16",
    "--learning-rate=1e-2",
    "--dtype=float64",
]
TIMEOUT = 420  # Seconds, for any run: each is a few tens of seconds.


def start(args, out):
    """A run of the example in its own process group (so that a timeout stops
    every process it started), on CPU devices only."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)  # The example sets the JAX devices itself.
    return subprocess.Popen(
        [sys.executable, *args, *TINY, f"--output={out}", f"--backend={BACKEND}"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def finish(process):
    """Wait for a run (killing its group on timeout); its log."""
    try:
        log, _ = process.communicate(timeout=TIMEOUT)
    finally:
        if process.poll() is None or process.returncode:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    if process.returncode is None:
        process.wait()
    assert process.returncode == 0, log[-5000:] if log else process.returncode
    return log


def launcher(out, processes, *args):
    return start([EXAMPLE, f"--processes={processes}", *args], out)


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
    return start([*command, EXAMPLE, "--processes=2", *args], out)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every run of this backend, started together so that they overlap."""
    root = tmp_path_factory.mktemp("multi_process")
    kinds = {
        "jax": {
            "data": (2, "--strategy=data"),
            "model": (2, "--strategy=model", "--mesh=2x4"),
            "fsdp": (2, "--strategy=fsdp", "--mesh=2x4"),
        },
        "tensorflow": {"data": (2, "--strategy=data")},
        "torch": {"data": ("torchrun", "--strategy=data")},
    }[BACKEND]
    if BACKEND == "torch":
        kinds["fsdp"] = ("torchrun", "--strategy=fsdp")
    processes = {"single": launcher(root / "single", 1, "--mesh=1x1")}
    for name, (count, *args) in kinds.items():
        if count == "torchrun":
            processes[name] = torchrun(root / name, *args)
        else:
            processes[name] = launcher(root / name, count, *args)
    yield {"root": root, "processes": processes, "finished": {}}
    for process in processes.values():
        if process.poll() is None:  # Its test was deselected or failed.
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()


def result(runs, name):
    """The losses and the saved model of one run, once it has finished."""
    if name not in runs["finished"]:
        runs["finished"][name] = finish(runs["processes"][name])
    out = runs["root"] / name
    results = json.loads((out / "results.json").read_text())
    return results, keras.saving.load_model(out / "model.keras")


def assert_trains_like_one_process(runs, name):
    results, model = result(runs, name)
    single, reference = result(runs, "single")
    assert results["processes"] == 2 and single["processes"] == 1
    np.testing.assert_allclose(results["losses"], single["losses"], atol=1e-5)
    assert single["losses"][-1] < single["losses"][0]
    for weight, expected in zip(model.weights, reference.weights, strict=True):
        np.testing.assert_allclose(
            keras.ops.convert_to_numpy(weight),
            keras.ops.convert_to_numpy(expected),
            atol=1e-5,
            err_msg=weight.path,
        )
    return results, model


def ONLY(backend):
    return pytest.mark.skipif(
        BACKEND != backend, reason=f"runs once, in the {backend} run of the suite"
    )


@ONLY("jax")
@pytest.mark.parametrize("strategy", ["data", "model", "fsdp"])
def test_jax_two_processes_train_like_one(runs, strategy):
    assert_trains_like_one_process(runs, strategy)


# Kept whole by fully sharded weights: the Dense head (the example's layout map
# is built without a model, so it has rules for keras_attn weights only), the
# feed-forward intermediate biases (split over the model axis already), and
# the optimizer's counters. With them, Adam's moments of these weights.
WHOLE = re.compile(
    r"(adam/)?(logits|.*feedforward_intermediate_dense[/_]bias|iteration$|"
    r"learning_rate$)"
)


@ONLY("jax")
def test_jax_fully_sharded_weights_halve_each_devices_share(runs):
    model_parallel = result(runs, "model")[0]["bytes_on_a_device"]
    fully_sharded = result(runs, "fsdp")[0]["bytes_on_a_device"]
    assert model_parallel.keys() == fully_sharded.keys()
    assert sum("momentum" in path for path in fully_sharded) > 40
    for path, size in model_parallel.items():
        halved = not WHOLE.match(path)
        assert fully_sharded[path] == (size // 2 if halved else size), path
    assert sum(fully_sharded.values()) < 0.6 * sum(model_parallel.values())


@ONLY("jax")
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


@ONLY("tensorflow")
def test_tensorflow_multi_worker_mirrored_trains_like_one_process(runs):
    assert_trains_like_one_process(runs, "data")


@ONLY("torch")
@pytest.mark.parametrize("strategy", ["data", "fsdp"])
def test_torchrun_ddp_and_fsdp2_train_like_one_process(runs, strategy):
    assert_trains_like_one_process(runs, strategy)
