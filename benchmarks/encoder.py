"""One Transformer encoder block, side by side with the peers, in one process.

    KERAS_BACKEND=jax python benchmarks/encoder.py
    KERAS_BACKEND=tensorflow python benchmarks/encoder.py
    KERAS_BACKEND=torch python benchmarks/encoder.py

1. Training step (`train_on_batch`, Adam, MSE) and forward pass
   (`predict_on_batch`) of one block, B=8, T=256, width 256, 8 heads,
   feed-forward 1024, float32, post-norm, for `keras_attn.TransformerEncoder`,
   `keras_hub.layers.TransformerEncoder`, a block built on
   `keras.layers.MultiHeadAttention`, and native `torch.nn.TransformerEncoderLayer`
   (its own loop: Adam, MSE, `torch.no_grad` forward). Rounds interleave the
   contenders; each cell is the median. The last column is the share of the
   machine's float32 matmul peak (measured here with numpy) that the block's
   matmul FLOPs reach.
2. `keras_attn.MultiHeadAttention` forward time and peak memory (Python
   `tracemalloc` does not see backend allocators, so the resident set size
   growth of the process is used) as the sequence grows 256 -> 4096.

Results go to `benchmarks/results/encoder_<backend>.md` (or `--results DIR`)
and a PNG plot. `python benchmarks/run.py` runs this with the other benchmarks.
"""

import argparse
import os
import statistics
import time

import keras
import numpy as np

import keras_attn

B, T, WIDTH, HEADS, FFN = 8, 256, 256, 8, 1024
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def block_flops(batch, length, width, ffn):
    """Matmul FLOPs of one forward pass (projections, attention, FFN)."""
    projections = 2 * batch * length * width * width * 4
    attention = 2 * 2 * batch * length * length * width
    feedforward = 2 * 2 * batch * length * width * ffn
    return projections + attention + feedforward


