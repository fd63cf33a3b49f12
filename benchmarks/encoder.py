"""One Transformer encoder block, side by side with the peers, in one process.

    KERAS_BACKEND=jax python benchmarks/encoder.py
    KERAS_BACKEND=tensorflow python benchmarks/encoder.py
    KERAS_BACKEND=torch python benchmarks/encoder.py

1. Training step (`train_on_batch`, Adam, MSE) and forward pass
   (`predict_on_batch`) of one block, B=8, T=256, width 256, 8 heads,
   feed-forward 1024, float32, post-norm, for `keras_attn.TransformerEncoder`,
   `keras_hub.layers.TransformerEncoder`, a block built on
   `keras.layers.MultiHeadAttention`, and native `torch.nn.TransformerEncoderLayer`
   (its own loop: Adam, MSE, `torch.no_grad` forward). Each cell is the median
   of `--calls` calls after two warm-up calls, the contenders' calls
   interleaved. On PyTorch and TensorFlow a third column times the training
   step compiled (`model.compile(..., jit_compile=True)`: Inductor on PyTorch,
   XLA on TensorFlow; `torch.compile` of the native layer on PyTorch), with
   its first step (compiling) apart; on JAX every step is already XLA.
   `--no-compiled` leaves it out. The last column is the share of the
   machine's float32 matmul peak (measured here) that the block's matmul
   FLOPs reach.
2. `keras_attn.MultiHeadAttention` forward time and peak memory as the
   sequence grows 256 -> 4096, each point in a fresh process
   (`benchmarks/memory.py`).

Results go to `benchmarks/results/encoder_<backend>.md` (or `--results DIR`)
and a PNG plot. `python benchmarks/run.py` runs this with the other benchmarks.
"""

import argparse
import os
import sys

import keras
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import keras_attn  # noqa: E402
from benchmarks import memory  # noqa: E402
from benchmarks.timing import describe, time_call, time_calls  # noqa: E402

B, T, WIDTH, HEADS, FFN = 8, 256, 256, 8, 1024
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
# Every table and plot lists the blocks, and each block's steps, in this order.
BLOCKS = (
    "keras_attn",
    "keras-hub",
    "keras.layers.MultiHeadAttention",
    "torch.nn (native)",
)
TASKS = ("train", "compiled train", "forward")
WARMUP = 2  # A compiled torch step compiles again on its second call.
COMPILED_ON = ("tensorflow", "torch")  # On JAX, "auto" is already XLA.
MiB = 2**20


def block_flops(batch, length, width, ffn):
    """Matmul FLOPs of one forward pass (projections, attention, FFN)."""
    projections = 2 * batch * length * width * width * 4
    attention = 2 * 2 * batch * length * length * width
    feedforward = 2 * 2 * batch * length * width * ffn
    return projections + attention + feedforward


def matmul_peak(size=2048, calls=10):
    """Measured float32 matmul FLOP/s of this machine, best of numpy and backend.

    One large matmul per call, so dispatch overhead does not count; a peak is
    a best case, so the fastest of `calls` calls after a warm-up.
    """
    a = np.random.default_rng(0).random((size, size), dtype="float32")
    tensor = keras.ops.convert_to_tensor(a)
    timings = time_calls(
        {
            "numpy": lambda: a @ a,
            "backend": lambda: keras.ops.convert_to_numpy(
                keras.ops.matmul(tensor, tensor)
            ),
        },
        calls,
    )
    return 2 * size**3 / min(min(t.times) for t in timings.values())


