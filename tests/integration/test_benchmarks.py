"""The benchmarks' measuring protocol (warm-up calls, medians, peak memory), and
the smoke runs of the GPU, PyTorch overhead, int8 cache and Hugging Face load
benchmarks on a CPU."""

import mmap
import os
import re
import subprocess
import sys

import pytest

from benchmarks import memory, timing
from tests.helpers.backend import BACKEND, require
from tests.helpers.processes import ROOT


def fake_clock(durations):
    """A clock under which the calls take `durations` seconds, in turn."""
    readings = [0]
    for seconds in durations:
        readings += [readings[-1], readings[-1] + seconds]
    return iter(readings[1:]).__next__


def test_time_calls_warms_up_then_takes_the_median_of_interleaved_calls():
    log = []
    functions = {name: (lambda name=name: log.append(name)) for name in "ab"}
    # Warm-ups a, a, b, b; then rounds a, b; a, b; a, b.
    clock = fake_clock([5, 1, 7, 1] + [1, 2, 1, 2, 100, 3])
    result = timing.time_calls(functions, calls=3, warmup=2, clock=clock)
    assert log == ["a", "a", "b", "b"] + ["a", "b"] * 3
    assert result["a"].warmups == (5, 1)
    assert result["a"].first == 5
    assert result["a"].times == (1, 1, 100)
    assert result["a"].median == 1
    assert result["b"].first == 7
    assert result["b"].times == (2, 2, 3)
    assert result["b"].median == 2


@pytest.mark.parametrize("calls, warmup", [(0, 1), (3, 0)])
def test_time_calls_needs_a_warm_up_and_a_timed_call(calls, warmup):
    with pytest.raises(ValueError, match="warm-up call and a timed call"):
        timing.time_calls({"f": lambda: None}, calls, warmup)


def test_describe_says_what_a_point_is():
    assert timing.describe(5, 2) == "median of 5 calls after 2 warm-up calls"
    assert timing.describe(1) == "median of 1 call after 1 warm-up call"


@pytest.mark.skipif(
    not os.access("/proc/self/clear_refs", os.W_OK), reason="Linux /proc only"
)
def test_peak_growth_sees_memory_freed_before_it_returns():
    def allocate(mib):
        # Fresh pages from the kernel, not malloc's: in a worker that ran other
        # tests, malloc may hand back memory already resident, and then there
        # is no growth to see (it did in CI: 0 bytes for 64 MiB).
        block = mmap.mmap(-1, mib * 2**20)
        for page in range(0, len(block), mmap.PAGESIZE):
            block[page] = 1  # touched, so resident
        value = float(block[-mmap.PAGESIZE])
        block.close()  # unmapped: freed before `peak_growth` returns
        return value

    allocate(128)  # A high-water mark from before must not count.
    _, small = memory.peak_growth(lambda: allocate(1))
    result, large = memory.peak_growth(lambda: allocate(64))
    assert result == 1.0
    assert 60 * 2**20 < large < 80 * 2**20
    assert small < 16 * 2**20


@pytest.mark.processes
def test_in_fresh_process_runs_a_benchmark_function_with_its_arguments():
    result = memory.in_fresh_process(_describe_in_child, 7, backend="numpy")
    assert result["describe"] == "median of 7 calls after 1 warm-up call"
    assert result["backend"] == "numpy"
    assert result["pid"] != os.getpid()
    assert result["executable"] == sys.executable


def _describe_in_child(calls):
    return {
        "describe": timing.describe(calls),
        "backend": os.environ["KERAS_BACKEND"],
        "pid": os.getpid(),
        "executable": sys.executable,
    }


