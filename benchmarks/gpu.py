"""The GPU benchmark: attention, an encoder's training step and generation,
side by side with the peers, on JAX or PyTorch, one process per backend.

On the GPU machine (torch, JAX and CUDA installed there; keras, namex, optree
and keras-hub travel as wheels, `pip install *.whl`), from the repository root:

    KERAS_BACKEND=torch PYTHONPATH=. python benchmarks/gpu.py
    KERAS_BACKEND=jax PYTHONPATH=. python benchmarks/gpu.py

On a CPU, `--quick` is a smoke run of tiny sizes (its numbers mean nothing);
`--only attention|train|generation` runs one part, `--calls N` sets the timed
calls a point (10), `--no-compiled` leaves out PyTorch's `jit_compile=True`
rows (Inductor compiles for a minute or more on a CPU). There is no TensorFlow GPU
build on the GPU machine: under `KERAS_BACKEND=tensorflow` the program says so
and exits without measuring (TensorFlow runs keras_attn's chunked explicit
path, measured by `benchmarks/long_sequence.py`).

1. Attention layer, forward+backward (the gradient of `sum(output)` w.r.t. the
   input and the weights): one causal self-attention layer, batch 1, 16 heads
   of 64, bfloat16 compute, T = 8192, 16384, 32768 (`--lengths`), for
   `keras_attn.MultiHeadAttention`, `keras.layers.MultiHeadAttention` and the
   backend's own: `torch.nn.functional.scaled_dot_product_attention` under
   `torch.autocast`; on JAX, under `jax.jit`, `jax.nn.dot_product_attention`
   with `implementation="cudnn"` (the fused kernel, the reference), the same
   without it (XLA, which materializes the logits) and flax's
   `MultiHeadDotProductAttention`. Median ms and peak device memory; a point
   that runs out of memory says so, and one that cannot run here (the cuDNN
   call off an NVIDIA GPU, flax not installed) says why. On JAX on a GPU each
   point runs in a fresh process, as its peak (`peak_bytes_in_use`) cannot be
   reset.
2. Encoder training step (`train_on_batch`, Adam, MSE, `mixed_bfloat16`, the
   batch already on the device): width 1024, 16 heads, FFN 4096, batch 8,
   T = 512, 2048 (`--train-lengths`), for `keras_attn.TransformerEncoder`,
   `keras_hub.layers.TransformerEncoder`, on PyTorch also ours with
   `jit_compile=True` (`--no-compiled` leaves it out), and a native step:
   `torch.nn.TransformerEncoderLayer` with `torch.optim.Adam`, or a
   `flax.linen` block with `optax.adam` in a jitted step.
3. Generation: greedy `keras_attn.generation.generate` on a decoder-only
   model (4 blocks of width 512, 8 heads, FFN 2048, vocabulary 8000), batch 8,
   prompt 16, 256 new tokens (`--new-tokens`); on PyTorch also
   `jit_compile=True`. Tokens/s per row, and whether the compiled and eager
   loops give the same tokens.

Each point is `benchmarks/timing.py`'s: warm-up calls, then the median of
`--calls` timed calls, interleaved where the contenders share a process; each
call returns once the device is done. A peer whose package cannot be imported
(keras-hub, flax, optax) is left out with a line saying so. The results
(device and versions on top) go to
`benchmarks/results/gpu_<backend>_<device>.md`, or `--results DIR`.
"""

import argparse
import contextlib
import dataclasses
import functools
import gc
import importlib.metadata
import os
import platform
import re
import subprocess
import sys

# JAX takes 75% of a GPU when it starts unless told not to, and the attention
# points run in child processes that need that memory. Read once JAX starts.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import keras  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import keras_attn  # noqa: E402
from benchmarks import encoder, memory  # noqa: E402
from benchmarks import generation as decoding  # noqa: E402
from benchmarks.long_sequence import OUT_OF_MEMORY  # noqa: E402
from benchmarks.timing import describe, time_call, time_calls  # noqa: E402
from keras_attn.generation import generate  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
PARTS = ("attention", "train", "generation")
WARMUP = 2  # A compiled torch step compiles again on its second call.
POLICY = "mixed_bfloat16"
MiB = 2**20
ATTENTION_LAYERS = {
    "keras_attn": keras_attn.MultiHeadAttention,
    "keras.layers.MultiHeadAttention": keras.layers.MultiHeadAttention,
}
# The backend's own attention, by contender: its row's name. "native" is the
# reference of each `vs native` ratio; on JAX the cuDNN call, with XLA's default
# as the reference only where cuDNN cannot run (the table says where).
NATIVE_ATTENTION = {
    "torch": {"native": "torch scaled_dot_product_attention (native)"},
    "jax": {
        "native": "jax.nn.dot_product_attention, cuDNN (native)",
        "flax": "flax.linen.MultiHeadDotProductAttention",
        "xla": "jax.nn.dot_product_attention, XLA default (native)",
    },
}
CUDNN = 'implementation="cudnn"'
PEERS = {"torch": ("keras-hub",), "jax": ("keras-hub", "flax", "optax")}
TENSORFLOW = (
    "TensorFlow's GPU build is not available on the GPU machine, so nothing is "
    "measured under KERAS_BACKEND=tensorflow. The chunked explicit path serves "
    "TensorFlow (which has no fused attention kernel in Keras); "
    "benchmarks/long_sequence.py measures it on a CPU."
)


