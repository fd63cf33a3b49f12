"""What Keras itself costs a PyTorch step, whatever the layers: the part of
keras_attn's overhead that keras_attn cannot remove.

    KERAS_BACKEND=torch OMP_NUM_THREADS=1 python benchmarks/keras_costs.py

Three pieces of Keras run in every training step of a Keras model on PyTorch.
Each is timed at tiny shapes (float32, a CPU: the time is Python and operator
dispatch, the proxy for a launch-bound GPU step, as in
`benchmarks/torch_overhead.py`) against what a torch user writes instead:

1. optimizer apply: one `keras.optimizers.Adam.apply(gradients, variables)`
   (under `torch.no_grad`, as Keras' trainer calls it) on the trainable
   variables of a built `keras_attn.TransformerEncoder(128, 4)` at width 64,
   against one `torch.optim.Adam(foreach=True).step()` (the implementation
   torch picks on CUDA) on tensors of the same shapes;
2. layer call: an empty layer (its `call` returns its input) called on a torch
   tensor through `keras.layers.Layer.__call__`, against its `call` called
   directly and a plain Python function;
3. train step: `train_on_batch` of a compiled one-`Dense` model (64 to 64,
   batch 2, Adam, MSE) on torch tensors, against the same model and optimizer
   stepped by hand (the body of Keras' torch `train_step`: `zero_grad`, the
   forward pass, MSE as one `keras.ops` expression, `backward()`,
   `optimizer.apply`), and against a hand-written torch step (`nn.Linear`,
   `F.mse_loss`, `backward()`, `torch.optim.Adam(foreach=True)`); each
   returns the loss as a float. `train_on_batch` minus the step by hand is
   Keras' trainer (data adapter, loss and metric trackers, logs).

Columns: the median time per call (`benchmarks/timing.py`, every row's calls
interleaved; a layer call is timed 100 at a time), aten ops per call
(`torch.profiler`, every `aten::` event, nested ones included; top-level: those
not inside another aten op) and the share of the profiled time outside aten ops,
as in `benchmarks/torch_overhead.py`. Ratios are against each piece's native
row (its last). On a CPU a `torch._foreach_*` op runs one aten op per tensor
inside it (on CUDA: one fused op), so the optimizer's counts do not carry over
to a GPU. `--quick` is a smoke run (two calls a row, its numbers mean nothing).

Results go to `benchmarks/results/keras_costs.md` (or `--results DIR`).
"""

import argparse
import os
import sys

import keras
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import keras_attn  # noqa: E402
from benchmarks.report import write_report
from benchmarks.timing import describe, time_calls  # noqa: E402
from benchmarks.torch_overhead import (  # noqa: E402
    contention,
    machine,
    profile_step,
)
from benchmarks.torch_overhead import table as overhead_table  # noqa: E402

B, T, WIDTH, HEADS, FFN = 2, 16, 64, 4, 128
LAYER_CALLS = 100  # a layer call's time is that of 100 calls / 100
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
OPTIMIZER, LAYER, TRAIN = "optimizer apply", "layer call", "train step"


def optimizer_steps(rng):
    """{row: one Adam update}: Keras' on a keras_attn encoder's variables,
    torch's on tensors of the same shapes and gradients."""
    import torch

    encoder = keras_attn.TransformerEncoder(FFN, HEADS)
    encoder.build((B, T, WIDTH))
    variables = encoder.trainable_variables
    shapes = [tuple(variable.shape) for variable in variables]
    gradients = [torch.from_numpy(rng.standard_normal(s, "float32")) for s in shapes]
    adam = keras.optimizers.Adam(1e-4)
    adam.build(variables)
    params = [torch.nn.Parameter(torch.zeros(shape)) for shape in shapes]
    for param, gradient in zip(params, gradients, strict=True):
        param.grad = gradient.clone()
    native = torch.optim.Adam(params, lr=1e-4, foreach=True)

    def apply():
        with torch.no_grad():
            adam.apply(gradients, variables)

    name = f"keras.optimizers.Adam.apply, {len(variables)} variables"
    return {name: apply, "torch.optim.Adam(foreach=True).step (native)": native.step}


class Empty(keras.layers.Layer):
    """A layer that does nothing: `call` returns its input."""

    def call(self, inputs):
        return inputs


def identity(inputs):
    return inputs


def layer_calls():
    """{row: `LAYER_CALLS` calls}: an empty layer through `__call__`, its
    `call`, and a Python function."""
    import torch

    x = torch.zeros(B, WIDTH)
    layer = Empty()
    layer(x)  # Builds it.

    def calls(function):
        def run():
            for _ in range(LAYER_CALLS):
                function(x)

        return run

    return {
        "keras.layers.Layer.__call__ (empty layer)": calls(layer),
        "the layer's call() directly": calls(layer.call),
        "a Python function (native)": calls(identity),
    }


def dense_model():
    """A compiled `keras.Model`: one `Dense(WIDTH)`, Adam, MSE."""
    inputs = keras.Input((WIDTH,))
    model = keras.Model(inputs, keras.layers.Dense(WIDTH)(inputs))
    model.compile(optimizer=keras.optimizers.Adam(1e-4), loss="mse")
    return model