@pytest.mark.processes
def test_gpu_benchmark_smoke_run_names_the_device_and_writes_three_tables(tmp_path):
    """`benchmarks/gpu.py` at tiny sizes on this backend's CPU (no Inductor
    compiles: a minute each here); on TensorFlow, which the GPU machine has no
    GPU build of, it only says so."""
    command = [sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--quick"]
    command += ["--calls", "1", "--lengths", "64", "--train-lengths", "64"]
    command += ["--new-tokens", "4", "--no-compiled", "--results", str(tmp_path)]
    env = {**os.environ, "KERAS_BACKEND": BACKEND, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    if BACKEND == "tensorflow":
        assert "GPU build is not available on the GPU machine" in done.stdout
        assert "chunked explicit path" in done.stdout
        assert not list(tmp_path.iterdir())
        return
    text = (tmp_path / f"gpu_{BACKEND}_cpu.md").read_text()
    assert f"`KERAS_BACKEND={BACKEND}`: CPU" in text and "Device: CPU." in text
    for table in ("Attention layer", "Encoder training step", "Generation"):
        assert re.search(rf"### {table}.*`KERAS_BACKEND={BACKEND}`, CPU\n", text)
    for row in ("keras_attn", "keras.layers.MultiHeadAttention", "(native)"):
        assert re.search(rf"\| 64 \| [^|]*{re.escape(row)}[^|]* \| \d+\.\d\d \|", text)
    assert len(re.findall(r"keras_attn / native, time: T=64 \d+\.\d\dx\.", text)) == 2
    assert "| keras-hub |" in text and "| keras_attn cached |" in text
    assert "out of memory" not in text
    if BACKEND == "jax":  # On PyTorch the compiled loop is the one left out.
        assert "loops give the same tokens: yes." in text


@pytest.mark.processes
@pytest.mark.skipif(BACKEND != "torch", reason="measures PyTorch against torch.nn")
def test_torch_overhead_smoke_run_writes_every_row_against_native(tmp_path):
    """`benchmarks/torch_overhead.py --quick`: a row per step and contender,
    each with its time, aten op count and ratios against native torch."""
    require("keras_hub")
    command = [sys.executable, str(ROOT / "benchmarks" / "torch_overhead.py")]
    command += ["--quick", "--results", str(tmp_path)]
    env = {**os.environ, "KERAS_BACKEND": "torch", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    text = (tmp_path / "torch_overhead.md").read_text()
    assert "Smoke run (`--quick`)" in text and "Machine: " in text
    assert "Load average" in text
    native = [(step, "torch.nn (native)") for step in ("forward", "train step")]
    native += [("new token", "torch static cache (native)")]
    rows = native + [("forward", "torch.nn (native), eval() fast path")]
    rows += [
        (step, name) for step, _ in native[:2] for name in ("keras_attn", "keras-hub")
    ]
    rows += [("new token", "keras_attn generate")]
    # ms, vs native, ops, vs native, top-level ops, outside; a new token's time
    # is a difference of two calls' medians, of two calls each here: it can
    # come out below zero on a loaded machine.
    for step, name in rows:
        cells = r" \| ".join(
            [step, re.escape(name), r"-?\d+\.\d{3}", r"-?\d+\.\d\dx", r"\d+"]
            + [r"\d+\.\d\dx", r"\d+", r"-?\d+%"]
        )
        assert re.search(rf"\| {cells} \|\n", text), (step, name)
    for step, name in native:
        assert re.search(rf"\| {step} \| {re.escape(name)} \| [^|]+ \| 1\.00x", text)


@pytest.mark.skipif(BACKEND != "torch", reason="measures Keras on PyTorch")
def test_keras_costs_smoke_run_writes_each_piece_against_native(tmp_path):
    """`benchmarks/keras_costs.py --quick`, in this process (a fresh one
    would spend 5 s importing torch and Keras): a row per piece and contender,
    with its time, aten op count and ratios, and the summary line."""
    from benchmarks import keras_costs

    text = keras_costs.main(["--quick", "--results", str(tmp_path)])
    assert (tmp_path / "keras_costs.md").read_text() == text
    assert "Smoke run (`--quick`)" in text and "Load average" in text
    ratio = r"(?:\d+\.\d\dx|-)"
    pieces = {
        "optimizer apply": [r"keras\.optimizers\.Adam\.apply, \d+ variables"],
        "layer call": [re.escape("keras.layers.Layer.__call__ (empty layer)")],
        "train step": [r"Model\.train_on_batch", "the same Keras step by hand"],
    }
    for piece, names in pieces.items():
        for name in names:  # µs, vs native, ops, vs native, top-level ops, outside
            cells = r" \| ".join(
                [piece, name, r"\d+\.\d", ratio, r"\d+", ratio, r"\d+", r"\d+%"]
            )
            assert re.search(rf"\| {cells} \|\n", text), (piece, name)
        assert re.search(rf"\| {piece} \| [^|]*\(native\) \| [^|]+ \| 1\.00x", text)
    assert re.search(r"Keras adds, per call: Adam's apply -?\d+ µs", text)


@pytest.mark.processes
@pytest.mark.skipif(
    BACKEND != "torch",
    reason="suite time (56-85 s on TensorFlow and JAX, mostly compiling): the "
    "script is the same on every backend, and its runs per backend are its "
    "results (benchmarks/results/int8_cache_*.md)",
)
def test_int8_cache_smoke_run_reports_each_target(tmp_path):
    """`benchmarks/int8_cache.py --quick`: its four sections with their rows,
    a verdict per target (in the summary and under its section), the memory
    ratios (exact at any size: (64 + 4) / (4 * 64) of float32 at a head width
    of 64), and its step-by-step float path equal to the model's own pass."""
    command = [sys.executable, str(ROOT / "benchmarks" / "int8_cache.py")]
    command += ["--quick", "--results", str(tmp_path)]
    env = {**os.environ, "KERAS_BACKEND": BACKEND, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    text = (tmp_path / f"int8_cache_{BACKEND}.md").read_text()
    assert "Smoke run (`--quick`)" in text and "Load average" in text
    targets = ["int8 / float32 bytes", "int8 / bfloat16 bytes", "greedy agreement"]
    targets += ["logits rel. diff", "int8 / float time"]
    for target in targets:
        verdict = rf"{re.escape(target)} at (?:most|least) [^|]+ \| [^|]+ \| (?:yes|no)"
        assert len(re.findall(verdict, text)) == 2, target
    assert "| int8 / float32 bytes at most 0.3000x | 0.2656x | yes |" in text
    assert "| int8 / bfloat16 bytes at most 0.5500x | 0.5312x | yes |" in text
    assert re.search(r"\| int8 \| [\d,]+ \| [\d.]+ \| 0\.2656x \| 0\.5312x \|", text)
    for model in ("trained", r"untrained \(random\)"):  # agreement, rows, diffs
        cells = r" \| ".join([model, r"\d+\.\d\d%", r"\d+/64", r"\d+\.\d{4}%"])
        assert re.search(rf"\| {cells} \| \d+\.\d{{4}}% \| \d+\.\d\d% \|", text)
    paths = re.search(r"worst rel\. diff (\S+) \(trained\), (\S+) \(untrained\)", text)
    assert paths and max(map(float, paths.groups())) < 1e-4
    assert "their argmax replays the float `generate` tokens: yes" in text
    assert len(re.findall(r"\| per (?:token|channel) \| \d\.\d{4} \|", text)) == 6
    for variant in ("default \\(`auto`\\)", "`jit_compile=False`"):
        cells = r" \| ".join([variant] + [r"-?\d+\.\d{3}"] * 2 + [r"-?\d+\.\d\dx"])
        assert re.search(rf"\| FINDINGS decoder [^|]+ \| {cells} \|", text), variant
    for part in ("attention", "read", "cast"):
        assert re.search(rf"\| 256 \| {part} \| \d+\.\d{{3}} \| \d+\.\d{{3}} \|", text)


@pytest.mark.processes
@pytest.mark.skipif(
    BACKEND != "tensorflow",
    reason="suite time (32-40 s a backend, mostly four processes' imports): the "
    "script is the same on every backend, and its runs per backend are its "
    "results (benchmarks/results/hugging_face_load_*.md)",
)
def test_hugging_face_load_smoke_run_measures_each_step_in_its_own_process(tmp_path):
    """`benchmarks/hugging_face_load.py --smoke`: a tiny Llama checkpoint
    written by transformers, then build, `from_hugging_face` and the naive
    whole-file load, each in a fresh process, with its peak against the
    file's and the model's bytes (bfloat16 alone: one writer process)."""
    require("transformers", "safetensors", "ml_dtypes")
    command = [sys.executable, str(ROOT / "benchmarks" / "hugging_face_load.py")]
    command += ["--smoke", "--dtype", "bfloat16", "--save"]
    command += ["--folder", str(tmp_path / "checkpoints"), "--results", str(tmp_path)]
    env = {**os.environ, "KERAS_BACKEND": BACKEND, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    text = (tmp_path / f"hugging_face_load_{BACKEND}.md").read_text()
    assert "Smoke run (`--smoke`)" in text and "Load average" in text
    assert f"`KERAS_BACKEND={BACKEND}`" in text and "Command: `" in text
    # 147,776 parameters (a 2-layer Llama of width 64, vocabulary 512), 2 bytes each.
    assert "147,776 parameters, variables 295,552 bytes" in text
    assert "largest tensor 65,536 bytes" in text  # the 512 x 64 token table
    for step in ("build", "from_hugging_face", "naive"):
        cells = [step, r"-?[\d,]+\.\d", r"-?[\d,]+"]
        cells += [r"-?\d+\.\d\dx"] * 2 + [r"[+-]\d+\.\d\d"]
        cells += [r"[\d,]+\.\d"] * 2 + [r"-?[\d,]+\.\d", r"\d+\.\d"]
        assert re.search(r"\| " + r" \| ".join(cells) + r" \|\n", text), step


@pytest.mark.skipif(
    BACKEND != "torch",
    reason="the script is the same on every backend (PyTorch's eager run is the "
    "shortest); its runs per backend are its results "
    "(benchmarks/results/mixture_of_experts_*.md)",
)
def test_mixture_of_experts_smoke_run_writes_each_contender_against_dense(tmp_path):
    """`benchmarks/mixture_of_experts.py` at tiny sizes: a row per step and
    contender, each with its time and its ratio to the dense network."""
    command = [sys.executable, str(ROOT / "benchmarks" / "mixture_of_experts.py")]
    command += ["--tokens", "24", "--width", "8", "--hidden", "12", "--experts", "3"]
    command += ["--calls", "1", "--blocks", "2", "--results", str(tmp_path)]
    env = {**os.environ, "KERAS_BACKEND": "torch", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    text = (tmp_path / "mixture_of_experts_torch.md").read_text()
    assert "OMP_NUM_THREADS=1" in text
    names = ["dense, active parameters", "grouped (blocks, block 2)"]
    names += ["loop over experts", "all experts (keras-hub)"]
    names = [re.escape(name) for name in names]
    names.append(r"grouped, plan \(sorted\)")  # eager PyTorch's plan
    for step in ("forward", "train step"):
        for name in names:
            row = rf"\| {step} \| {name} \| \d+\.\d \| \d+\.\d\dx \|"
            assert re.search(row, text), (step, name)
        assert f"| {step} | dense, active parameters | " in text