@dataclasses.dataclass(frozen=True)
class Sizes:
    """The sizes of the three parts; the defaults are the GPU's."""

    lengths: tuple = (8192, 16384, 32768)  # 1. attention
    heads: int = 16
    head_dim: int = 64
    train_lengths: tuple = (512, 2048)  # 2. training
    train_batch: int = 8
    train_width: int = 1024
    train_heads: int = 16
    train_ffn: int = 4096
    blocks: int = 4  # 3. generation
    gen_width: int = 512
    gen_heads: int = 8
    gen_ffn: int = 2048
    vocabulary: int = 8000
    gen_batch: int = 8
    prompt: int = 16
    new_tokens: int = 256


QUICK = Sizes(
    lengths=(64, 128),
    heads=4,
    head_dim=16,
    train_lengths=(64, 128),
    train_batch=2,
    train_width=64,
    train_heads=4,
    train_ffn=128,
    blocks=2,
    gen_width=64,
    gen_heads=4,
    gen_ffn=128,
    vocabulary=1000,
    gen_batch=2,
    prompt=8,
    new_tokens=8,
)


# The device.


def on_gpu():
    """Whether the backend computes on a GPU."""
    if keras.config.backend() == "torch":
        import torch

        return torch.cuda.is_available()
    import jax

    return jax.devices()[0].platform == "gpu"


def device_name():
    """The device in words: 'NVIDIA H100 80GB HBM3', or 'CPU'."""
    if keras.config.backend() == "torch":
        import torch

        return torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    import jax

    kind = jax.devices()[0].device_kind
    return "CPU" if kind.lower() == "cpu" else kind


def slug(name):
    """'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3', for a file name."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def versions():
    """The backend's, CUDA's (on a GPU), Keras' and the peers' versions."""
    if keras.config.backend() == "torch":
        import torch

        parts = [f"torch {torch.__version__}"]
        if torch.cuda.is_available():
            parts.append(f"CUDA {torch.version.cuda}")
    else:
        import jax
        import jaxlib

        parts = [f"jax {jax.__version__}, jaxlib {jaxlib.__version__}"]
        if on_gpu():
            parts.append(f"CUDA: {jax_platform_version()}")
    parts.append(f"keras {keras.__version__}")
    for package in PEERS[keras.config.backend()]:
        try:
            parts.append(f"{package} {importlib.metadata.version(package)}")
        except importlib.metadata.PackageNotFoundError:
            parts.append(f"{package} not installed")
    return ", ".join(parts) + f", Python {platform.python_version()}"


def jax_platform_version():
    """What JAX's GPU client says of its CUDA, e.g. 'cuda 12080', or '?'."""
    import jax

    client = getattr(jax.devices()[0], "client", None)
    return " ".join(str(getattr(client, "platform_version", "?")).split())


