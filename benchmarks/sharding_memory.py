"""Per-device memory of the `make demo` model's weights and optimizer state,
under each `keras.distribution` layout, on 8 devices (JAX).

    python benchmarks/sharding_memory.py

Builds `examples/translate_numbers.py`'s model (its default sizes, vocabularies
of 76 word pieces as `make demo` learns them) and its AdamW optimizer under:
one device; `DataParallel` on 8; `ModelParallel` on a 2 x 4 mesh with
`keras_attn.distribution.get_layout_map`; the same with
`shard_weights_over_batch=True`, without and with `model=` (which also shards
the Dense head). It reads the bytes each device holds from the arrays' shards
(`addressable_shards`) and writes `benchmarks/results/sharding_memory_jax.md`.
On a machine without an accelerator the CPU is split into 8 virtual devices;
placement, not speed, is measured, so that changes nothing.
"""

import os
import sys

os.environ["KERAS_BACKEND"] = "jax"
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import keras  # noqa: E402

import keras_attn  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]
from translation import RESULTS, SCHEDULE_STEPS, VOCABULARY, demo_defaults, load_demo  # noqa: E402

from examples.distributed_training import bytes_on_a_device  # noqa: E402

MESH = (2, 4)


def distributions(reference):
    devices = keras.distribution.list_devices()
    mesh = keras.distribution.DeviceMesh(MESH, ["batch", "model"], devices)

    def model_parallel(**kwargs):
        layout_map = keras_attn.distribution.get_layout_map(mesh, **kwargs)
        return keras.distribution.ModelParallel(
            layout_map=layout_map, batch_dim_name="batch"
        )

    return {
        "one device": None,
        "DataParallel, 8 devices": keras.distribution.DataParallel(devices=devices),
        "ModelParallel 2x4": model_parallel(),
        "ModelParallel 2x4, fully sharded": model_parallel(
            shard_weights_over_batch=True
        ),
        "ModelParallel 2x4, fully sharded, `model=`": model_parallel(
            shard_weights_over_batch=True, model=reference
        ),
    }


def measure(demo, args, distribution):
    keras.distribution.set_distribution(distribution)
    try:
        model = demo.build_model(args, VOCABULARY, VOCABULARY)
        demo.compile_model(model, args, SCHEDULE_STEPS)
        model.optimizer.build(model.trainable_variables)
        return (
            sum(bytes_on_a_device(model.weights).values()),
            sum(bytes_on_a_device(model.optimizer.variables).values()),
        )
    finally:
        keras.distribution.set_distribution(None)


def main():
    demo = load_demo()
    args = demo_defaults(demo)
    reference = demo.build_model(args, VOCABULARY, VOCABULARY)
    rows = []
    for name, distribution in distributions(reference).items():
        weights, optimizer = measure(demo, args, distribution)
        rows.append((name, weights, optimizer))
    baseline = rows[0][1] + rows[0][2]
    lines = [
        "# Per-device memory of weights and optimizer state (JAX)",
        "",
        f"`make demo` model, {reference.count_params():,} parameters, AdamW; "
        "bytes on the first of 8 devices. `python benchmarks/sharding_memory.py`.",
        "",
        "| layout | weights (KiB) | optimizer (KiB) | total (KiB) | of one device |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, weights, optimizer in rows:
        total = weights + optimizer
        lines.append(
            f"| {name} | {weights / 1024:.1f} | {optimizer / 1024:.1f} | "
            f"{total / 1024:.1f} | {total / baseline:.3f} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    with open(os.path.join(RESULTS, "sharding_memory_jax.md"), "w") as file:
        file.write(text)


if __name__ == "__main__":
    main()