def keras_block(kind, jit_compile="auto", length=T, width=WIDTH, heads=HEADS, ffn=FFN):
    """One compiled block of `kind` (a name in `BLOCKS`) on `(length, width)`
    inputs; the sizes default to this benchmark's. Raises `ImportError` for
    keras-hub where it is not installed."""
    inputs = keras.Input((length, width))
    if kind == "keras_attn":
        outputs = keras_attn.TransformerEncoder(ffn, heads)(inputs)
    elif kind == "keras-hub":
        import keras_hub

        outputs = keras_hub.layers.TransformerEncoder(ffn, heads)(inputs)
    else:  # a post-norm block on keras.layers.MultiHeadAttention
        attention = keras.layers.MultiHeadAttention(heads, width // heads)
        x = keras.layers.LayerNormalization(epsilon=1e-5)(
            inputs + attention(inputs, inputs)
        )
        hidden = keras.layers.Dense(ffn, activation="relu")(x)
        outputs = keras.layers.LayerNormalization(epsilon=1e-5)(
            x + keras.layers.Dense(width)(hidden)
        )
    model = keras.Model(inputs, outputs)
    model.compile(
        optimizer=keras.optimizers.Adam(1e-4), loss="mse", jit_compile=jit_compile
    )
    return model


def keras_contender(kind, x, y, compiled):
    """The block's steps by task; `compiled`: also a `jit_compile=True` model's
    training step (none where Keras turns it off)."""
    model = keras_block(kind)
    tasks = {
        "train": lambda: model.train_on_batch(x, y),
        "forward": lambda: model.predict_on_batch(x),
    }
    if compiled:
        jitted = keras_block(kind, jit_compile=True)
        if jitted.jit_compile:
            tasks["compiled train"] = lambda: jitted.train_on_batch(x, y)
    return tasks


def torch_contender(x, y, compiled):
    """`torch.nn.TransformerEncoderLayer` in its own loop; `compiled`: also a
    training step of a `torch.compile`d copy (Adam's step eager)."""
    import torch

    def layer():
        return torch.nn.TransformerEncoderLayer(
            WIDTH, HEADS, FFN, dropout=0.0, batch_first=True
        )

    tx, ty = torch.from_numpy(x), torch.from_numpy(y)
    eager = layer()

    def forward():
        with torch.no_grad():
            return eager(tx).numpy()

    tasks = {"train": torch_train_step(eager, tx, ty), "forward": forward}
    if compiled:
        tasks["compiled train"] = torch_train_step(torch.compile(layer()), tx, ty)
    return tasks


def torch_train_step(module, tx, ty, autocast=None):
    """A training step of `module` on `(tx, ty)` (Adam, MSE) that returns the
    loss as a float, so it returns once the step is done (on CUDA too);
    `autocast`: a torch dtype the forward pass runs in under `torch.autocast`."""
    import torch

    optimizer = torch.optim.Adam(module.parameters(), lr=1e-4)
    enabled = autocast is not None

    def train():
        optimizer.zero_grad()
        with torch.autocast(tx.device.type, dtype=autocast, enabled=enabled):
            loss = torch.nn.functional.mse_loss(module(tx), ty)
        loss.backward()
        optimizer.step()
        return float(loss.detach())

    return train


def measure(contenders, calls):
    """`Timing`s by (block, task), every step's calls interleaved."""
    steps = {
        (name, task): tasks[task]
        for name, tasks in contenders.items()
        for task in TASKS
        if task in tasks
    }
    return time_calls(steps, calls, WARMUP)


def compiled_caption(backend, compiled):
    """What the compiled column is on `backend`, or why there is none."""
    if backend == "jax":
        return (
            'No compiled column: on JAX `jit_compile="auto"` already compiles '
            "every step with XLA."
        )
    if not compiled:
        return "No compiled column (`--no-compiled`)."
    compiler = {"torch": "Inductor", "tensorflow": "XLA"}[backend]
    auto = {"torch": "eager", "tensorflow": "a `tf.function` graph, without XLA"}
    native = {
        "torch": "for torch.nn, `torch.compile` of the layer (Adam's step eager)",
        "tensorflow": "torch.nn's is in the PyTorch table",
    }
    return (
        f"Compiled: `model.compile(..., jit_compile=True)` ({compiler}; "
        f'`"auto"`, the train step column, is {auto[backend]} here); '
        f"{native[backend]}. Its first step, compiling included, is apart and "
        "not in the median."
    )


def block_table(backend, timings, peak, calls):
    medians = {key: timing.median for key, timing in timings.items()}
    compiled = any(task == "compiled train" for _, task in medians)
    flops = block_flops(B, T, WIDTH, FFN)
    ours = {task: medians[("keras_attn", task)] for task in ("train", "forward")}
    lines = [
        f"### One encoder block, `KERAS_BACKEND={backend}` "
        f"(B={B}, T={T}, width {WIDTH}, {HEADS} heads, FFN {FFN}, float32)",
        "",
        f"Machine float32 matmul peak (best of numpy and {backend}, one "
        f"2048x2048 matmul, fastest of 10 calls): {peak / 1e9:.1f} GFLOP/s. "
        f"Each step: {describe(calls, WARMUP)}, the blocks' calls interleaved. "
        + compiled_caption(backend, compiled),
        "",
    ]
    columns = ["block", "train step ms", "vs keras_attn"]
    if compiled:
        columns += ["compiled train step ms", "vs train step", "first compiled step s"]
    columns += ["forward ms", "vs keras_attn", "forward % of peak"]
    lines += ["| " + " | ".join(columns) + " |", "|---|" + "---:|" * (len(columns) - 1)]
    for name in BLOCKS:
        train, forward = medians[(name, "train")], medians[(name, "forward")]
        cells = [name, f"{train * 1e3:.1f}", f"{train / ours['train']:.2f}x"]
        if compiled:
            cells += compiled_cells(timings.get((name, "compiled train")), train)
        cells += [
            f"{forward * 1e3:.1f}",
            f"{forward / ours['forward']:.2f}x",
            f"{100 * flops / forward / peak:.0f}%",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def compiled_cells(timing, eager):
    if timing is None:
        return ["-", "-", "-"]
    median = timing.median
    return [f"{median * 1e3:.1f}", f"{median / eager:.2f}x", f"{timing.first:.1f}"]


def scaling_point(length, flash_attention, calls):
    """Causal self-attention at one length, on one path, in this process:
    median and first-call seconds, and the peak memory the calls add."""
    layer = keras_attn.MultiHeadAttention(
        4, key_dim=32, flash_attention=flash_attention
    )
    x = np.random.default_rng(0).random((1, length, 128), dtype="float32")
    layer(x[:, :8])  # Builds the weights before the measurement.

    def call():
        return keras.ops.convert_to_numpy(layer(x, use_causal_mask=True))

    timing, peak = memory.peak_growth(lambda: time_call(call, calls))
    return {"median": timing.median, "first": timing.first, "peak": peak}


def scaling(lengths, calls):
    """{path: [point, ...]}: each length on each path in a fresh process."""
    backend = keras.config.backend()
    return {
        path: [
            memory.in_fresh_process(
                scaling_point, length, flash_attention, calls, backend=backend
            )
            for length in lengths
        ]
        for path, flash_attention in (("default", None), ("explicit", False))
    }


def scaling_table(backend, lengths, points, calls):
    lines = [
        "",
        f"### Causal self-attention vs sequence length, `KERAS_BACKEND={backend}` "
        "(batch 1, 4 heads of 32)",
        "",
        "Default: `flash_attention=None`, the fused kernel on JAX and PyTorch, the "
        "explicit path under TensorFlow on a CPU; explicit: `flash_attention=False`. "
        "The explicit path goes in chunks of query rows from 2^26 logits per batch "
        "row (4096 tokens here; on a CPU, JAX's default then too), a memory gain "
        "in training (`long_sequence_<backend>.md`) rather than in these forward "
        f"calls. Eager calls, {describe(calls)}, each point in "
        "a fresh process. Peak: how far the process's resident high-water mark "
        "(Linux `VmHWM`, reset just before) rises above its resident size over "
        "the warm-up and timed calls, the first call's compiling included.",
        "",
        "| length | default ms | explicit ms | default peak MiB | explicit peak MiB |",
        "|---:|---:|---:|---:|---:|",
    ]
    for length, default, explicit in zip(
        lengths, points["default"], points["explicit"], strict=True
    ):
        pair = (default, explicit)
        cells = [str(length)] + [f"{p['median'] * 1e3:.1f}" for p in pair]
        cells += [
            "n/a" if p["peak"] is None else f"{p['peak'] / MiB:.0f}" for p in pair
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


PLOT_LABELS = {
    "keras_attn": "keras_attn",
    "keras-hub": "keras-hub",
    "keras.layers.MultiHeadAttention": "Keras\nMultiHeadAttention",
    "torch.nn (native)": "torch.nn\n(native)",
    "train": "train step",
    "compiled train": "train step, compiled",
    "forward": "forward",
    "default": "default (flash_attention=None)",
    "explicit": "explicit (flash_attention=False)",
}


def plot(backend, timings, lengths, points, results=RESULTS):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(
        1, 3, figsize=(16, 4.8), width_ratios=(1.4, 1, 1), layout="constrained"
    )
    figure.suptitle(f"KERAS_BACKEND={backend}")
    plot_blocks(axes[0], timings)
    for ax, key, unit, title in (
        (axes[1], "median", 1e3, "ms per forward"),
        (axes[2], "peak", 1 / MiB, "peak memory, MiB"),
    ):
        plot_scaling(ax, lengths, points, key, unit)
        if key == "median":  # 1, 2, 5, 10, 20, ... ms
            ax.set_yscale("log")
            ax.yaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1, 2, 5)))
            ax.yaxis.set_major_formatter(matplotlib.ticker.StrMethodFormatter("{x:g}"))
            ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        else:
            ax.set_ylim(bottom=0)
        ax.set_ylabel(title)
        ax.set_title(f"Causal self-attention: {title}")
    figure.savefig(os.path.join(results, f"encoder_{backend}.png"), dpi=100)
    plt.close(figure)