def synchronize():
    """Waits for PyTorch's CUDA work (a no-op on a CPU)."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def peak_bytes(function):
    """`(function(), bytes)`: the device's peak memory while `function()` runs.

    PyTorch on CUDA: `max_memory_allocated()` after a reset just before. JAX on
    a GPU: `peak_bytes_in_use`, which cannot be reset, so the process's peak:
    call this in a fresh process. On a CPU: how far the process's resident
    high-water mark rises (`memory.peak_growth`; `None` off Linux).
    """
    if not on_gpu():
        return memory.peak_growth(function)
    if keras.config.backend() == "torch":
        import torch

        torch.cuda.reset_peak_memory_stats()
        return function(), torch.cuda.max_memory_allocated()
    import jax

    result = function()
    return result, jax.devices()[0].memory_stats()["peak_bytes_in_use"]


def free_memory():
    """Gives back what the last point left: Python's garbage, torch's cache."""
    gc.collect()
    if keras.config.backend() == "torch":
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()


class CannotRun(Exception):
    """A contender that cannot run here (a package missing, a kernel's limits):
    its row says why instead of timing something else."""


def or_out_of_memory(function):
    """`function()`, or `{"failed": "out of memory"}` where it ran out. Call
    `free_memory` after it: until then the error's traceback holds tensors."""
    try:
        return function()
    except Exception as error:  # Each backend and device has its own class.
        text = f"{type(error).__name__}: {error}"
        if not any(word in text for word in OUT_OF_MEMORY):
            raise
    return {"failed": "out of memory"}


def optional(name, build, notes):
    """`build()`, or `None` with a line in `notes` where the contender `name`
    needs a package that cannot be imported."""
    try:
        return build()
    except ImportError as error:
        note = f"{name} left out: `{error.name or error}` cannot be imported here."
        if note not in notes:
            print(note, flush=True)
            notes.append(note)
        return None


@contextlib.contextmanager
def dtype_policy(name):
    """Keras' global dtype policy set to `name`, then back."""
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(name)
    try:
        yield
    finally:
        keras.config.set_dtype_policy(previous)


def on_device(shape, rng):
    """A standard normal float32 tensor of `shape` on the backend's device."""
    return keras.ops.convert_to_tensor(rng.standard_normal(shape, dtype="float32"))


# 1. The attention layer, forward+backward.


def torch_step(forward, params, x):
    """A function of no arguments: the gradient of `sum(forward(x))` w.r.t.
    `x` and `params` by `.backward()`, returning once the device is done."""
    x = x.detach().requires_grad_(True)

    def step():
        for tensor in (x, *params):
            tensor.grad = None
        forward(x).float().sum().backward()
        synchronize()

    return step


def jax_step(loss, params, x):
    """A function of no arguments: `loss(params, x)` and its gradient w.r.t.
    both, by a jitted `jax.value_and_grad`, returning once the device is done."""
    import jax

    gradient = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    return lambda: jax.block_until_ready(gradient(params, x))


def keras_attention_step(layer, x):
    """The forward+backward of a built Keras attention layer: eager
    `.backward()` on PyTorch, a jitted `stateless_call` on JAX."""
    trainable = [variable.value for variable in layer.trainable_variables]
    if keras.config.backend() == "torch":
        return torch_step(lambda x: layer(x, x, use_causal_mask=True), trainable, x)
    non_trainable = [variable.value for variable in layer.non_trainable_variables]

    def loss(trainable, x):
        output, _ = layer.stateless_call(
            trainable, non_trainable, x, x, use_causal_mask=True
        )
        return keras.ops.sum(keras.ops.cast(output, "float32"))

    return jax_step(loss, trainable, x)


def torch_native_attention(x, heads, head_dim):
    """Four `torch.nn.Linear` and `scaled_dot_product_attention` (torch picks
    the kernel) under bfloat16 autocast: the forward+backward."""
    import torch

    width = heads * head_dim
    projections = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in "qkvo")
    query, key, value, output = projections.to(x.device)

    def forward(x):
        batch, length, _ = x.shape
        with torch.autocast(x.device.type, dtype=torch.bfloat16):
            q, k, v = (
                p(x).view(batch, length, heads, head_dim).transpose(1, 2)
                for p in (query, key, value)
            )  # (B, H, T, Dh)
            attended = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=True
            )
            return output(attended.transpose(1, 2).reshape(batch, length, width))

    return torch_step(forward, list(projections.parameters()), x)


def jax_native_attention(x, heads, head_dim, implementation=None):
    """Four bfloat16 projections and `jax.nn.dot_product_attention` under
    `jax.jit(jax.value_and_grad(...))`: with `implementation="cudnn"`, cuDNN's
    fused kernel (`CannotRun` where it cannot run here, with JAX's reason);
    with `None`, JAX's default (XLA, which materializes the logits)."""
    import jax
    import jax.numpy as jnp

    width = heads * head_dim
    keys = jax.random.split(jax.random.key(0), 4)
    params = [
        (jax.random.normal(key, (width, width)) / width**0.5, jnp.zeros(width))
        for key in keys
    ]

    def loss(params, x):
        batch, length, _ = x.shape
        params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)
        x = x.astype(jnp.bfloat16)
        q, k, v = (
            (x @ kernel + bias).reshape(batch, length, heads, head_dim)
            for kernel, bias in params[:3]
        )  # (B, T, H, Dh)
        attended = jax.nn.dot_product_attention(
            q, k, v, is_causal=True, implementation=implementation
        )
        kernel, bias = params[3]
        output = attended.reshape(batch, length, width) @ kernel + bias
        return jnp.sum(output.astype(jnp.float32))

    if implementation == "cudnn":
        check_cudnn(loss, params, x)
    return jax_step(loss, params, x)


