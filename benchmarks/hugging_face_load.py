"""Peak memory of `from_hugging_face`, against the checkpoint and a naive load.

`keras_attn.models.from_hugging_face`'s peak resident memory against the size
of the checkpoint it reads, and against a naive load that reads the whole
file first.

Run once per backend, one at a time, threads pinned (`B` = jax, tensorflow,
torch):

    KERAS_BACKEND=B OMP_NUM_THREADS=1 python benchmarks/hugging_face_load.py --save

`from_hugging_face` builds the model, then reads the checkpoint one tensor at
a time into its variables, so that a 7B checkpoint never needs two copies of
itself in memory. This measures it on a seeded Llama-shaped checkpoint
(`transformers.LlamaForCausalLM(LlamaConfig(...)).save_pretrained`: width
1024, 8 layers, 8 heads, FFN 2816, a 32,000-token vocabulary and a head of
its own, 168.5M parameters: 674 MB in float32, 337 MB in bfloat16), written
once into `--folder` (one subfolder a dtype) by a subprocess of its own, as
transformers costs memory too; an existing folder of the same spec is reused.

Each measurement runs in a fresh interpreter on `KERAS_BACKEND`, so that its
peak is its own (`benchmarks/memory.py`), `--repeats` (3) times, the median
shown (JAX frees buffers on a thread of its own: its peaks vary by about a
tensor from run to run): imports (`keras`, the backend, `keras_attn`,
safetensors), the step once on a tiny checkpoint (a warm-up: lazy imports
and compiled initializers are not the checkpoint's), then the resident size
(`VmRSS`) as the baseline, then the step, with the resident high-water mark
(`VmHWM`, reset just before) and `ru_maxrss` read after it:

- build: `from_hugging_face` stopped once it has built the model (randomly
  initialized), before its first read: what the model alone costs;
- from_hugging_face: `from_hugging_face(folder, dtype)`;
- naive: `safetensors.numpy.load_file` of the whole file, then the same
  assigns from that dict (two copies: the file's and the model's).

The table gives each step's peak above the baseline and its ratio to the
file's size and to the model's variable bytes, and the peak beyond the
model's bytes in units of the largest tensor (the token table: 131 MB in
float32): what reading one tensor at a time holds beside the model.

`--save` writes markdown to `benchmarks/results/hugging_face_load_<backend>.md`
(or `--results DIR`). `--smoke` (also `--quick`) is a run of seconds on a
tiny checkpoint: its numbers mean nothing, and with `--save` its file goes
to a temporary folder unless `--results` is given.
"""

import argparse
import gc
import json
import os
import platform
import resource
import struct
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Stdlib alone at the top: this process starts the measuring ones, and a
# child's `ru_maxrss` starts from its parent's high-water mark.
from benchmarks import memory  # noqa: E402
from benchmarks.report import write_report  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
QUICK_RESULTS = os.path.join(tempfile.gettempdir(), "keras_attn_benchmarks_quick")
FOLDER = os.path.join(tempfile.gettempdir(), "keras_attn_hugging_face_load")
LLAMA = dict(
    vocab_size=32000,
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=8,
    num_attention_heads=8,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
)
SMOKE = dict(LLAMA, vocab_size=512, hidden_size=64, intermediate_size=128)
SMOKE.update(num_hidden_layers=2, num_attention_heads=4)
# Run once before the baseline: the step's one-time costs (lazy imports,
# compiled initializers) are then not counted as the checkpoint's.
WARMUP = dict(SMOKE, vocab_size=256, num_hidden_layers=1)
MARKER = "benchmark_spec.json"
STEPS = ("build", "from_hugging_face", "naive")
MIB = 2**20


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--folder", default=FOLDER, help=f"Checkpoint folder. Defaults to {FOLDER}."
    )
    parser.add_argument(
        "--dtype", nargs="+", choices=("float32", "bfloat16"),
        default=["float32", "bfloat16"],
        help="Checkpoint and model dtype(s). Defaults to both.",
    )  # fmt: skip
    parser.add_argument("--layers", type=int, help="Llama layers (default 8).")
    parser.add_argument(
        "--smoke", "--quick", action="store_true", help="Tiny checkpoint, seconds."
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="Fresh processes a step (median)."
    )
    parser.add_argument("--save", action="store_true", help="Write the markdown.")
    parser.add_argument(
        "--results",
        help=f"Output folder. Defaults to {RESULTS}, or {QUICK_RESULTS} with --smoke.",
    )
    args = parser.parse_args(argv)
    args.config = dict(SMOKE if args.smoke else LLAMA)
    if args.layers:
        args.config["num_hidden_layers"] = args.layers
    if args.smoke:
        args.repeats = 1
    if args.results is None:
        args.results = QUICK_RESULTS if args.smoke else RESULTS
    if args.smoke and args.folder == FOLDER:
        args.folder = os.path.join(FOLDER, "smoke")
    return args


