"""Long sequences: peak memory and time of an encoder block's training step.

    python benchmarks/long_sequence.py --backend all
    python benchmarks/long_sequence.py --backend torch --lengths 2048 8192
    python benchmarks/long_sequence.py --backend tensorflow --jit-compile true
    python benchmarks/long_sequence.py --backend tensorflow --variable-length

One Transformer encoder block (batch 1, width 512, 8 heads of 64,
feed-forward 2048, float32, post-norm) trains with `train_on_batch` (Adam,
MSE) at each length T, in these variants:

- `chunked`: `keras_attn.TransformerEncoder(flash_attention=False)`, the
  explicit path, which goes in chunks of query rows recomputed in the backward
  pass once `H * T * S` reaches `keras_attn.ops.plan.CHUNKED_FROM`;
- `materialized`: the same with chunking turned off (the whole `(B, H, T, S)`
  logits and their gradient are kept);
- `fused`: `flash_attention=None` with chunking turned off, i.e. Keras'
  `ops.dot_product_attention` (XLA's attention on JAX, PyTorch's
  `scaled_dot_product_attention` on torch; not on TensorFlow, which has none);
- `keras-hub`: `keras_hub.layers.TransformerEncoder`.

Each point runs in a fresh process, so that its peak resident memory (the
process's high-water mark, `VmHWM`: see `benchmarks/memory.py` for why not
`getrusage`'s `ru_maxrss`, which a child inherits from its parent) is its
own; the `before` column is the same mark after the model was built, before
the first step. Time is the median of `--calls` steps after one warm-up step
(`benchmarks/timing.py`). `--jit-compile` goes to `model.compile`: `auto`,
Keras' default, compiles with XLA on JAX, and on TensorFlow only where TF
sees a GPU, so `true` measures TensorFlow's GPU default on a CPU. A point
runs under an address-space limit (`--memory-limit-gib`, default 20 on this
24 GiB machine): one that needs more fails with an out-of-memory error, and
the table says so. Results go to `benchmarks/results/long_sequence_<backend>.md`
(or `--results DIR`).

`--variable-length` declares the input `keras.Input((None, width))` and
trains one step on 16 tokens before the warm-up, so that Keras traces the
step again with the length unknown (its `tf.function`s' `reduce_retracing`),
as a model trained on batches of several lengths is; results go to
`long_sequence_<backend>_variable.md`. JAX and PyTorch (eager) see every
length as it is, so only TensorFlow's program differs.
"""

import argparse
import json
import math
import os
import platform
import resource
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")
sys.path.insert(0, ROOT)
from benchmarks import memory  # noqa: E402
from benchmarks import timing as timing_calls  # noqa: E402

BACKENDS = ("jax", "tensorflow", "torch")
VARIANTS = ("chunked", "materialized", "fused", "keras-hub")
WIDTH, HEADS, FFN = 512, 8, 2048
OUT_OF_MEMORY = (  # XLA, Python, TensorFlow, PyTorch, C++
    "RESOURCE_EXHAUSTED",
    "MemoryError",
    "OOM when allocating",
    "can't allocate memory",
    "out of memory",
    "bad_alloc",
)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--backend",
        choices=[*BACKENDS, "all"],
        default=os.environ.get("KERAS_BACKEND", "jax"),
    )
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192, 16384])
    parser.add_argument("--calls", type=int, default=3, help="Timed steps a point.")
    parser.add_argument("--memory-limit-gib", type=float, default=20.0)
    parser.add_argument("--timeout", type=float, default=900.0, help="Per point, s.")
    parser.add_argument("--results", default=RESULTS)
    parser.add_argument("--point", nargs=2, metavar=("VARIANT", "LENGTH"))
    parser.add_argument(
        "--jit-compile", choices=["auto", "true", "false"], default="auto"
    )
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=VARIANTS)
    parser.add_argument("--variable-length", action="store_true")
    return parser.parse_args(argv)


def build_model(variant, length, jit_compile="auto"):
    """The block of `variant` (see the module docstring), compiled; `length`
    `None`: a variable length."""
    import keras

    import keras_attn

    if variant in ("materialized", "fused"):
        keras_attn.ops.plan.CHUNKED_FROM = math.inf
        keras_attn.ops.plan.RUNTIME_CHUNKS = ()
    inputs = keras.Input((length, WIDTH), batch_size=1)
    if variant == "keras-hub":
        import keras_hub

        block = keras_hub.layers.TransformerEncoder(FFN, HEADS)
    else:
        flash_attention = None if variant == "fused" else False
        block = keras_attn.TransformerEncoder(
            FFN, HEADS, flash_attention=flash_attention
        )
    model = keras.Model(inputs, block(inputs))
    jit_compile = {"true": True, "false": False}.get(jit_compile, jit_compile)
    model.compile(
        optimizer=keras.optimizers.Adam(1e-4), loss="mse", jit_compile=jit_compile
    )
    return model


