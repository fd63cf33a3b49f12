"""What a PyTorch step costs beyond its arithmetic, against native torch.

    KERAS_BACKEND=torch OMP_NUM_THREADS=1 python benchmarks/torch_overhead.py

At tiny shapes (batch 2, T=16, width 64, 4 heads, feed-forward 128, float32)
a step's arithmetic takes microseconds, so on a CPU its time is Python and
operator dispatch: a proxy for the time of a launch-bound step on a GPU. Per
step, for:

1. `keras_attn.TransformerEncoder` (post-norm): the forward pass (the layer
   called with `training=False` under `torch.no_grad`) and a training step
   (`train_on_batch` of a compiled `keras.Model`, Adam, MSE; eager, Keras'
   `jit_compile="auto"` on PyTorch);
2. `keras_hub.layers.TransformerEncoder`, the same;
3. native `torch.nn.TransformerEncoderLayer` (batch first, dropout 0), its
   module in training mode as in `benchmarks/encoder.py` (so the same
   composed ops as ours; `eval()` would take its fused inference path, timed
   in an extra row), and a hand-written step (forward, MSE, backward, Adam);
4. one new token of greedy generation with the decoder-only model of
   `benchmarks/generation.py` (2 pre-norm `keras_attn.TransformerDecoder`
   blocks, vocabulary 1000, batch 2, an 8-token prompt) through
   `keras_attn.generation.generate`, against a hand-written decoder of the
   same sizes with a static cache (`nn.Linear`s, a fused QKV projection,
   `F.scaled_dot_product_attention`, keys and values written in place into a
   preallocated cache); per token: (a call of N new tokens - a call of 1) /
   (N - 1).

Columns: the median time (`benchmarks/timing.py`, every row's calls
interleaved), the aten ops a step runs (`torch.profiler`, every `aten::` event,
nested ones included, and those called from outside any other aten op,
the ones Python or autograd dispatches), and the share of the profiled step
spent outside aten ops (Python, Keras and the dispatcher; the profiler's own
overhead inflates both sides). Ratios are against the native row of the same
run. `--quick` is a smoke run (two calls a row, its numbers mean nothing).

Results go to `benchmarks/results/torch_overhead.md` (or `--results DIR`).
"""

import argparse
import math
import os
import platform
import sys
import time

import keras
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import keras_attn  # noqa: E402
from benchmarks import generation as decoding  # noqa: E402
from benchmarks.report import write_report
from benchmarks.timing import describe, time_calls  # noqa: E402
from keras_attn.generation import generate  # noqa: E402

B, T, WIDTH, HEADS, FFN = 2, 16, 64, 4, 128
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
NATIVE = "torch.nn (native)"
NATIVE_DECODER = "torch static cache (native)"
ENCODERS = ("keras_attn", "keras-hub", NATIVE)
TASKS = ("forward", "train step")
GENERATED = "new token"


# The contenders: functions of no arguments that return once the step is done.


def keras_encoder(kind):
    """A compiled one-block model of `kind` ("keras_attn" or "keras-hub") and
    its block."""
    if kind == "keras_attn":
        block = keras_attn.TransformerEncoder(FFN, HEADS)
    else:
        import keras_hub

        block = keras_hub.layers.TransformerEncoder(FFN, HEADS)
    inputs = keras.Input((T, WIDTH))
    model = keras.Model(inputs, block(inputs))
    model.compile(optimizer=keras.optimizers.Adam(1e-4), loss="mse")
    return model, block


def keras_steps(kind, x, y):
    import torch

    model, block = keras_encoder(kind)
    tx = torch.from_numpy(x)

    def forward():
        with torch.no_grad():
            return keras.ops.convert_to_numpy(block(tx, training=False))

    return {"forward": forward, "train step": lambda: model.train_on_batch(x, y)}