def main(argv=None):
    """Run the benchmark (`argv`: command-line flags); returns the markdown."""
    args = parse_args(argv)
    backend = os.environ.get("KERAS_BACKEND", "jax")
    loads, start, sections = [os.getloadavg()[0]], time.perf_counter(), []
    folders = ensure_checkpoints(args.folder, args.config, args.dtype, backend)
    for dtype, (folder, warmup) in folders.items():
        rows = {step: runs(folder, warmup, dtype, step, args.repeats) for step in STEPS}
        sections.append(section(folder, dtype, rows))
        loads.append(os.getloadavg()[0])
    versions = rows["build"][0]["versions"]
    header = report_header(backend, args, versions, loads, time.perf_counter() - start)
    text = "\n\n".join([header, *sections]) + "\n"
    if args.save:
        return write_report(args.results, f"hugging_face_load_{backend}.md", text)
    print(text)
    return text


# --- The checkpoint -----------------------------------------------------------


def ensure_checkpoints(folder, config, dtypes, backend):
    """`{dtype: (checkpoint, warm-up checkpoint)}` folders under `folder`,
    those missing (or of another spec) written by transformers in one
    subprocess."""
    folders, missing = {}, []
    for dtype in dtypes:
        pair = os.path.join(folder, dtype), os.path.join(folder, f"warmup_{dtype}")
        for path, spec in zip(pair, (config, WARMUP), strict=True):
            if read_marker(path) != {"config": spec, "dtype": dtype, "seed": 0}:
                missing.append((path, spec, dtype))
        folders[dtype] = pair
    if missing:
        start = time.perf_counter()
        memory.in_fresh_process(write_checkpoints, missing, backend=backend)
        seconds = time.perf_counter() - start
        print(f"Wrote {len(missing)} checkpoint(s) ({seconds:.0f} s).", flush=True)
    return folders


def read_marker(path):
    marker = os.path.join(path, MARKER)
    if not os.path.isfile(marker):
        return None
    with open(marker) as f:
        return json.load(f)


def write_checkpoints(missing):
    """Each `(path, config, dtype)` of `missing`: a seeded
    `LlamaForCausalLM(LlamaConfig(**config))` in `dtype`, saved with
    `save_pretrained` (safetensors), then the marker of its spec."""
    import torch
    import transformers

    for path, config, dtype in missing:
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))
        model.to(getattr(torch, dtype)).save_pretrained(path)
        del model
        with open(os.path.join(path, MARKER), "w") as f:
            json.dump({"config": config, "dtype": dtype, "seed": 0}, f)
    return len(missing)


def weight_files(folder):
    return sorted(
        os.path.join(folder, name)
        for name in os.listdir(folder)
        if name.endswith(".safetensors")
    )


