"""Every benchmark on one backend, or on each in turn: one markdown summary each.

    python benchmarks/run.py --backend jax
    python benchmarks/run.py --backend tensorflow
    python benchmarks/run.py --backend torch
    python benchmarks/run.py --backend all      # the three, one process each
    python -m benchmarks --backend jax          # the same, as a module

Runs, in one process per backend (`KERAS_BACKEND` is set from `--backend`
before Keras is imported; `all` starts a subprocess for each backend, one
after the other):

1. `benchmarks/encoder.py`: one Transformer encoder block (training step and
   forward pass) against keras-hub, `keras.layers.MultiHeadAttention` and
   `torch.nn`, then attention time and memory as the sequence grows.
2. `benchmarks/generation.py`: tokens/s of cached `generate` against a naive
   loop and keras-hub.
3. `benchmarks/translation.py`: training tokens/s of the `make demo`
   translation model against the same model on keras-hub layers.

Each writes its own table to `benchmarks/results/`, and the three tables are
concatenated into `benchmarks/results/summary_<backend>.md`. Every point is
the median of timed calls after warm-up (`benchmarks/timing.py`; the tables
say how many); `--calls N` sets the timed calls of all three. `--quick` is a
smoke run of a few minutes per backend (one timed call, short sequences, batch
32 for the translation model, no compiled PyTorch step); its numbers mean
nothing, and its files go to a temporary folder (printed) unless
`--results DIR` is given, so the real results are not overwritten.

`benchmarks/long_sequence.py` (training at 2,048 to 16,384 tokens, one fresh
process a point, about 15 minutes a backend),
`benchmarks/sharding_memory.py` and `benchmarks/gpu.py` (the GPU benchmark:
JAX and PyTorch on an NVIDIA GPU) run on their own.

The timings are wall-clock on the CPU (or whatever device the backend picks):
run on an otherwise idle machine, and leave the thread settings (for example
`OMP_NUM_THREADS`) as they are, the same for every backend.
"""

import argparse
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")
QUICK_RESULTS = os.path.join(tempfile.gettempdir(), "keras_attn_benchmarks_quick")
BACKENDS = ("jax", "tensorflow", "torch")
BENCHMARKS = ("encoder", "generation", "translation")
QUICK = {
    "encoder": ["--calls", "1", "--lengths", "128", "256", "--no-compiled"],
    "generation": ["--lengths", "32", "--calls", "1", "--naive-steps", "2"],
    "translation": ["--calls", "1", "--batch-size", "32"],
}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--backend",
        choices=[*BACKENDS, "all"],
        default=os.environ.get("KERAS_BACKEND", "jax"),
        help="Defaults to $KERAS_BACKEND, or jax.",
    )
    parser.add_argument(
        "--calls", type=int, help="Timed calls a point, in every benchmark."
    )
    parser.add_argument(
        "--quick", action="store_true", help="Smoke run: tiny repeats and lengths."
    )
    parser.add_argument(
        "--results",
        help=f"Output folder. Defaults to {RESULTS}, or {QUICK_RESULTS} with --quick.",
    )
    args = parser.parse_args(argv)
    if args.results is None:
        args.results = QUICK_RESULTS if args.quick else RESULTS
    return args


def benchmark_argv(name, args):
    """The flags `benchmarks/<name>.py` gets: quick ones, calls, output."""
    argv = list(QUICK[name]) if args.quick else []
    if args.calls is not None:  # Later flags win in argparse.
        argv += ["--calls", str(args.calls)]
    return argv + ["--results", args.results]


def versions(backend):
    import keras
    import numpy as np

    library = {"tensorflow": "tensorflow", "jax": "jax", "torch": "torch"}[backend]
    version = getattr(sys.modules.get(library), "__version__", "?")
    return (
        f"keras {keras.__version__}, {library} {version}, numpy {np.__version__}, "
        f"Python {platform.python_version()}, {platform.machine()}, "
        f"{os.cpu_count()} CPUs"
    )


def run_backend(args):
    """Every benchmark in this process; returns the number that failed."""
    os.environ["KERAS_BACKEND"] = args.backend  # Before Keras is imported.
    if ROOT not in sys.path:  # `python benchmarks/run.py` puts only HERE there.
        sys.path.insert(0, ROOT)
    import importlib

    import keras

    if keras.config.backend() != args.backend:
        raise RuntimeError(
            f"Keras was imported with the {keras.config.backend()} backend."
        )
    sections, failed = [], 0
    for name in BENCHMARKS:
        argv = benchmark_argv(name, args)
        print(f"=== {name} ({args.backend}): {' '.join(argv)}", flush=True)
        start = time.perf_counter()
        try:
            module = importlib.import_module(f"benchmarks.{name}")
            sections.append(module.main(argv))
        except Exception:
            failed += 1
            traceback.print_exc()
            error = traceback.format_exc().strip().splitlines()[-1]
            sections.append(f"### {name}: failed\n\n    {error}\n")
        seconds = time.perf_counter() - start
        print(f"=== {name} ({args.backend}) took {seconds:.0f} s", flush=True)
    header = [
        f"## Benchmarks, `KERAS_BACKEND={args.backend}`",
        "",
        versions(args.backend) + ".",
    ]
    if args.quick:
        header.append("Smoke run (`--quick`): these numbers mean nothing.")
    text = "\n".join(header) + "\n\n" + "\n".join(sections)
    os.makedirs(args.results, exist_ok=True)
    path = os.path.join(args.results, f"summary_{args.backend}.md")
    with open(path, "w") as f:
        f.write(text)
    print(f"=== wrote {path}", flush=True)
    return failed


def pass_through(args, backend):
    argv = ["--backend", backend, "--results", args.results]
    if args.calls is not None:
        argv += ["--calls", str(args.calls)]
    return argv + (["--quick"] if args.quick else [])


def main(argv=None):
    args = parse_args(argv)
    backends = BACKENDS if args.backend == "all" else (args.backend,)
    keras_imported = "keras" in sys.modules
    if len(backends) == 1 and not keras_imported:
        return 1 if run_backend(args) else 0
    failed = []
    for backend in backends:  # One process each: the backend is read at import.
        print(f"===== KERAS_BACKEND={backend}", flush=True)
        returncode = subprocess.call(
            [sys.executable, os.path.abspath(__file__), *pass_through(args, backend)],
            env={**os.environ, "KERAS_BACKEND": backend},
        )
        if returncode:
            failed.append(backend)
    if failed:
        print(f"failed on: {' '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