def plot_blocks(ax, timings):
    """Grouped bars: the blocks in `BLOCKS` order, their steps in `TASKS` order
    and colours, whichever steps this backend measured."""
    tasks = [task for task in TASKS if any(t == task for _, t in timings)]
    width = 0.8 / len(tasks)
    positions = np.arange(len(BLOCKS))
    for i, task in enumerate(tasks):
        heights = [
            timings[(name, task)].median * 1e3 if (name, task) in timings else np.nan
            for name in BLOCKS
        ]
        bars = ax.bar(
            positions + (i - (len(tasks) - 1) / 2) * width,
            heights,
            width=width,
            color=f"C{TASKS.index(task)}",
            label=PLOT_LABELS[task],
        )
        labels = ["" if np.isnan(h) else f"{h:.0f}" for h in heights]
        ax.bar_label(bars, labels, fontsize=7, padding=1)
    ax.set_xticks(positions, [PLOT_LABELS[name] for name in BLOCKS])
    ax.set_ylabel("ms per step (median)")
    ax.set_title(f"Encoder block, B={B}, T={T}")
    ax.margins(y=0.12)  # Room for the bar labels.
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), ncols=len(tasks))


def plot_scaling(ax, lengths, points, key, unit):
    for path, marker in (("default", "o-"), ("explicit", "s-")):
        values = [np.nan if p[key] is None else p[key] * unit for p in points[path]]
        ax.plot(lengths, values, marker, label=PLOT_LABELS[path])
    ax.set_xscale("log", base=2)
    ax.set_xticks(lengths, [str(n) for n in lengths])
    ax.minorticks_off()
    ax.set_xlabel("sequence length")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16))