def native_steps(x, y):
    """`torch.nn.TransformerEncoderLayer`: forward and training step (the
    module in training mode, dropout 0), and the forward of an `eval()` copy,
    which takes torch's fused inference path."""
    import torch

    from benchmarks.encoder import torch_train_step

    def layer():
        return torch.nn.TransformerEncoderLayer(
            WIDTH, HEADS, FFN, dropout=0.0, batch_first=True
        )

    tx, ty = torch.from_numpy(x), torch.from_numpy(y)
    module, fast = layer(), layer().eval()

    def forward(module):
        with torch.no_grad():
            return module(tx).numpy()

    return {
        "forward": lambda: forward(module),
        "train step": torch_train_step(module, tx, ty),
    }, lambda: forward(fast)


def native_decoder():
    """A GPT-style decoder of `benchmarks/generation.py`'s sizes with a
    static key/value cache, as one writes it by hand in torch."""
    import torch
    from torch import nn
    from torch.nn import functional as F

    class Block(nn.Module):
        def __init__(self, cache_length):
            super().__init__()
            width, heads = decoding.WIDTH, decoding.HEADS
            self.heads, self.head_dim = heads, width // heads
            self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
            self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)
            self.up = nn.Linear(width, decoding.FFN)
            self.down = nn.Linear(decoding.FFN, width)
            shape = (decoding.BATCH, heads, cache_length, self.head_dim)
            self.register_buffer("keys", torch.zeros(shape), persistent=False)
            self.register_buffer("values", torch.zeros(shape), persistent=False)

        def forward(self, x, start):
            batch, length, width = x.shape
            q, k, v = (
                t.view(batch, length, self.heads, self.head_dim).transpose(1, 2)
                for t in self.qkv(self.norm1(x)).split(width, dim=-1)
            )  # (B, H, L, Dh) each
            end = start + length
            self.keys[:, :, start:end] = k  # in place
            self.values[:, :, start:end] = v
            attended = F.scaled_dot_product_attention(
                q, self.keys[:, :, :end], self.values[:, :, :end], is_causal=start == 0
            )
            x = x + self.out(attended.transpose(1, 2).reshape(batch, length, width))
            return x + self.down(F.relu(self.up(self.norm2(x))))

    class Decoder(nn.Module):
        def __init__(self, cache_length):
            super().__init__()
            width = decoding.WIDTH
            self.embedding = nn.Embedding(decoding.VOCAB, width)
            self.register_buffer("positions", sinusoids(cache_length, width))
            self.blocks = nn.ModuleList(
                Block(cache_length) for _ in range(decoding.LAYERS)
            )
            self.norm = nn.LayerNorm(width)
            self.head = nn.Linear(width, decoding.VOCAB)

        def forward(self, ids, start):
            end = start + ids.shape[1]
            x = self.embedding(ids) * math.sqrt(decoding.WIDTH)
            x = x + self.positions[start:end]
            for block in self.blocks:
                x = block(x, start)
            return self.head(self.norm(x[:, -1]))  # (B, V), the last position's

    def sinusoids(length, width):
        position = torch.arange(length, dtype=torch.float32)[:, None]
        rates = torch.exp(torch.arange(0, width, 2) * (-math.log(10000.0) / width))
        table = torch.zeros(length, width)
        table[:, 0::2], table[:, 1::2] = (
            f(position * rates) for f in (torch.sin, torch.cos)
        )
        return table

    return Decoder


def native_generate(decoder, prompt, new_tokens):
    """Greedy tokens `(batch, width + new_tokens)` as numpy: the prompt, then
    one decoder step per new token, its token written into a preallocated
    buffer."""
    import torch

    width = prompt.shape[1]
    tokens = torch.zeros(prompt.shape[0], width + new_tokens, dtype=torch.long)
    tokens[:, :width] = prompt
    with torch.no_grad():
        logits = decoder(tokens[:, :width], 0)
        for index in range(width, width + new_tokens):
            token = logits.argmax(-1, keepdim=True)  # (B, 1)
            tokens[:, index : index + 1] = token
            logits = decoder(token, index)
    return tokens.numpy()