def check_cudnn(loss, params, x):
    """Raises `CannotRun` where `loss`'s `implementation="cudnn"` call cannot
    run here. JAX checks cuDNN's limits while tracing (cuDNN present; bfloat16,
    float16 or fp8; the head dim a multiple of 8, at most 128, 256 from Hopper
    on; layouts and lengths; see `jax/_src/cudnn/fused_attention_stablehlo.py`),
    which `jax.eval_shape` of the gradient does without compiling; a CPU whose
    jaxlib finds cuDNN passes them, so the device is asked too."""
    import jax

    try:
        jax.eval_shape(jax.value_and_grad(loss, argnums=(0, 1)), params, x)
    except (RuntimeError, NotImplementedError, ValueError) as error:
        reason = (str(error).strip().splitlines() or [""])[0]
        raise CannotRun(f"`{CUDNN}`: {type(error).__name__}: {reason}") from error
    if not on_gpu():
        raise CannotRun(f"`{CUDNN}` needs an NVIDIA GPU; here: {device_name()}")


def jax_flax_attention(x, heads, head_dim):
    """`flax.linen.MultiHeadDotProductAttention` in bfloat16 (float32 weights)
    with a causal mask, flax's default attention function (it materializes the
    logits), under `jax.jit(jax.value_and_grad(...))`."""
    import jax
    import jax.numpy as jnp

    try:
        import flax.linen as nn
    except ImportError as error:
        raise CannotRun(f"`{error.name or error}` cannot be imported here") from error
    layer = nn.MultiHeadDotProductAttention(heads, dtype=jnp.bfloat16)
    params = jax.jit(layer.init)(jax.random.key(0), x[:, :8])

    def loss(params, x):
        causal = nn.make_causal_mask(x[..., 0])  # (B, 1, T, T)
        output = layer.apply(params, x, mask=causal)
        return jnp.sum(output.astype(jnp.float32))

    return jax_step(loss, params, x)


def attention_step(contender, x, heads, head_dim):
    """The forward+backward of `contender` (one of `attention_contenders()`)
    on `x`; `CannotRun` where it cannot run here."""
    native = {
        "torch": {"native": torch_native_attention},
        "jax": {
            "native": functools.partial(jax_native_attention, implementation="cudnn"),
            "flax": jax_flax_attention,
            "xla": jax_native_attention,
        },
    }[keras.config.backend()]
    if contender in native:
        return native[contender](x, heads, head_dim)
    layer = ATTENTION_LAYERS[contender](heads, head_dim, dtype=POLICY)
    layer(x[:, :8], x[:, :8])  # Builds the weights.
    return keras_attention_step(layer, x)


def attention_point(contender, length, heads, head_dim, calls):
    """One contender at one length, in this process: `{"median", "first"}`
    seconds and `"peak"` bytes (`peak_bytes`), `{"failed": ...}` where it ran
    out of memory, or `{"not run": why}` where it cannot run here."""
    x = on_device((1, length, heads * head_dim), np.random.default_rng(0))

    def point():  # The weights are built inside, so that the peak has them.
        timing, peak = peak_bytes(
            lambda: time_call(
                attention_step(contender, x, heads, head_dim), calls, WARMUP
            )
        )
        return {"median": timing.median, "first": timing.first, "peak": peak}

    try:
        result = or_out_of_memory(point)
    except CannotRun as error:
        result = {"not run": str(error)}
    free_memory()
    return result


def fresh_attention_point(*args):
    """`attention_point(*args)` in a fresh JAX process."""
    try:
        return memory.in_fresh_process(attention_point, *args, backend="jax")
    except subprocess.CalledProcessError as error:
        if error.returncode != -9:  # SIGKILL: Linux' out-of-memory killer
            raise
        return {"failed": "out of memory (killed)"}


def fresh_processes():
    """Whether each attention point runs in a fresh process: where its peak
    cannot be reset (JAX on a GPU). Elsewhere they run one after the other in
    this one (on a CPU, quicker than starting JAX anew for each)."""
    return keras.config.backend() == "jax" and on_gpu()


def attention_contenders():
    """The attention part's contenders on this backend, in table order."""
    return (*ATTENTION_LAYERS, *NATIVE_ATTENTION[keras.config.backend()])