def train_steps(rng):
    """{row: one training step returning the loss as a float}."""
    import torch

    x, y = (torch.from_numpy(rng.standard_normal((B, WIDTH), "float32")) for _ in "xy")
    trained, by_hand = dense_model(), dense_model()

    def keras_step():  # The body of keras/src/backend/torch/trainer.py's train_step.
        by_hand.zero_grad()
        loss = keras.ops.mean(keras.ops.square(by_hand(x, training=True) - y))
        loss.backward()
        variables = by_hand.trainable_variables
        with torch.no_grad():
            by_hand.optimizer.apply([v.value.grad for v in variables], variables)
        return float(loss.detach())

    linear = torch.nn.Linear(WIDTH, WIDTH)
    native = torch.optim.Adam(linear.parameters(), lr=1e-4, foreach=True)

    def torch_step():
        native.zero_grad()
        loss = torch.nn.functional.mse_loss(linear(x), y)
        loss.backward()
        native.step()
        return float(loss.detach())

    return {
        "Model.train_on_batch": lambda: trained.train_on_batch(x, y),
        "the same Keras step by hand": keras_step,
        "torch.nn.Linear + torch.optim.Adam(foreach=True) (native)": torch_step,
    }


def measure(calls, steps, warmup):
    """Rows `(piece, contender, seconds per call, profile per call)`."""
    rng = np.random.default_rng(0)  # (Keras' seed would import TensorFlow: 3 s)
    pieces = {
        OPTIMIZER: optimizer_steps(rng),
        LAYER: layer_calls(),
        TRAIN: train_steps(rng),
    }
    functions = {
        (piece, name): function
        for piece, rows in pieces.items()
        for name, function in rows.items()
    }
    timings = time_calls(functions, calls, warmup)
    rows = []
    for (piece, name), function in functions.items():
        per = LAYER_CALLS if piece == LAYER else 1
        profile = profile_step(function, steps)
        profile = {**profile, "ops": profile["ops"] / per, "top": profile["top"] / per}
        rows.append((piece, name, timings[(piece, name)].median / per, profile))
    return rows


def table(rows):
    """Markdown lines: a row per (piece, contender), ratios against the
    piece's native row (its last)."""
    reference = {piece: (seconds, profile) for piece, _, seconds, profile in rows}
    return overhead_table(rows, reference, "piece", ("µs per call", 1e6, 1))


def summary(rows):
    """One line: what each piece of Keras adds per call, in microseconds."""
    by = {piece: [] for piece, *_ in rows}
    for piece, _, seconds, _ in rows:
        by[piece].append(seconds * 1e6)
    adam, native_adam = by[OPTIMIZER]
    call, direct, function = by[LAYER]
    trainer, hand, native_step = by[TRAIN]
    return (
        f"Keras adds, per call: Adam's apply {adam - native_adam:.0f} µs over "
        f"torch's ({adam / native_adam:.1f}x); `Layer.__call__` {call - function:.1f}"
        f" µs over a function call; `train_on_batch` {trainer - hand:.0f} µs "
        f"over the same step by hand, which is {hand - native_step:.0f} µs over "
        "native torch's."
    )


def main(argv=None):
    """Run the benchmark (`argv`: command-line flags); returns the markdown."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=200, help="Timed calls a row.")
    parser.add_argument("--steps", type=int, default=20, help="Profiled calls.")
    parser.add_argument("--quick", action="store_true", help="A smoke run.")
    parser.add_argument("--results", default=RESULTS, help="Output folder.")
    args = parser.parse_args(argv)
    if keras.config.backend() != "torch":
        parser.error("run it with KERAS_BACKEND=torch")
    calls, steps, warmup = (2, 1, 1) if args.quick else (args.calls, args.steps, 5)
    load = os.getloadavg()[0]
    # A CPU benchmark on any machine: on a GPU, Keras would put its weights
    # there and the native peers' tensors would stay here (the H100 run of
    # 2026-11-28 mixed the two and failed).
    with keras.device("cpu"):
        rows = measure(calls, steps, warmup)
    load = max(load, os.getloadavg()[0])
    command = "KERAS_BACKEND=torch OMP_NUM_THREADS=" + os.environ.get(
        "OMP_NUM_THREADS", "<unset>"
    )
    command += " python benchmarks/keras_costs.py " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    lines = [
        "### What Keras costs a PyTorch step, at tiny shapes, CPU",
        "",
        f"Machine: {machine()}.",
        "",
        f"Command: `{command.strip()}`.",
        "",
        f"Each time: {describe(calls, warmup)} per row, every row's calls "
        f"interleaved; a layer call: {LAYER_CALLS} calls timed together / "
        f"{LAYER_CALLS}. Optimizer apply: the trainable variables of "
        f"`keras_attn.TransformerEncoder({FFN}, {HEADS})` built at width {WIDTH}. "
        f"Train step: one `Dense({WIDTH})`, batch {B}, torch tensors. Aten ops: "
        f"`torch.profiler` events per call over {steps} profiled call(s) (all "
        "`aten::` events, nested included; top-level: those not inside another "
        "aten op). Outside aten ops: the share of the profiled time not inside "
        "a top-level aten op (the profiler inflates it). Ratios: against the "
        "native row of the same piece in this run. On a CPU a `torch._foreach_*` "
        "op runs one aten op per tensor inside it (on CUDA: one fused op), so "
        "the optimizer's aten op counts do not carry over to a GPU.",
    ]
    if args.quick:
        lines += ["", "Smoke run (`--quick`): these numbers mean nothing."]
    lines += ["", contention(load), "", *table(rows), "", summary(rows)]
    text = "\n".join(lines) + "\n"
    return write_report(args.results, "keras_costs.md", text)


if __name__ == "__main__":
    main()