def matmul_peak(size=2048, repeats=10):
    """Measured float32 matmul FLOP/s of this machine, best of numpy and backend.

    One large matmul per call, so dispatch overhead does not count.
    """
    a = np.random.default_rng(0).random((size, size), dtype="float32")
    tensor = keras.ops.convert_to_tensor(a)
    best = np.inf
    for multiply in (
        lambda: a @ a,
        lambda: keras.ops.convert_to_numpy(keras.ops.matmul(tensor, tensor)),
    ):
        multiply()
        for _ in range(repeats):
            start = time.perf_counter()
            multiply()
            best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def keras_block(kind):
    inputs = keras.Input((T, WIDTH))
    if kind == "keras_attn":
        outputs = keras_attn.TransformerEncoder(FFN, HEADS)(inputs)
    elif kind == "keras-hub":
        import keras_hub

        outputs = keras_hub.layers.TransformerEncoder(FFN, HEADS)(inputs)
    else:  # a post-norm block on keras.layers.MultiHeadAttention
        attention = keras.layers.MultiHeadAttention(HEADS, WIDTH // HEADS)
        x = keras.layers.LayerNormalization(epsilon=1e-5)(
            inputs + attention(inputs, inputs)
        )
        hidden = keras.layers.Dense(FFN, activation="relu")(x)
        outputs = keras.layers.LayerNormalization(epsilon=1e-5)(
            x + keras.layers.Dense(WIDTH)(hidden)
        )
    model = keras.Model(inputs, outputs)
    model.compile(optimizer=keras.optimizers.Adam(1e-4), loss="mse")
    return model


def keras_contender(kind, x, y):
    model = keras_block(kind)
    return {
        "train": lambda: model.train_on_batch(x, y),
        "forward": lambda: model.predict_on_batch(x),
    }


def torch_contender(x, y):
    import torch

    layer = torch.nn.TransformerEncoderLayer(
        WIDTH, HEADS, FFN, dropout=0.0, batch_first=True
    )
    optimizer = torch.optim.Adam(layer.parameters(), lr=1e-4)
    tx, ty = torch.from_numpy(x), torch.from_numpy(y)

    def train():
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(layer(tx), ty)
        loss.backward()
        optimizer.step()
        return float(loss.detach())

    def forward():
        with torch.no_grad():
            return layer(tx).numpy()

    return {"train": train, "forward": forward}


def measure(contenders, rounds, steps):
    """Interleaved rounds; median seconds per call for each contender/task."""
    times = {(name, task): [] for name in contenders for task in ("train", "forward")}
    for tasks in contenders.values():  # warm-up: compile everything
        for task in ("train", "forward"):
            tasks[task]()
            tasks[task]()
    for _ in range(rounds):
        for name, tasks in contenders.items():
            for task in ("train", "forward"):
                start = time.perf_counter()
                for _ in range(steps):
                    tasks[task]()
                times[(name, task)].append((time.perf_counter() - start) / steps)
    return {key: statistics.median(values) for key, values in times.items()}


def block_table(backend, medians, peak):
    flops = block_flops(B, T, WIDTH, FFN)
    ours = {task: medians[("keras_attn", task)] for task in ("train", "forward")}
    lines = [
        f"### One encoder block, `KERAS_BACKEND={backend}` "
        f"(B={B}, T={T}, width {WIDTH}, {HEADS} heads, FFN {FFN}, float32)",
        "",
        f"Machine float32 matmul peak (best of numpy and {backend}, one "
        f"2048x2048 matmul): {peak / 1e9:.1f} GFLOP/s.",
        "",
        "| block | train step ms | vs keras_attn | forward ms | vs keras_attn "
        "| forward % of peak |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    names = sorted({name for name, _ in medians}, key=lambda n: n != "keras_attn")
    for name in names:
        train, forward = medians[(name, "train")], medians[(name, "forward")]
        lines.append(
            f"| {name} | {train * 1e3:.1f} | {train / ours['train']:.2f}x "
            f"| {forward * 1e3:.1f} | {forward / ours['forward']:.2f}x "
            f"| {100 * flops / forward / peak:.0f}% |"
        )
    return lines


def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def scaling(lengths, flash_attention):
    """Forward time and resident memory growth of attention at each length."""
    rows = []
    for length in lengths:
        layer = keras_attn.MultiHeadAttention(
            4, key_dim=32, flash_attention=flash_attention
        )
        x = np.random.default_rng(0).random((1, length, 128), dtype="float32")
        layer(x[:, :8])
        before = rss_bytes()
        start = time.perf_counter()
        keras.ops.convert_to_numpy(layer(x, use_causal_mask=True))
        first = time.perf_counter() - start
        start = time.perf_counter()
        keras.ops.convert_to_numpy(layer(x, use_causal_mask=True))
        rows.append((length, time.perf_counter() - start, first, rss_bytes() - before))
    return rows


def scaling_table(backend, fused, explicit):
    lines = [
        "",
        f"### Causal self-attention vs sequence length, `KERAS_BACKEND={backend}` "
        "(batch 1, 4 heads of 32)",
        "",
        "Default: `flash_attention=None`, the fused kernel on JAX and PyTorch, the "
        "explicit path under TensorFlow on a CPU; explicit: `flash_attention=False` "
        "(materialized weights). Eager calls; memory is the process's RSS growth.",
        "",
        "| length | default ms | explicit ms | default RSS growth MiB "
        "| explicit RSS growth MiB |",
        "|---:|---:|---:|---:|---:|",
    ]
    for (length, f_time, _, f_mem), (_, e_time, _, e_mem) in zip(
        fused, explicit, strict=True
    ):
        lines.append(
            f"| {length} | {f_time * 1e3:.1f} | {e_time * 1e3:.1f} "
            f"| {f_mem / 2**20:.0f} | {e_mem / 2**20:.0f} |"
        )
    return lines


def plot(backend, medians, fused, explicit, results=RESULTS):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    names = sorted({name for name, _ in medians}, key=lambda n: n != "keras_attn")
    positions = np.arange(len(names))
    for offset, task in ((-0.2, "train"), (0.2, "forward")):
        left.bar(
            positions + offset,
            [medians[(n, task)] * 1e3 for n in names],
            width=0.4,
            label=task,
        )
    left.set_xticks(positions, names, rotation=15)
    left.set_ylabel("ms per step")
    left.set_title(f"Encoder block, {backend}")
    left.legend()
    lengths = [row[0] for row in fused]
    right.plot(
        lengths,
        [r[1] * 1e3 for r in fused],
        "o-",
        label="default (flash_attention=None)",
    )
    right.plot(lengths, [r[1] * 1e3 for r in explicit], "s-", label="explicit")
    right.set_xscale("log", base=2)
    right.set_yscale("log")
    right.set_xlabel("sequence length")
    right.set_ylabel("ms per forward")
    right.set_title("Causal self-attention")
    right.legend()
    figure.tight_layout()
    figure.savefig(os.path.join(results, f"encoder_{backend}.png"), dpi=100)


def main(argv=None):
    """Run the benchmark (`argv`: command-line flags); returns the markdown."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--skip-scaling", action="store_true")
    parser.add_argument("--results", default=RESULTS, help="Output folder.")
    args = parser.parse_args(argv)
    backend = keras.config.backend()
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((B, T, WIDTH)).astype("float32")
    y = rng.standard_normal((B, T, WIDTH)).astype("float32")
    contenders = {
        kind: keras_contender(kind, x, y)
        for kind in ("keras_attn", "keras-hub", "keras.layers.MultiHeadAttention")
    }
    contenders["torch.nn (native)"] = torch_contender(x, y)
    peak = matmul_peak()
    medians = measure(contenders, args.rounds, args.steps)
    lines = block_table(backend, medians, peak)
    fused = explicit = []
    if not args.skip_scaling:
        fused = scaling(args.lengths, None)
        explicit = scaling(args.lengths, False)
        lines += scaling_table(backend, fused, explicit)
    os.makedirs(args.results, exist_ok=True)
    text = "\n".join(lines) + "\n"
    with open(os.path.join(args.results, f"encoder_{backend}.md"), "w") as f:
        f.write(text)
    if fused:
        plot(backend, medians, fused, explicit, args.results)
    print(text)
    return text


if __name__ == "__main__":
    main()