def attention(sizes, calls):
    """`{(contender, length): point}`, each point here or in a fresh process
    (`fresh_processes`)."""
    point = fresh_attention_point if fresh_processes() else attention_point
    points = {}
    for length in sizes.lengths:
        for contender in attention_contenders():
            args = (contender, length, sizes.heads, sizes.head_dim, calls)
            points[(contender, length)] = point(*args)
            print(
                f"attention T={length} {contender}: {points[(contender, length)]}",
                flush=True,
            )
    return points


def reference(points, length):
    """The contender every `vs native` ratio at `length` is over: "native",
    or on JAX "xla" where the cuDNN call cannot run (its row says why)."""
    if "not run" in points[("native", length)] and ("xla", length) in points:
        return "xla"
    return "native"


def peak_caption():
    """How the attention table's peaks are measured, on this device."""
    if not on_gpu():
        return (
            "how far the process's resident high-water mark (Linux `VmHWM`, "
            "reset just before) rises"
        )
    if keras.config.backend() == "torch":
        return "`torch.cuda.max_memory_allocated()` after `reset_peak_memory_stats()`"
    return "the fresh process's `peak_bytes_in_use` (`jax.devices()[0].memory_stats()`)"


def attention_caption(sizes, calls, device):
    """What a point of the attention table is, on this backend and device."""
    torch = keras.config.backend() == "torch"
    keras_step = (
        "eager, `output.sum().backward()`"
        if torch
        else "a jitted `jax.value_and_grad` of `layer.stateless_call`"
    )
    native = (
        "four `torch.nn.Linear` and `F.scaled_dot_product_attention(is_causal=True)` "
        "(torch picks the kernel) under `torch.autocast(bfloat16)`, `.backward()`"
        if torch
        else "four bfloat16 projections and `jax.nn.dot_product_attention("
        f"is_causal=True, {CUDNN})`, cuDNN's fused kernel (bfloat16 or float16 "
        "only, head dim a multiple of 8 up to 128, 256 from Hopper on; a row "
        "where it cannot run says why), under `jax.jit(jax.value_and_grad(...))`;"
        " XLA default: the same call without `implementation`, which runs XLA's "
        "implementation and materializes the (B, H, T, T) logits; flax: "
        "`flax.linen.MultiHeadDotProductAttention(dtype=bfloat16)` with "
        "`nn.make_causal_mask`, flax's default attention function (it "
        "materializes too), jitted the same way"
    )
    versus = (
        "the native row's"
        if torch
        else "the cuDNN row's, or the XLA default row's where the cuDNN call "
        "cannot run (the line below the table says where)"
    )
    where = (
        "each in a fresh process"
        if fresh_processes()
        else "one after the other in one process"
    )
    return (
        f"One causal self-attention layer, batch 1, {sizes.heads} heads of "
        f"{sizes.head_dim} (width {sizes.heads * sizes.head_dim}), bfloat16 "
        f"compute (`{POLICY}`: float32 weights), on {device}. A point: the "
        "gradient of `sum(output)` w.r.t. the input and the weights, "
        f"{describe(calls, WARMUP)}, the points {where}. keras_attn: "
        "`keras_attn.MultiHeadAttention`, and `keras.layers.MultiHeadAttention`,"
        f" both `use_causal_mask=True`: {keras_step}; native: {native}. Peak: "
        f"{peak_caption()} over the point, its first call included (weights, "
        "activations and gradients). "
        f"`vs native`: the row's over {versus} at the same T."
    )