def run_point(variant, length, steps, jit_compile="auto", variable=False):
    """One point, in this process: prints a JSON line of the measurements."""
    import numpy as np

    rng = np.random.default_rng(0)
    x, y = (rng.normal(size=(1, length, WIDTH)).astype("float32") for _ in "xy")
    model = build_model(variant, None if variable else length, jit_compile)
    if variable:  # the next step is traced again, its length unknown
        model.train_on_batch(x[:, :16], y[:, :16])
    before = memory.high_water_bytes() / 2**20
    timing = timing_calls.time_call(
        lambda: np.asarray(model.train_on_batch(x, y)), steps
    )  # JAX dispatches asynchronously: the loss is read to wait for the step
    peak = memory.high_water_bytes() / 2**20
    result = {"before_mib": before, "peak_mib": peak, "first_s": timing.first}
    print(json.dumps({**result, "median_s": timing.median}))


def measure(backend, variant, length, args):
    """Runs one point in a fresh process under the memory limit."""
    limit = int(args.memory_limit_gib * 2**30)
    command = [sys.executable, os.path.abspath(__file__), "--calls", str(args.calls)]
    command += ["--jit-compile", args.jit_compile]
    command += ["--variable-length"] if args.variable_length else []
    env = {**os.environ, "KERAS_BACKEND": backend, "PYTHONPATH": ROOT}
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    try:
        done = subprocess.run(
            [*command, "--point", variant, str(length)],
            env=env,
            capture_output=True,
            text=True,
            timeout=args.timeout,
            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (limit, limit)),
        )
    except subprocess.TimeoutExpired:
        return {"failed": f"over {args.timeout:.0f} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode == 0 and lines:
        return json.loads(lines[-1])
    log = done.stdout + done.stderr
    if done.returncode == -9 or any(word in log for word in OUT_OF_MEMORY):
        return {"failed": f"out of memory ({args.memory_limit_gib:g} GiB limit)"}
    raise RuntimeError(f"{backend} {variant} T={length} failed:\n{log[-3000:]}")


def variants(backend, chosen=VARIANTS):
    return [v for v in chosen if not (v == "fused" and backend == "tensorflow")]


def table(backend, lengths, results, args):
    lines = [
        f"### Long sequences, `KERAS_BACKEND={backend}`: one encoder block's "
        "training step (batch 1, width 512, 8 heads of 64, FFN 2048, float32)",
        "",
        f"{platform.machine()}, {os.cpu_count()} CPUs. One fresh process per "
        f"point; peak = its resident high-water mark (`VmHWM`), before = the "
        "same mark after building the model; step time = "
        f"{timing_calls.describe(args.calls)}. "
        f"`chunked` goes in chunks {chunking()}, and materializes below. "
        f"Default on this backend: {default_variant(backend)}. "
        f"`model.compile(jit_compile={args.jit_compile!r})`."
        + (
            " Variable length: `keras.Input((None, 512))`, a first step on 16 "
            "tokens before the warm-up (`--variable-length`)."
            if args.variable_length
            else ""
        ),
        "",
        "| T | variant | peak MiB | before MiB | peak vs materialized "
        "| step s | step vs materialized |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for length in lengths:
        reference = results[(length, "materialized")]
        for variant in variants(backend, args.variants):
            lines.append(row(length, variant, results[(length, variant)], reference))
    return "\n".join(lines) + "\n"


def chunking():
    from keras_attn.ops.plan import CHUNKED_FROM

    return f"from 2^{math.log2(CHUNKED_FROM):g} logits per batch row (H * T * S)"


def default_variant(backend):
    return {
        "tensorflow": "`chunked`",
        "jax": f"`chunked` on a CPU {chunking()}, else `fused`",
        "torch": "`fused`",
    }[backend]


def row(length, variant, result, reference):
    if "failed" in result:
        return f"| {length} | {variant} | {result['failed']} | | | | |"
    ratios = ["", ""]
    if "failed" not in reference:
        ratios = [
            f"{result['peak_mib'] / reference['peak_mib']:.2f}x",
            f"{result['median_s'] / reference['median_s']:.2f}x",
        ]
    return (
        f"| {length} | {variant} | {result['peak_mib']:,.0f} "
        f"| {result['before_mib']:,.0f} | {ratios[0]} "
        f"| {result['median_s']:.2f} | {ratios[1]} |"
    )


def main(argv=None):
    args = parse_args(argv)
    if args.point:
        variant, length = args.point
        return run_point(
            variant, int(length), args.calls, args.jit_compile, args.variable_length
        )
    os.makedirs(args.results, exist_ok=True)
    sections = []
    for backend in BACKENDS if args.backend == "all" else (args.backend,):
        results = {}
        for length in args.lengths:
            for variant in variants(backend, args.variants):
                results[(length, variant)] = measure(backend, variant, length, args)
                print(backend, length, variant, results[(length, variant)], flush=True)
        text = table(backend, args.lengths, results, args)
        suffix = "_variable" if args.variable_length else ""
        path = os.path.join(args.results, f"long_sequence_{backend}{suffix}.md")
        with open(path, "w") as file:
            file.write(text)
        print(text)
        sections.append(text)
    return "\n".join(sections)


if __name__ == "__main__":
    main()