def main(argv=None):
    """Run the benchmark (`argv`: command-line flags); returns the markdown."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=10, help="Timed calls a point.")
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--skip-scaling", action="store_true")
    parser.add_argument("--no-compiled", action="store_true")
    parser.add_argument("--results", default=RESULTS, help="Output folder.")
    args = parser.parse_args(argv)
    backend = keras.config.backend()
    compiled = backend in COMPILED_ON and not args.no_compiled
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((B, T, WIDTH)).astype("float32")
    y = rng.standard_normal((B, T, WIDTH)).astype("float32")
    contenders = {kind: keras_contender(kind, x, y, compiled) for kind in BLOCKS[:3]}
    contenders[BLOCKS[3]] = torch_contender(x, y, compiled and backend == "torch")
    peak = matmul_peak()
    timings = measure(contenders, args.calls)
    lines = block_table(backend, timings, peak, args.calls)
    if not args.skip_scaling:
        points = scaling(args.lengths, args.calls)
        lines += scaling_table(backend, args.lengths, points, args.calls)
    os.makedirs(args.results, exist_ok=True)
    text = "\n".join(lines) + "\n"
    with open(os.path.join(args.results, f"encoder_{backend}.md"), "w") as f:
        f.write(text)
    if not args.skip_scaling:
        plot(backend, timings, args.lengths, points, args.results)
    print(text)
    return text


if __name__ == "__main__":
    main()