def attention_table(points, sizes, calls, device):
    """The attention part's markdown lines: caption, a row a point, ours / native."""
    lines = [
        f"### Attention layer, forward+backward, `KERAS_BACKEND="
        f"{keras.config.backend()}`, {device}",
        "",
        attention_caption(sizes, calls, device),
        "",
        "| T | contender | median ms | first call s | peak MiB | time vs native "
        "| peak vs native |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    names = {**{name: name for name in ATTENTION_LAYERS}, **native_names()}
    for length in sizes.lengths:
        native = points[(reference(points, length), length)]
        for contender in attention_contenders():
            point = points[(contender, length)]
            lines.append(attention_row(length, names[contender], point, native))
    return lines + ["", ratio_line(points, sizes.lengths)]


def native_names():
    """The backend's own attention rows: contender -> row name."""
    return NATIVE_ATTENTION[keras.config.backend()]


def ratio_line(points, lengths):
    """'keras_attn / native, time: T=... 1.23x.', saying where the reference
    is not the native row."""
    ratios = [
        f"T={n} "
        + times(
            points[("keras_attn", n)].get("median"),
            points[(reference(points, n), n)].get("median"),
        )
        for n in lengths
    ]
    line = "keras_attn / native, time: " + ", ".join(ratios) + "."
    instead = [f"T={n}" for n in lengths if reference(points, n) != "native"]
    if instead:
        line += (
            f" At {', '.join(instead)} over the XLA default row: the cuDNN call "
            "cannot run here (its row says why)."
        )
    return line


def times(value, reference):
    """`value / reference` as '1.23x', or '-' where either is missing or 0."""
    return f"{value / reference:.2f}x" if value and reference else "-"


def attention_row(length, name, point, native):
    """One markdown row of the attention table."""
    if "failed" in point or "not run" in point:
        why = point.get("failed") or "not run: " + point["not run"]
        return f"| {length} | {name} | {why.replace('|', '/')} | | | | |"
    peak = "n/a" if point["peak"] is None else f"{point['peak'] / MiB:,.1f}"
    return (
        f"| {length} | {name} | {point['median'] * 1e3:.2f} | {point['first']:.2f} "
        f"| {peak} | {times(point['median'], native.get('median'))} "
        f"| {times(point['peak'], native.get('peak'))} |"
    )


# 2. The encoder's training step.


def torch_native_train(sizes, x, y):
    """`torch.nn.TransformerEncoderLayer` in its own loop (Adam, MSE) under
    `torch.autocast(bfloat16)`."""
    import torch

    layer = torch.nn.TransformerEncoderLayer(
        sizes.train_width,
        sizes.train_heads,
        sizes.train_ffn,
        dropout=0.0,
        batch_first=True,
    )
    return encoder.torch_train_step(layer.to(x.device), x, y, autocast=torch.bfloat16)


def flax_block(sizes):
    """A post-norm `flax.linen` encoder block in bfloat16 (float32 weights),
    with flax's default attention."""
    import flax.linen as nn
    import jax.numpy as jnp

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            dtype = jnp.bfloat16
            attention = nn.MultiHeadDotProductAttention(sizes.train_heads, dtype=dtype)
            x = nn.LayerNorm(1e-5, dtype=dtype)(x + attention(x))
            hidden = nn.relu(nn.Dense(sizes.train_ffn, dtype=dtype)(x))
            x = x + nn.Dense(sizes.train_width, dtype=dtype)(hidden)
            return nn.LayerNorm(1e-5, dtype=dtype)(x)

    return Block()


def jax_native_train(sizes, x, y):
    """`flax_block` trained by a jitted step with `optax.adam` and MSE."""
    import jax
    import jax.numpy as jnp
    import optax

    block, optimizer = flax_block(sizes), optax.adam(1e-4)
    params = jax.jit(block.init)(
        jax.random.key(0), x[:1]
    )  # Jitted: flax's eager init is slower.
    state = [params, optimizer.init(params)]

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, optimizer_state, x, y):
        def loss(params):
            return jnp.mean((block.apply(params, x).astype(jnp.float32) - y) ** 2)

        value, gradients = jax.value_and_grad(loss)(params)
        updates, optimizer_state = optimizer.update(gradients, optimizer_state, params)
        return optax.apply_updates(params, updates), optimizer_state, value

    def train():
        state[0], state[1], value = step(*state, x, y)
        return float(value)  # Waits for the step.

    return train


def native_train_name():
    """The native training row's name on this backend."""
    return {
        "torch": "torch.nn.TransformerEncoderLayer (native)",
        "jax": "flax.linen + optax (native)",
    }[keras.config.backend()]


def train_steps(sizes, length, compiled, notes):
    """Training steps by contender at `length`, each returning once done."""
    rng = np.random.default_rng(0)
    x, y = (
        on_device((sizes.train_batch, length, sizes.train_width), rng) for _ in "xy"
    )
    block = functools.partial(
        encoder.keras_block,
        length=length,
        width=sizes.train_width,
        heads=sizes.train_heads,
        ffn=sizes.train_ffn,
    )
    models = {"keras_attn": block("keras_attn")}
    if compiled:
        jitted = block("keras_attn", jit_compile=True)
        if jitted.jit_compile:  # Keras turns it off where it cannot compile.
            models["keras_attn, jit_compile=True"] = jitted
    models["keras-hub"] = optional("keras-hub", lambda: block("keras-hub"), notes)
    steps = {
        name: (lambda model=model: model.train_on_batch(x, y))
        for name, model in models.items()
        if model is not None
    }
    native = {"torch": torch_native_train, "jax": jax_native_train}
    name = native_train_name()
    step = optional(name, lambda: native[keras.config.backend()](sizes, x, y), notes)
    if step is not None:
        steps[name] = step
    return steps


