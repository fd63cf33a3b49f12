"""Data- and model-parallel training of a keras_attn model with keras.distribution.

    python examples/distributed_training.py --strategy data
    python examples/distributed_training.py --strategy model --mesh 2x4

`--strategy data` replicates the model on every device and splits each batch
over them (`keras.distribution.DataParallel`). `--strategy model` also splits
the weights of the keras_attn layers over the model axis of the mesh, Megatron
style (`keras.distribution.ModelParallel` with
`keras_attn.distribution.get_layout_map`): `--mesh 2x4` is 2 data-parallel
groups of 4 devices, each group holding a quarter of every attention and
feed-forward weight. The task: copy a sequence of random digits, with an
encoder-decoder trained by teacher forcing.

`keras.distribution` places arrays on the JAX backend (Keras 3.15), so the script
runs on JAX (it sets `KERAS_BACKEND=jax` when unset). On a machine without an
accelerator it splits the CPU into as many virtual devices as the mesh has (it
sets `XLA_FLAGS=--xla_force_host_platform_device_count=N` before JAX is
imported), so it runs anywhere; on GPUs or TPUs the flag changes nothing and the
mesh is made of the accelerators: pass a `--mesh` whose size is their number.

Several hosts: start the same command on every host, with the environment
variables that `keras.distribution.initialize()` reads:

    KERAS_DISTRIBUTION_JOB_ADDRESSES=10.0.0.1:1234  # the coordinator (process 0)
    KERAS_DISTRIBUTION_NUM_PROCESSES=2
    KERAS_DISTRIBUTION_PROCESS_ID=0                 # 1 on the second host

The script then calls `keras.distribution.initialize()` before anything else,
the mesh spans the devices of all hosts (`--mesh` counts them all), and each
process generates and feeds its own share of every batch (`--batch-size` is the
global batch). On Cloud TPU pods the variables can be left out: set
`KERAS_DISTRIBUTION_NUM_PROCESSES` alone and JAX finds the rest.
"""

import argparse
import math
import os


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", choices=("data", "model"), default="model")
    parser.add_argument(
        "--mesh",
        default="2x4",
        help="DATAxMODEL devices for --strategy model; for --strategy data, "
        "the product is the number of devices. Defaults to 2x4.",
    )
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--length", type=int, default=8)
    parser.add_argument("--embedding-dim", type=int, default=64)
    parser.add_argument("--num-heads", type=int, default=8)
    parser.add_argument("--intermediate-dim", type=int, default=256)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    try:
        args.mesh = tuple(int(n) for n in args.mesh.lower().split("x"))
    except ValueError:
        parser.error(f"--mesh must look like 2x4. Received: --mesh={args.mesh}.")
    if len(args.mesh) != 2 or min(args.mesh) < 1:
        parser.error(f"--mesh must be DATAxMODEL, e.g. 2x4. Received: {args.mesh}.")
    return args