def generation_steps(new_tokens):
    """{row: (generate N new tokens, generate 1)}."""
    import torch

    keras.utils.set_random_seed(0)
    model = decoding.keras_attn_model()
    prompt = np.random.default_rng(0).integers(
        1, decoding.VOCAB, (decoding.BATCH, decoding.PROMPT), dtype="int32"
    )
    native = native_decoder()(decoding.PROMPT + new_tokens).eval()
    native_prompt = torch.from_numpy(prompt).long()

    def ours(n):
        return lambda: generate(model, prompt, max_new_tokens=n)

    def theirs(n):
        return lambda: native_generate(native, native_prompt, n)

    return {
        "keras_attn generate": (ours(new_tokens), ours(1)),
        NATIVE_DECODER: (theirs(new_tokens), theirs(1)),
    }


# Counting aten ops.


def profiled(function, steps):
    """`(aten ops, top-level aten ops, seconds in top-level aten ops, seconds)`
    of `steps` calls of `function` under `torch.profiler` (CPU)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            function()
        seconds = time.perf_counter() - start
    events = [e for e in prof.events() if e.name.startswith("aten::")]
    top = [e for e in events if not _inside_aten_op(e)]
    in_ops = sum(e.cpu_time_total for e in top) / 1e6  # microseconds
    return np.array([len(events), len(top), in_ops, seconds], "float64")


def _inside_aten_op(event):
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("aten::"):
            return True
        parent = parent.cpu_parent
    return False


def profile_step(function, steps):
    """Per step: `{ops, top, outside}` (outside: the share of the profiled
    time spent outside aten ops)."""
    ops, top, in_ops, seconds = profiled(function, steps) / steps
    return {"ops": ops, "top": top, "outside": 1 - in_ops / seconds}


def profile_token(many, one, new_tokens, steps):
    """`profile_step`'s numbers per new token: (N tokens - 1 token) / (N - 1)."""
    ops, top, in_ops, seconds = (profiled(many, steps) - profiled(one, steps)) / (
        steps * (new_tokens - 1)
    )
    return {"ops": ops, "top": top, "outside": 1 - in_ops / seconds}


# The program.


def measure(calls, steps, new_tokens, warmup):
    """Rows `(task, contender, median seconds, profile)`, in table order."""
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((B, T, WIDTH)).astype("float32")
    y = rng.standard_normal((B, T, WIDTH)).astype("float32")
    contenders = {kind: keras_steps(kind, x, y) for kind in ENCODERS[:2]}
    contenders[NATIVE], fast = native_steps(x, y)
    functions = {}
    for task in TASKS:
        for name, steps_ in contenders.items():
            functions[(task, name)] = steps_[task]
        if task == "forward":
            functions[(task, f"{NATIVE}, eval() fast path")] = fast
    generators = generation_steps(new_tokens)
    for name, (many, one) in generators.items():
        functions[(GENERATED, name, "many")] = many
        functions[(GENERATED, name, "one")] = one
    timings = time_calls(functions, calls, warmup)
    rows = []
    for key, function in functions.items():
        if key[0] != GENERATED:
            rows.append((*key, timings[key].median, profile_step(function, steps)))
        elif key[2] == "many":
            many, one = timings[key], timings[(*key[:2], "one")]
            seconds = (many.median - one.median) / (new_tokens - 1)
            profile = profile_token(*generators[key[1]], new_tokens, steps)
            rows.append((*key[:2], seconds, profile))
    return rows