def train(sizes, calls, compiled, notes):
    """`{length: {contender: Timing}}`, or `{"failed": ...}` for a length
    that ran out of memory; the contenders' steps interleaved."""
    results = {}
    with dtype_policy(POLICY):
        for length in sizes.train_lengths:
            results[length] = or_out_of_memory(
                lambda length=length: time_calls(
                    train_steps(sizes, length, compiled, notes), calls, WARMUP
                )
            )
            free_memory()
            print(f"train T={length}: done", flush=True)
    return results


def train_caption(sizes, calls, device, compiled):
    """What a point of the training table is, on this backend and device."""
    torch = keras.config.backend() == "torch"
    native = (
        "`torch.nn.TransformerEncoderLayer(batch_first=True)` in its own loop "
        "under `torch.autocast(bfloat16)`, `torch.optim.Adam`"
        if torch
        else "a post-norm `flax.linen` block (`dtype=bfloat16`, flax's default "
        "attention) trained by a jitted step with `optax.adam`"
    )
    compiled = (
        " `jit_compile=True`: the same keras_attn model compiled (Inductor)."
        if compiled
        else ""
    )
    return (
        f"One post-norm encoder block (batch {sizes.train_batch}, width "
        f"{sizes.train_width}, {sizes.train_heads} heads, FFN {sizes.train_ffn}), "
        f"Adam (1e-4), MSE, the batch already on the device, bfloat16 compute "
        f"(`{POLICY}`), on {device}. keras_attn and keras-hub: "
        f'`train_on_batch` with `jit_compile="auto"`.{compiled} Native: '
        f"{native}. A point: one step, {describe(calls, WARMUP)}, the "
        "contenders' steps interleaved; the first step (compiling included) "
        "apart. `vs native`: the row's time over the native row's."
    )


def train_table(results, sizes, calls, device, compiled):
    """The training part's markdown lines: caption, a row a step, ours / native."""
    lines = [
        f"### Encoder training step, `KERAS_BACKEND={keras.config.backend()}`, "
        f"{device}",
        "",
        train_caption(sizes, calls, device, compiled),
        "",
        "| T | contender | ms per step | vs native | first step s |",
        "|---:|---|---:|---:|---:|",
    ]
    ours = []
    for length, timings in results.items():
        if "failed" in timings:
            lines.append(f"| {length} | all | {timings['failed']} | | |")
            continue
        native = getattr(timings.get(native_train_name()), "median", None)
        for name, timing in timings.items():
            lines.append(
                f"| {length} | {name} | {timing.median * 1e3:.1f} "
                f"| {times(timing.median, native)} | {timing.first:.2f} |"
            )
        ours.append(f"T={length} {times(timings['keras_attn'].median, native)}")
    return lines + ["", "keras_attn / native, time: " + ", ".join(ours) + "."]


# 3. Generation.


def generation(sizes, calls, compiled):
    """`({decoder: Timing}, same)` of greedy `generate`: as a user calls it,
    and with `jit_compile=True` on PyTorch (`compiled`); `same` says whether
    the compiled and the eager loop give the same tokens."""
    keras.utils.set_random_seed(0)
    model = decoding.keras_attn_model(
        sizes.vocabulary,
        sizes.gen_width,
        sizes.gen_heads,
        sizes.gen_ffn,
        sizes.blocks,
    )
    prompt = np.random.default_rng(0).integers(
        1, sizes.vocabulary, (sizes.gen_batch, sizes.prompt), dtype="int32"
    )

    def run(**kwargs):
        return generate(model, prompt, max_new_tokens=sizes.new_tokens, **kwargs)

    variants = {
        name: kwargs
        for name, kwargs in decoding.ours(keras.config.backend()).items()
        if compiled or kwargs.get("jit_compile") is not True
    }
    timings = time_calls(
        {
            name: (lambda kwargs=kwargs: run(**kwargs))
            for name, kwargs in variants.items()
        },
        calls,
        WARMUP,
    )
    if keras.config.backend() == "torch" and not compiled:
        return timings, None
    same = np.array_equal(run(jit_compile=True), run(jit_compile=False))
    return timings, same