def configure_environment(num_devices):
    """Before Keras and JAX are imported: JAX backend, enough CPU devices
    (this process's share of them, with several processes)."""
    backend = os.environ.setdefault("KERAS_BACKEND", "jax")
    if backend != "jax":
        raise SystemExit(
            "keras.distribution places arrays on the JAX backend only. Received: "
            f"KERAS_BACKEND={backend}. Run with KERAS_BACKEND=jax (TensorFlow: "
            "tf.distribute; PyTorch: DistributedDataParallel; see the README)."
        )
    processes = int(os.environ.get("KERAS_DISTRIBUTION_NUM_PROCESSES", 1))
    local_devices = max(1, num_devices // processes)
    flag = f"--xla_force_host_platform_device_count={local_devices}"
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()


ARGS = parse_args()
configure_environment(math.prod(ARGS.mesh))

import keras  # noqa: E402  (after the environment is configured)
import numpy as np  # noqa: E402

import keras_attn  # noqa: E402

START = 1  # Ids 2..11 are the digits; 0 is padding.
VOCABULARY_SIZE = 12


def make_distribution(strategy, mesh_shape):
    devices = keras.distribution.list_devices()
    if len(devices) != math.prod(mesh_shape):
        raise SystemExit(
            f"--mesh {'x'.join(map(str, mesh_shape))} needs "
            f"{math.prod(mesh_shape)} devices; there are {len(devices)}: "
            f"{devices}. Pass a --mesh of that size."
        )
    # Each process generates its own share of the data: no sharding to do.
    if strategy == "data":
        return keras.distribution.DataParallel(
            devices=devices, auto_shard_dataset=False
        )
    mesh = keras.distribution.DeviceMesh(mesh_shape, ["batch", "model"], devices)
    layout_map = keras_attn.distribution.get_layout_map(mesh)
    return keras.distribution.ModelParallel(
        layout_map=layout_map, batch_dim_name="batch", auto_shard_dataset=False
    )


def build_model(args):
    source = keras.Input((None,), dtype="int32", name="source")
    decoder_input = keras.Input((None,), dtype="int32", name="decoder_input")
    embedding = dict(embedding_dim=args.embedding_dim, mask_zero=True)
    block = dict(intermediate_dim=args.intermediate_dim, num_heads=args.num_heads)
    x = keras_attn.SinusoidalEmbedding(vocabulary_size=VOCABULARY_SIZE, **embedding)(
        source
    )
    x = keras_attn.TransformerEncoder(**block, name="encoder")(x)
    y = keras_attn.SinusoidalEmbedding(vocabulary_size=VOCABULARY_SIZE, **embedding)(
        decoder_input
    )
    y = keras_attn.TransformerDecoder(**block, name="decoder")(y, x)
    logits = keras.layers.Dense(VOCABULARY_SIZE, name="logits")(y)
    return keras.Model([source, decoder_input], logits, name="copier")


def make_data(rng, size, length):
    """Copy digits: decoder input is START + the digits shifted right."""
    digits = rng.integers(2, VOCABULARY_SIZE, (size, length)).astype("int32")
    decoder_input = np.concatenate(
        [np.full((size, 1), START, "int32"), digits[:, :-1]], axis=1
    )
    return (digits, decoder_input), digits


def local_batch(distribution, batch_size):
    """This process's share of each global batch, and which share it is."""
    shards = min(distribution.num_model_replicas, distribution.num_processes)
    if batch_size % distribution.num_model_replicas:
        raise SystemExit(
            f"--batch-size {batch_size} must be divisible by the "
            f"{distribution.num_model_replicas} data-parallel replicas."
        )
    return batch_size // shards, distribution.data_shard_id


def describe_layouts(model):
    """Print the sharding of one block's weights (JAX arrays)."""
    for weight in model.get_layer("encoder").weights:
        spec = getattr(weight.value.sharding, "spec", "single device")
        print(f"  {weight.path:<48} {str(tuple(weight.shape)):<14} {spec}")


def main(args):
    if "KERAS_DISTRIBUTION_NUM_PROCESSES" in os.environ:
        keras.distribution.initialize()
    distribution = make_distribution(args.strategy, args.mesh)
    keras.distribution.set_distribution(distribution)
    batch_size, shard = local_batch(distribution, args.batch_size)
    print(
        f"keras {keras.__version__}, {distribution}, devices "
        f"{keras.distribution.list_devices()}"
    )

    keras.utils.set_random_seed(args.seed)  # The same weights in every process.
    rng = np.random.default_rng([args.seed, shard])  # A different data share.
    inputs, labels = make_data(rng, args.steps * batch_size, args.length)
    model = build_model(args)
    model.compile(
        optimizer=keras.optimizers.Adam(args.learning_rate),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    print("weights of the encoder block, and their sharding over the mesh:")
    describe_layouts(model)
    history = model.fit(inputs, labels, batch_size=batch_size, epochs=1, verbose=2)
    test_inputs, test_labels = make_data(rng, batch_size, args.length)
    loss, accuracy = model.evaluate(
        test_inputs, test_labels, batch_size=batch_size, verbose=0
    )
    print(
        f"train loss {history.history['loss'][-1]:.4f}; "
        f"held-out loss {loss:.4f}, token accuracy {accuracy:.3f}"
    )


if __name__ == "__main__":
    main(ARGS)