def table(rows, native=None, first="step", unit=("ms", 1e3, 3)):
    """Markdown lines: one row per (task, contender), ratios against the
    task's native row. `native`: `{task: (seconds, profile)}`, by default
    the rows named `NATIVE` or `NATIVE_DECODER`; `first`: the first
    column's name; `unit`: the time column's `(name, scale, decimals)`."""
    if native is None:
        native = {
            task: (seconds, profile)
            for task, name, seconds, profile in rows
            if name in (NATIVE, NATIVE_DECODER)
        }
    name, scale, decimals = unit
    lines = [
        f"| {first} | contender | {name} | time vs native | aten ops "
        "| ops vs native | top-level aten ops | outside aten ops |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for task, contender, seconds, profile in rows:
        base_seconds, base = native[task]
        lines.append(
            f"| {task} | {contender} | {seconds * scale:.{decimals}f} "
            f"| {ratio(seconds, base_seconds)} | {profile['ops']:.0f} "
            f"| {ratio(profile['ops'], base['ops'])} | {profile['top']:.0f} "
            f"| {100 * profile['outside']:.0f}% |"
        )
    return lines


def ratio(value, reference):
    """`value / reference` as `1.23x`; `-` for a reference of 0."""
    return f"{value / reference:.2f}x" if reference else "-"


def machine():
    """The CPU, its cores and threads, and the versions, in words."""
    import torch

    from benchmarks.gpu import versions

    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            names = [line for line in f if line.startswith("model name")]
        model = names[0].split(":", 1)[1].strip()
    except (OSError, IndexError):
        pass
    return (
        f"{model}, {os.cpu_count()} cores visible, {torch.get_num_threads()} torch "
        f"thread(s) (OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}); "
        + versions()
    )


def contention(load):
    """A line on how busy the machine was: the highest 1-minute load average
    seen (at the start and the end) against the cores."""
    cores = os.cpu_count()
    line = f"Load average (1 minute, highest seen): {load:.1f} on {cores} cores"
    if load <= cores - 0.5:
        return line + "."
    return (
        line + ": the cores were shared with other work, so the times were "
        "taken under contention (the ratios of interleaved rows hold better "
        "than the times). Aten op counts are exact regardless."
    )


def main(argv=None):
    """Run the benchmark (`argv`: command-line flags); returns the markdown."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=200, help="Timed calls a row.")
    parser.add_argument("--steps", type=int, default=20, help="Profiled steps.")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--quick", action="store_true", help="A smoke run.")
    parser.add_argument("--results", default=RESULTS, help="Output folder.")
    args = parser.parse_args(argv)
    if keras.config.backend() != "torch":
        parser.error("run it with KERAS_BACKEND=torch")
    calls, steps, new_tokens, warmup = (
        (2, 1, 3, 1) if args.quick else (args.calls, args.steps, args.new_tokens, 5)
    )
    load = os.getloadavg()[0]
    # A CPU benchmark on any machine: on a GPU, Keras would put its weights
    # there and the native peers' tensors would stay here (the H100 run of
    # 2026-11-28 mixed the two and failed).
    with keras.device("cpu"):
        rows = measure(calls, steps, new_tokens, warmup)
    load = max(load, os.getloadavg()[0])
    command = "KERAS_BACKEND=torch OMP_NUM_THREADS=" + os.environ.get(
        "OMP_NUM_THREADS", "<unset>"
    )
    command += " python benchmarks/torch_overhead.py " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    lines = [
        f"### PyTorch overhead at tiny shapes (B={B}, T={T}, width {WIDTH}, "
        f"{HEADS} heads, FFN {FFN}, float32), CPU",
        "",
        f"Machine: {machine()}.",
        "",
        f"Command: `{command.strip()}`.",
        "",
        f"Each time: {describe(calls, warmup)}, every row's calls interleaved; "
        f"new token: (a `generate` call of {new_tokens} new tokens - one of 1) "
        f"/ {new_tokens - 1}, batch {decoding.BATCH}, prompt {decoding.PROMPT}, "
        f"{decoding.LAYERS} blocks, vocabulary {decoding.VOCAB}. Aten ops: "
        f"`torch.profiler` events per step over {steps} profiled step(s) "
        "(all `aten::` events, nested included; top-level: those not inside "
        "another aten op). Outside aten ops: the share of the profiled time "
        "not inside a top-level aten op (Python, Keras, the dispatcher; the "
        "profiler inflates it). Ratios: against the native row of the same "
        "step in this run. Forward: no gradients (`torch.no_grad`); native "
        "forward: the module in training mode (dropout 0, the composed ops), "
        "its `eval()` fused path in its own row.",
    ]
    if args.quick:
        lines += ["", "Smoke run (`--quick`): these numbers mean nothing."]
    lines += ["", contention(load)]
    lines += ["", *table(rows)]
    text = "\n".join(lines) + "\n"
    return write_report(args.results, "torch_overhead.md", text)


if __name__ == "__main__":
    main()