def generation_table(timings, same, sizes, calls, device):
    """The generation part's markdown lines, and whether the tokens match."""
    lines = [
        f"### Generation, `KERAS_BACKEND={keras.config.backend()}`, {device}",
        "",
        f"Decoder-only model: {sizes.blocks} pre-norm `keras_attn.TransformerDecoder`"
        f" blocks of width {sizes.gen_width}, {sizes.gen_heads} heads, FFN "
        f"{sizes.gen_ffn}, vocabulary {sizes.vocabulary}, float32, random "
        f"weights (seed 0); batch {sizes.gen_batch}, prompt {sizes.prompt}, "
        f"{sizes.new_tokens} new tokens, greedy `keras_attn.generation.generate` "
        f'(`jit_compile="auto"`: {auto_loop()}), on {device}. A point: one '
        f"`generate` call, {describe(calls, WARMUP)}, the variants interleaved. "
        "Tokens/s per row: new tokens / seconds; all rows: times the batch. "
        "First call: compiling included.",
        "",
        "| decoder | tokens/s per row | tokens/s, all rows | ms per new token "
        "| first call s |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, timing in timings.items():
        per_row = sizes.new_tokens / timing.median
        lines.append(
            f"| {name} | {per_row:,.0f} | {per_row * sizes.gen_batch:,.0f} "
            f"| {1e3 / per_row:.2f} | {timing.first:.2f} |"
        )
    verdict = (
        "not checked (`--no-compiled`)" if same is None else ("yes" if same else "NO")
    )
    return lines + [
        "",
        "Compiled (`jit_compile=True`) and eager (`jit_compile=False`) loops "
        f"give the same tokens: {verdict}.",
    ]


def auto_loop():
    """What `generate(jit_compile="auto")` runs on this backend."""
    return {
        "torch": "the eager step on PyTorch",
        "jax": "a compiled while-loop on JAX",
    }[keras.config.backend()]


# The program.


def parse_args(argv=None):
    """The flags; `--quick` and the size flags are read by `chosen_sizes`."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=10, help="Timed calls a point.")
    parser.add_argument("--lengths", type=int, nargs="+", help="Attention T.")
    parser.add_argument("--train-lengths", type=int, nargs="+", help="Training T.")
    parser.add_argument("--new-tokens", type=int, help="Generated tokens a row.")
    parser.add_argument("--quick", action="store_true", help="Tiny sizes (a CPU).")
    parser.add_argument("--only", choices=PARTS, help="Run this part alone.")
    parser.add_argument(
        "--no-compiled", action="store_true", help="No jit_compile=True on PyTorch."
    )
    parser.add_argument("--results", default=RESULTS, help="Output folder.")
    return parser.parse_args(argv)


def chosen_sizes(args):
    """`Sizes` (or `QUICK`) with the flags' lengths and new tokens."""
    sizes = QUICK if args.quick else Sizes()
    flags = {
        "lengths": args.lengths and tuple(args.lengths),
        "train_lengths": args.train_lengths and tuple(args.train_lengths),
        "new_tokens": args.new_tokens,
    }
    return dataclasses.replace(sizes, **{k: v for k, v in flags.items() if v})


def measure(args, device):
    """The tables of the parts `args` asks for, attention first (on JAX its
    fresh processes need the GPU memory this one would hold), and the notes."""
    sizes, notes, sections = chosen_sizes(args), [], []
    compiled = keras.config.backend() == "torch" and not args.no_compiled
    parts = (args.only,) if args.only else PARTS
    if "attention" in parts:
        points = attention(sizes, args.calls)
        sections.append(attention_table(points, sizes, args.calls, device))
    if "train" in parts:
        results = train(sizes, args.calls, compiled, notes)
        sections.append(train_table(results, sizes, args.calls, device, compiled))
    if "generation" in parts:
        timings, same = generation(sizes, args.calls, compiled)
        sections.append(generation_table(timings, same, sizes, args.calls, device))
    return sections, notes


def main(argv=None):
    """Run the benchmark (`argv`: command-line flags); returns the markdown."""
    args = parse_args(argv)
    backend = keras.config.backend()
    if backend == "tensorflow":
        print(TENSORFLOW)
        return TENSORFLOW
    device = device_name()
    header = [f"## GPU benchmark, `KERAS_BACKEND={backend}`: {device}", ""]
    header.append(f"Device: {device}. {versions()}.")
    if args.quick:
        header.append("Smoke run (`--quick`): these numbers mean nothing.")
    print("\n".join(header), flush=True)
    sections, notes = measure(args, device)
    lines = header + [""] + (notes and [*notes, ""])
    lines += [line for section in sections for line in [*section, ""]]
    text = "\n".join(lines).rstrip() + "\n"
    os.makedirs(args.results, exist_ok=True)
    path = os.path.join(args.results, f"gpu_{backend}_{slug(device)}.md")
    with open(path, "w") as f:
        f.write(text)
    print(text + f"\nWrote {path}", flush=True)
    return text


if __name__ == "__main__":
    main()