def largest_tensor_bytes(folder):
    """The largest tensor's bytes, from the safetensors headers (a
    little-endian u64 header length, then JSON with each tensor's offsets)."""
    largest = 0
    for file in weight_files(folder):
        with open(file, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        header.pop("__metadata__", None)
        for entry in header.values():
            start, end = entry["data_offsets"]
            largest = max(largest, end - start)
    return largest


# --- The measurements, each in a fresh process -----------------------------


def runs(folder, warmup, dtype, step, repeats):
    """`(the run of median peak, every run's peak)` of `repeats` fresh
    processes: the peak varies from run to run where the backend frees
    buffers on a thread of its own (JAX) and with the allocator's reuse."""
    backend = os.environ.get("KERAS_BACKEND", "jax")
    results = []
    for _ in range(repeats):
        result = memory.in_fresh_process(
            measure, folder, warmup, dtype, step, backend=backend
        )
        results.append(result)
        print(f"{dtype} {step}: {results[-1]['seconds']:.1f} s", flush=True)
    results.sort(key=lambda result: result["peak_growth"])
    return results[(len(results) - 1) // 2], [r["peak_growth"] for r in results]


# --- One measurement --------------------------------------------------------


def measure(folder, warmup, dtype, step):
    """`step` of `STEPS` on `folder`, after the imports and the same step on
    the tiny `warmup` folder; the resident sizes around it (bytes) and what
    it built."""
    import keras
    import ml_dtypes  # noqa: F401  (imported by the load; not measured)
    import numpy as np
    import safetensors.numpy  # noqa: F401

    import keras_attn
    from benchmarks.run import versions

    keras.ops.convert_to_tensor(np.ones(4, "float32"))  # the backend's runtime
    imports = memory._status_bytes("VmRSS")
    STEP_FUNCTIONS[step](warmup, dtype)
    gc.collect()
    baseline = memory._status_bytes("VmRSS")
    start = time.perf_counter()
    model, growth = memory.peak_growth(lambda: STEP_FUNCTIONS[step](folder, dtype))
    return {
        "seconds": time.perf_counter() - start,
        "imports_rss": imports,
        "baseline_rss": baseline,
        "peak_growth": growth,
        "vm_hwm": memory.high_water_bytes(),
        "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "after_rss": memory._status_bytes("VmRSS"),
        "model_bytes": variable_bytes(model),
        "parameters": model.count_params(),
        "versions": versions(keras.config.backend()),
        "keras_attn": keras_attn.__version__,
    }


class _Built(Exception):
    """Raised with the model as `from_hugging_face` builds it, before it
    reads a tensor."""


def build(folder, dtype):
    """The model `from_hugging_face` builds for `folder`, its variables
    randomly initialized: `from_hugging_face` stopped before its first read."""
    from keras_attn.models.hugging_face import _load

    def built(spec, **kwargs):
        raise _Built(decoder_lm(spec, **kwargs))

    decoder_lm, _load.decoder_lm = _load.decoder_lm, built
    try:
        lazy_load(folder, dtype)
    except _Built as stop:
        return stop.args[0]
    finally:
        _load.decoder_lm = decoder_lm
    raise RuntimeError("from_hugging_face no longer builds with decoder_lm.")


def lazy_load(folder, dtype):
    import keras_attn

    return keras_attn.models.from_hugging_face(folder, dtype=dtype)


def naive_load(folder, dtype):
    """The whole file read first (`safetensors.numpy.load_file`), then the
    same assigns as `from_hugging_face`, served from that dict."""
    from safetensors.numpy import load_file

    import keras_attn
    from keras_attn.models.hugging_face import _files

    tensors = {}
    for file in weight_files(folder):
        tensors.update(load_file(file))
    _files.Checkpoint.read = lambda self, name: tensors[name]
    return keras_attn.models.from_hugging_face(folder, dtype=dtype)


STEP_FUNCTIONS = {"build": build, "from_hugging_face": lazy_load, "naive": naive_load}


def variable_bytes(model):
    import keras
    import ml_dtypes
    import numpy as np

    total = 0
    for variable in model.weights:
        name = keras.backend.standardize_dtype(variable.dtype)
        item = np.dtype(ml_dtypes.bfloat16 if name == "bfloat16" else name).itemsize
        total += int(np.prod(variable.shape)) * item
    return total


# --- The report ---------------------------------------------------------------


def section(folder, dtype, rows):
    file_bytes = sum(os.path.getsize(f) for f in weight_files(folder))
    largest = largest_tensor_bytes(folder)
    first = {step: row for step, (row, _) in rows.items()}
    model_bytes = first["from_hugging_face"]["model_bytes"]
    baselines = ", ".join(f"{row['baseline_rss'] / MIB:,.1f}" for row in first.values())
    lines = [
        f"### {dtype}: checkpoint {file_bytes / MIB:,.1f} MiB, model "
        f"{model_bytes / MIB:,.1f} MiB",
        "",
        f"`{folder}`: {len(weight_files(folder))} safetensors file(s), "
        f"{file_bytes:,} bytes; {first['build']['parameters']:,} parameters, "
        f"variables {model_bytes:,} bytes; largest tensor {largest:,} bytes "
        f"({largest / MIB:.1f} MiB). Resident after the imports: "
        f"{first['build']['imports_rss'] / MIB:,.1f} MiB; the baselines, after the "
        f"warm-up (the median runs'): {baselines} MiB.",
        "",
        "| step | peak - baseline (MiB) | runs (MiB) | / file | / model | beyond "
        "model, largest tensors | VmHWM (MiB) | ru_maxrss (MiB) | kept after "
        "(MiB) | s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for step, (row, growths) in rows.items():
        growth = row["peak_growth"]
        cells = [
            step,
            f"{growth / MIB:,.1f}",
            ", ".join(f"{g / MIB:,.0f}" for g in growths),
            f"{growth / file_bytes:.2f}x",
            f"{growth / model_bytes:.2f}x",
            f"{(growth - model_bytes) / largest:+.2f}",
            f"{row['vm_hwm'] / MIB:,.1f}",
            f"{row['ru_maxrss'] / MIB:,.1f}",
            f"{(row['after_rss'] - row['baseline_rss']) / MIB:,.1f}",
            f"{row['seconds']:.1f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def report_header(backend, args, versions, loads, seconds):
    threads = os.environ.get("OMP_NUM_THREADS", "unset")
    command = f"KERAS_BACKEND={backend} OMP_NUM_THREADS={threads} python "
    command += "benchmarks/hugging_face_load.py " + " ".join(sys.argv[1:])
    layers = args.config["num_hidden_layers"]
    lines = [
        f"## `from_hugging_face`'s peak memory, `KERAS_BACKEND={backend}`, CPU",
        "",
        f"{versions}; {memory_total() / 2**30:.1f} GiB of memory; "
        f"OMP_NUM_THREADS={threads}; {platform.platform()}.",
        "",
        f"Command: `{command.strip()}` ({seconds:.0f} s).",
        "",
        f"Load average (1 minute) at the start and after each dtype: "
        f"{', '.join(f'{x:.2f}' for x in loads)} on {os.cpu_count()} cores.",
        "",
        f"Checkpoint: `LlamaForCausalLM(LlamaConfig({config_text(args.config)}))`"
        f" ({layers} layers), seeded, `save_pretrained`. Each step in "
        f"{args.repeats} fresh process(es), the run of median peak shown (runs: "
        "each run's peak - baseline); peak - baseline = the resident high-water "
        "mark (`VmHWM`, reset before the step) minus the resident size before "
        "it; beyond model = (peak - baseline - model bytes) / largest tensor "
        "bytes; kept after = resident after the step minus the baseline.",
    ]
    if args.smoke:
        lines += ["", "Smoke run (`--smoke`): these numbers mean nothing."]
    return "\n".join(lines)


def config_text(config):
    return ", ".join(f"{key}={value}" for key, value in config.items())


def memory_total():
    with open("/proc/meminfo") as f:
        return int(f.readline().split()[1]) * 1024  # MemTotal, kB


if __name__ == "__main__":
    main()
