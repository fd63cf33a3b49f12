"""The first call of `generate(jit_compile=True)` on PyTorch: how long the
compiling takes, by what Inductor's on-disk cache already holds.

    OMP_NUM_THREADS=1 python benchmarks/compile_time.py

Issue 27's setting: the decoder-only model of `benchmarks/generation.py`
(2 pre-norm blocks, width 64, vocabulary 1000, batch 2), 240 new tokens after
a 16-token prompt, greedy. Each case runs in a fresh process with its own
Inductor cache directory (`TORCHINDUCTOR_CACHE_DIR`):

- `cold`: an empty cache, as on a machine where torch never compiled;
- `machine probed`: a cache where another model (width 32) was compiled
  first: Inductor's one-time probes of the CPU (g++ builds of small programs
  for each vector instruction set, kept in the cache) are done, this model's
  graph is not;
- `graph cached`: this model compiled before (a second process).

Each row: the first compiled call in seconds (after an eager call of the
same process, which has paid Keras' and torch's own first-call costs, so
the row is the compiling), an eager call's, and whether their tokens are
equal. Results go to `benchmarks/results/compile_time.md`.
"""

import argparse
import ast
import os
import platform
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks.report import write_report  # noqa: E402

RESULTS = os.path.join(ROOT, "benchmarks", "results")
PROMPT, NEW_TOKENS = 16, 240
OTHER = {"width": 32, "heads": 2, "ffn": 48}


def first_call(other=False):
    """`(first compiled call s, eager call s, same tokens)` in this process."""
    import numpy as np

    from benchmarks import generation as decoding
    from keras_attn.generation import generate

    model = decoding.keras_attn_model(**(OTHER if other else {}))
    rng = np.random.default_rng(0)
    prompt = rng.integers(1, decoding.VOCAB, (decoding.BATCH, PROMPT), dtype="int32")
    start = time.perf_counter()
    eager = generate(model, prompt, max_new_tokens=NEW_TOKENS)
    eager_seconds = time.perf_counter() - start
    start = time.perf_counter()
    compiled = generate(model, prompt, max_new_tokens=NEW_TOKENS, jit_compile=True)
    seconds = time.perf_counter() - start
    same = bool(np.array_equal(np.asarray(eager), np.asarray(compiled)))
    return seconds, eager_seconds, same


def in_process(cache, other=False):
    """`first_call` in a fresh process on the Inductor cache `cache`."""
    env = {**os.environ, "KERAS_BACKEND": "torch", "TORCHINDUCTOR_CACHE_DIR": cache}
    code = f"from benchmarks.compile_time import first_call; print(first_call({other}))"
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=True,
    )  # fmt: skip
    return ast.literal_eval(done.stdout.strip().splitlines()[-1])


def _machine():
    """The machine and versions, and the load, in words."""
    import torch

    load = os.getloadavg()[0]
    return (
        f"Machine: {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores, load average {load:.1f}; torch "
        f"{torch.__version__}, Python {platform.python_version()}. Inductor's "
        "one-time probes of the CPU (g++ builds of a test program per vector "
        "instruction set, `torch/_inductor/cpu_vec_isa.py`) are in the cold "
        "row only."
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--results", default=RESULTS, help="Output folder.")
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as cold, tempfile.TemporaryDirectory() as probed:
        rows.append(("cold", in_process(cold)))
        in_process(probed, other=True)
        rows.append(("machine probed", in_process(probed)))
        rows.append(("graph cached", in_process(probed)))
    lines = [
        "### First call of `generate(jit_compile=True)` on PyTorch, CPU",
        "",
        f"Command: `OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '')} "
        "python benchmarks/compile_time.py`. The decoder-only model of "
        f"`benchmarks/generation.py`, {NEW_TOKENS} new tokens after a "
        f"{PROMPT}-token prompt, greedy; one fresh process a row.",
        "",
        "| Inductor's cache | first compiled call (s) | eager call (s) | same tokens |",
        "|---|---:|---:|---|",
    ]
    for name, (seconds, eager, same) in rows:
        lines.append(f"| {name} | {seconds:.1f} | {eager:.1f} | {same} |")
    lines += ["", _machine()]
    return write_report(args.results, "compile_time.md", "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
