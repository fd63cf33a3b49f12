"""Train a keras_attn model on several processes, with each backend's own engine.

    python examples/distributed_training.py --backend jax --processes 2
    python examples/distributed_training.py --backend jax --processes 2 --strategy model
    python examples/distributed_training.py --backend jax --processes 2 --strategy fsdp
    python examples/distributed_training.py --backend jax --processes 2 \
        --strategy expert --num-experts 8
    python examples/distributed_training.py --backend tensorflow --processes 2
    python examples/distributed_training.py --backend torch --processes 2

The task: copy a sequence of random digits, with an encoder-decoder trained by
teacher forcing. Every process runs the same loop: it makes the global batch of
each step from the seed and the step number, takes its own share of the rows,
and hands that share to its backend's engine, which combines the shares:

- JAX, `keras.distribution` (XLA's SPMD partitioner over a device mesh that
  spans every process): `--strategy data` replicates the model and splits each
  batch over all devices (`DataParallel`); `--strategy model` also splits the
  weights of the keras_attn layers over the model axis of a `--mesh
  DATAxMODEL`, Megatron style (`ModelParallel` with
  `keras_attn.distribution.get_layout_map`); `--strategy fsdp` also splits
  every weight, and Adam's moments, over the data axis
  (`get_layout_map(..., shard_weights_over_batch=True)`); `--strategy
  expert`, with `--num-experts` (`MixtureOfExperts` feed-forward networks),
  splits the experts over the model axis instead of their intermediate
  units (`get_layout_map(..., expert_parallel_dim_name="model")`).
- TensorFlow, `tf.distribute.MultiWorkerMirroredStrategy` (`--strategy data`),
  with a custom `strategy.run` step: Keras 3.15's `fit` fails under it for any
  model (keras-team/keras#20585).
- PyTorch, `torch.nn.parallel.DistributedDataParallel` over gloo (NCCL on
  GPUs) (`--strategy data`): a Keras model on the torch backend is a
  `torch.nn.Module`. Keras 3.15 has no `keras.distribution` on torch.

Each step's loss is the mean over every token of the global batch, so N
processes train exactly as one process does on the whole batch (`--processes
1`): the losses and weights agree to float rounding. The chief process saves
the trained model to `--output`/model.keras (it loads anywhere, on one device)
and the per-step losses to `--output`/results.json.

Launching. With `--processes N` and no cluster environment, this script is its
own launcher: it starts N copies of itself on this machine, on free ports of
127.0.0.1, with the environment each engine reads, waits for them (at most
`--timeout` seconds) and stops them all if one fails. On a cluster, start one
copy per host (or per GPU) with the cluster's own launcher, which sets that
environment; the script sees it and trains:

- JAX: `KERAS_DISTRIBUTION_JOB_ADDRESSES=<coordinator host:port>`,
  `KERAS_DISTRIBUTION_NUM_PROCESSES=<N>`, `KERAS_DISTRIBUTION_PROCESS_ID=<i>`
  (on Cloud TPU pods `KERAS_DISTRIBUTION_NUM_PROCESSES` alone); `--mesh`
  counts the devices of all processes.
- TensorFlow: `TF_CONFIG` (`{"cluster": {"worker": [...]}, "task": {...}}`).
- PyTorch: `torchrun --nnodes=... --nproc_per_node=<GPUs>
  examples/distributed_training.py --backend torch` (it sets `RANK`,
  `WORLD_SIZE`, `MASTER_ADDR`, ...); SLURM's `srun` with the same variables.

On a machine without an accelerator, JAX's CPU is split into virtual devices
(`--mesh` devices in all, shared by the processes), and the processes talk
through gloo.
"""

import argparse
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time

BACKENDS = ("jax", "tensorflow", "torch")
STRATEGIES = {
    "jax": ("data", "model", "fsdp", "expert"),
    "tensorflow": ("data",),
    "torch": ("data", "fsdp"),
}
CLUSTER_VARIABLES = {
    "jax": "KERAS_DISTRIBUTION_NUM_PROCESSES",
    "tensorflow": "TF_CONFIG",
    "torch": "WORLD_SIZE",
}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=BACKENDS)
    parser.add_argument("--processes", type=int, default=1)
    parser.add_argument("--strategy", default="data")
    parser.add_argument(
        "--mesh", default="2x4", help="JAX: DATAxMODEL devices of all processes."
    )
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=64, help="Global batch.")
    parser.add_argument("--length", type=int, default=8)
    parser.add_argument("--embedding-dim", type=int, default=64)
    parser.add_argument("--num-heads", type=int, default=8)
    parser.add_argument("--intermediate-dim", type=int, default=256)
    parser.add_argument(
        "--num-experts",
        type=int,
        default=0,
        help="Each block's feed-forward network a MixtureOfExperts of this many "
        "experts (2 per token) of --intermediate-dim units; 0: dense.",
    )
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--dtype",
        default="float32",
        help="A Keras dtype policy: float32; mixed_bfloat16 on GPUs and TPUs; "
        "float64 to check that N processes train exactly as one.",
    )
    parser.add_argument("--output", default="outputs/distributed_training")
    parser.add_argument("--timeout", type=float, default=900, help="Launcher, s.")
    args = parser.parse_args(argv)
    args.backend = args.backend or os.environ.get("KERAS_BACKEND", "jax")
    if args.strategy not in STRATEGIES[args.backend]:
        parser.error(
            f"--strategy {args.strategy} is not available on {args.backend}: "
            f"choose from {STRATEGIES[args.backend]}."
        )
    try:
        args.mesh = tuple(int(n) for n in args.mesh.lower().split("x"))
    except ValueError:
        parser.error(f"--mesh must look like 2x4. Received: --mesh={args.mesh}.")
    if len(args.mesh) != 2 or min(args.mesh) < 1 or args.processes < 1:
        parser.error("--mesh must be DATAxMODEL, e.g. 2x4, and --processes >= 1.")
    if args.strategy == "expert" and args.num_experts < 1:
        parser.error("--strategy expert splits experts: pass --num-experts.")
    return args


# ---------------------------------------------------------------- launcher


def free_port():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        return listener.getsockname()[1]


def cluster_environment(backend, processes):
    """The environment of each of `processes` local copies, as the backend's
    own launcher would set it."""
    ports = [free_port() for _ in range(processes)]
    addresses = [f"127.0.0.1:{port}" for port in ports]
    for index in range(processes):
        if backend == "jax":
            yield {
                "KERAS_DISTRIBUTION_JOB_ADDRESSES": addresses[0],
                "KERAS_DISTRIBUTION_NUM_PROCESSES": str(processes),
                "KERAS_DISTRIBUTION_PROCESS_ID": str(index),
            }
        elif backend == "tensorflow":
            cluster = {"cluster": {"worker": addresses}}
            task = {"task": {"type": "worker", "index": index}}
            yield {"TF_CONFIG": json.dumps({**cluster, **task})}
        else:  # What torchrun sets.
            yield {
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(ports[0]),
                "WORLD_SIZE": str(processes),
                "RANK": str(index),
                "LOCAL_RANK": str(index),
                "LOCAL_WORLD_SIZE": str(processes),
            }


def launch(args):
    """Start `--processes` copies of this script; stop them all on a failure,
    a timeout or a SIGTERM."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("Terminated."))
    children = []
    try:
        for env in cluster_environment(args.backend, args.processes):
            env = {**os.environ, "KERAS_BACKEND": args.backend, **env}
            children.append(subprocess.Popen([sys.executable, *sys.argv], env=env))
        deadline = time.monotonic() + args.timeout
        while any(child.poll() is None for child in children):
            failed = [c for c in children if c.returncode not in (None, 0)]
            if failed or time.monotonic() > deadline:
                why = f"exit {failed[0].returncode}" if failed else "timeout"
                raise SystemExit(f"A process stopped ({why}); stopping the others.")
            time.sleep(0.2)
        if any(child.returncode for child in children):
            raise SystemExit(f"Exit codes: {[c.returncode for c in children]}.")
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
            child.wait()


# ------------------------------------------------------- environment, per engine


def configure_environment(args):
    """Before Keras is imported: the backend, TensorFlow's log, JAX's CPU devices."""
    import console  # noqa: F401  (here: the module stays importable from tests)

    os.environ["KERAS_BACKEND"] = args.backend
    if args.dtype == "float64":
        os.environ["JAX_ENABLE_X64"] = "1"  # JAX's 64-bit types (before import).
    if args.backend == "jax":
        processes = int(os.environ.get(CLUSTER_VARIABLES["jax"], 1))
        devices = max(1, math.prod(args.mesh) // processes)
        flag = f"--xla_force_host_platform_device_count={devices}"
        flags = os.environ.get("XLA_FLAGS", "")
        if "xla_force_host_platform_device_count" not in flags:
            os.environ["XLA_FLAGS"] = f"{flags} {flag}".strip()
        # Several CPU processes talk through gloo; GPUs and TPUs ignore this.
        os.environ.setdefault("JAX_CPU_COLLECTIVES_IMPLEMENTATION", "gloo")
    if args.backend == "torch":
        os.environ.setdefault("OMP_NUM_THREADS", "1")  # One thread per process.


if __name__ == "__main__":
    ARGS = parse_args()
    IS_WORKER = CLUSTER_VARIABLES[ARGS.backend] in os.environ
    if ARGS.processes > 1 and not IS_WORKER:
        launch(ARGS)
        sys.exit(0)
    configure_environment(ARGS)

import keras  # noqa: E402  (after the environment is configured)
import numpy as np  # noqa: E402

import keras_attn  # noqa: E402

START = 1  # Ids 2..11 are the digits; 0 is padding.
VOCABULARY_SIZE = 12


def build_model(args):
    source = keras.Input((None,), dtype="int32", name="source")
    decoder_input = keras.Input((None,), dtype="int32", name="decoder_input")
    embedding = dict(embedding_dim=args.embedding_dim, mask_zero=True)
    block = dict(intermediate_dim=args.intermediate_dim, num_heads=args.num_heads)
    if args.num_experts:
        experts = keras_attn.layers.MixtureOfExperts(
            args.num_experts, args.intermediate_dim, top_k=2
        )
        block.update(intermediate_dim=None, feedforward=experts)
    x = keras_attn.SinusoidalEmbedding(
        vocabulary_size=VOCABULARY_SIZE, **embedding, name="source_embedding"
    )(source)
    x = keras_attn.TransformerEncoder(**block, name="encoder")(x)
    y = keras_attn.SinusoidalEmbedding(
        vocabulary_size=VOCABULARY_SIZE, **embedding, name="target_embedding"
    )(decoder_input)
    y = keras_attn.TransformerDecoder(**block, name="decoder")(y, x)
    logits = keras.layers.Dense(VOCABULARY_SIZE, name="logits")(y)
    return keras.Model([source, decoder_input], logits, name="copier")


def global_batch(args, step):
    """The whole batch of one step, the same in every process: copy digits;
    the decoder input is START + the digits shifted right."""
    rng = np.random.default_rng([args.seed, step])
    digits = rng.integers(2, VOCABULARY_SIZE, (args.batch_size, args.length))
    digits = digits.astype("int32")
    start = np.full((args.batch_size, 1), START, "int32")
    return (digits, np.concatenate([start, digits[:, :-1]], axis=1)), digits


def local_share(arrays, shard, shards):
    """Rows [shard * B / shards, (shard + 1) * B / shards) of each array
    (`train` checks that `shards` divides B)."""
    size = arrays[1].shape[0] // shards
    return keras.tree.map_structure(
        lambda a: a[shard * size : (shard + 1) * size], arrays
    )


def token_cross_entropy(reduction):
    return keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, reduction=reduction
    )


# ---------------------------------------------------------------- JAX


class JaxEngine:
    """`keras.distribution`: the arrays of every process form one global array."""

    def __init__(self, args):
        global jax
        import jax

        if CLUSTER_VARIABLES["jax"] in os.environ:
            keras.distribution.initialize()  # Reads KERAS_DISTRIBUTION_*.
        self.distribution = self.make_distribution(args)
        keras.distribution.set_distribution(self.distribution)
        self.replicas = self.distribution.num_model_replicas
        # Processes that hold the same batch rows (a model axis across
        # processes) feed the same share.
        self.shards = min(self.replicas, self.distribution.num_processes)
        self.shard = self.distribution.data_shard_id
        self.processes = jax.process_count()
        self.devices = len(keras.distribution.list_devices())
        self.is_chief = jax.process_index() == 0

    @staticmethod
    def make_distribution(args):
        devices = keras.distribution.list_devices()
        if args.strategy == "data":
            return keras.distribution.DataParallel(
                devices=devices, auto_shard_dataset=False
            )
        if len(devices) != math.prod(args.mesh):
            raise SystemExit(
                f"--mesh {'x'.join(map(str, args.mesh))} needs "
                f"{math.prod(args.mesh)} devices; there are {len(devices)}."
            )
        mesh = keras.distribution.DeviceMesh(args.mesh, ["batch", "model"], devices)
        if args.strategy == "model":  # Rules for keras_attn weights, by name.
            layout_map = keras_attn.distribution.get_layout_map(mesh)
        elif args.strategy == "expert":  # Whole experts on each device.
            layout_map = keras_attn.distribution.get_layout_map(
                mesh, expert_parallel_dim_name="model"
            )
        else:  # Exact rules for every weight, the Dense head's too.
            layout_map = keras_attn.distribution.get_layout_map(
                mesh, model=build_model(args), shard_weights_over_batch=True
            )
        return keras.distribution.ModelParallel(
            layout_map=layout_map, batch_dim_name="batch", auto_shard_dataset=False
        )

    def build(self, args):
        self.model = build_model(args)  # Its weights are placed as they are made.
        self.model.compile(
            optimizer=keras.optimizers.Adam(args.learning_rate),
            loss=token_cross_entropy("sum_over_batch_size"),
        )
        self.model.optimizer.build(self.model.trainable_variables)

    def step(self, inputs, labels):
        # This process's rows: Keras assembles the global batch from them.
        return float(self.model.train_on_batch(inputs, labels))

    def save(self, path):
        """Gather the weights and optimizer variables (every process takes
        part); the chief saves a one-device copy of the model."""
        from jax.experimental.multihost_utils import process_allgather

        def gather(variables):
            return [process_allgather(v.value, tiled=True) for v in variables]

        weights = gather(self.model.weights)
        slots = gather(self.model.optimizer.variables)
        if not self.is_chief:
            return
        keras.distribution.set_distribution(None)  # A copy on one device.
        copy = keras.Model.from_config(self.model.get_config())
        copy.compile(
            optimizer=self.model.optimizer.from_config(
                self.model.optimizer.get_config()
            ),
            loss=self.model.loss,
        )
        copy.optimizer.build(copy.trainable_variables)
        copy.set_weights(weights)
        for variable, value in zip(copy.optimizer.variables, slots, strict=True):
            variable.assign(value)
        copy.save(path)
        keras.distribution.set_distribution(self.distribution)

    def describe(self):
        return f"{self.distribution}, {len(keras.distribution.list_devices())} devices"

    def bytes_on_a_device(self):
        return bytes_on_a_device(self.model.weights + self.model.optimizer.variables)


def bytes_on_a_device(variables):
    """Bytes of each JAX variable on this process's first device: what
    sharding leaves each device to hold."""
    import jax

    device = jax.local_devices()[0]
    return {
        variable.path: sum(
            shard.data.nbytes
            for shard in variable.value.addressable_shards
            if shard.device == device
        )
        for variable in variables
    }


# ---------------------------------------------------------------- TensorFlow


class TensorFlowEngine:
    """`tf.distribute.MultiWorkerMirroredStrategy`: one process per machine,
    each with its local devices as replicas.

    A custom step: Keras 3.15's `fit` fails under this strategy for any model
    (keras-team/keras#20585). Keras' optimizer sums the replicas' gradients
    itself when it is applied in a replica context.
    """

    def __init__(self, args):
        global tf
        import tensorflow as tf

        # Before any TensorFlow op: collectives are configured at start-up.
        config = json.loads(os.environ.get(CLUSTER_VARIABLES["tensorflow"], "{}"))
        if config:
            self.strategy = tf.distribute.MultiWorkerMirroredStrategy()
        else:
            self.strategy = tf.distribute.get_strategy()  # One process.
        # Tasks in replica order: a chief (if any), then the workers.
        cluster = config.get("cluster", {})
        tasks = [("chief", i) for i in range(len(cluster.get("chief", [])))]
        tasks += [("worker", i) for i in range(len(cluster.get("worker", [])))]
        task = config.get("task", {})
        self.shard = tasks.index((task["type"], task["index"])) if tasks else 0
        self.shards = self.processes = max(1, len(tasks))
        self.replicas = self.strategy.num_replicas_in_sync
        self.devices = self.replicas
        self.is_chief = self.shard == 0

    def describe(self):
        return f"{type(self.strategy).__name__}, {self.replicas} replicas"

    def build(self, args):
        with self.strategy.scope():
            self.model = build_model(args)
            self.optimizer = keras.optimizers.Adam(args.learning_rate)
            self.optimizer.build(self.model.trainable_variables)
            self.loss = token_cross_entropy("sum")
            # Not for `fit`: so that `save` keeps the optimizer's state.
            self.model.compile(optimizer=self.optimizer, loss=self.loss)
        self.tokens = args.batch_size * args.length  # Of the global batch.
        self.train_step = tf.function(self.replicated_step)

    def replicated_step(self, inputs, labels):
        def replica_step(inputs, labels):
            with tf.GradientTape() as tape:
                logits = self.model(inputs, training=True)
                loss = self.loss(labels, logits) / self.tokens  # Its share.
            weights = self.model.trainable_variables
            gradients = tape.gradient(loss, weights)
            self.optimizer.apply(gradients, weights)
            return loss

        losses = self.strategy.run(replica_step, args=(inputs, labels))
        return self.strategy.reduce("SUM", losses, axis=None)

    def step(self, inputs, labels):
        local = self.replicas // self.shards  # This process's replicas.

        def rows_of(context):  # Each local replica, its part of the rows.
            replica = context.replica_id_in_sync_group - self.shard * local
            return local_share((inputs, labels), replica, local)

        distributed = self.strategy.experimental_distribute_values_from_function
        return float(self.train_step(*distributed(rows_of)))

    def save(self, path):
        if self.is_chief:  # `.keras` saving reads local values: no collective.
            self.model.save(path)


# ---------------------------------------------------------------- PyTorch


class TorchEngine:
    """`DistributedDataParallel` (`--strategy data`), or FSDP2's `fully_shard`
    (`--strategy fsdp`): a Keras model on torch is a `torch.nn.Module`."""

    def __init__(self, args):
        global torch
        import torch

        self.strategy = args.strategy
        self.shards = int(os.environ.get("WORLD_SIZE", 1))
        self.replicas = self.processes = self.devices = self.shards
        self.shard = int(os.environ.get("RANK", 0))
        self.is_chief = self.shard == 0
        if self.shards > 1:
            cuda = torch.cuda.is_available()
            if cuda:  # Keras puts the model on this GPU.
                torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
            torch.distributed.init_process_group("nccl" if cuda else "gloo")

    def describe(self):
        wrapper = {"data": "DistributedDataParallel", "fsdp": "fully_shard"}
        return f"{wrapper[self.strategy]}, {self.shards} processes"

    def build(self, args):
        self.model = build_model(args)
        self.network, self.sharded = self.model, {}
        parameters = [v.value for v in self.model.trainable_variables]
        if self.shards > 1 and self.strategy == "data":
            # Averages the gradients in `backward`.
            self.network = torch.nn.parallel.DistributedDataParallel(self.model)
        elif self.shards > 1:
            self.config = self.model.get_config()
            self.sharded = fully_shard_keras_model(self.model)
            parameters = list(self.sharded.values())
        self.optimizer = torch.optim.Adam(
            parameters,
            lr=args.learning_rate,
            eps=1e-7,  # Keras' epsilon.
        )

    def step(self, inputs, labels):
        inputs, labels = keras.tree.map_structure(
            keras.ops.convert_to_tensor,
            (inputs, labels),  # On Keras' device.
        )
        logits = self.network(list(inputs), training=True)
        # The mean over this process's tokens: averaged over equal shares,
        # the gradient of the global mean.
        loss = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), labels.long().flatten()
        )
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        loss = loss.detach()
        if self.shards > 1:
            torch.distributed.all_reduce(loss)
        return float(loss) / self.shards

    def save(self, path):
        model = self.model
        if self.sharded:  # Gathered (a collective); a plain copy to save.
            weights = [
                self.sharded[v.path].full_tensor() if v.path in self.sharded else v
                for v in model.weights
            ]
            model = keras.Model.from_config(self.config)
            model.set_weights([keras.ops.convert_to_numpy(w) for w in weights])
        if self.is_chief:
            model.save(path)
        if self.shards > 1:
            torch.distributed.barrier()  # The others wait until it is written.
            torch.distributed.destroy_process_group()


def fully_shard_keras_model(model):
    """FSDP2 on a Keras model: `fully_shard` each Transformer block, then the
    rest at the root. Returns `{variable path: sharded parameter (DTensor)}`.

    Keras layers compute with `variable.value`, the tensor the Keras variable
    holds, not with the module's registered parameter, which `fully_shard`
    swaps for a shard and, around each forward, for the gathered parameter.
    Alone, it would leave its shards without gradients. So after FSDP's own
    pre-hook has gathered a unit, a hook points its Keras variables at the
    gathered parameters. This reads Keras' private `_value`.
    """
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    originals = {v.path: v._value for v in model.variables}

    def shard(layer, ignored_paths):
        ignored = {originals[path] for path in ignored_paths}
        fully_shard(layer, ignored_params=ignored or None)
        variables = {v.path: v for v in layer.variables}
        managed = [p for p, t in layer.torch_params.items() if isinstance(t, DTensor)]

        def point_at_gathered(module, args, kwargs):
            for path in managed:
                variables[path]._value = module.torch_params[path]

        layer.register_forward_pre_hook(point_at_gathered, with_kwargs=True)
        return {path: layer.torch_params[path] for path in managed}

    sharded = {}
    blocks = (keras_attn.TransformerEncoder, keras_attn.TransformerDecoder)
    for layer in model.layers:
        if isinstance(layer, blocks):
            sharded |= shard(layer, ())
    # A functional model's layers are not its torch submodules: the root
    # must leave the blocks' parameters alone.
    return sharded | shard(model, sharded)


ENGINES = {"jax": JaxEngine, "tensorflow": TensorFlowEngine, "torch": TorchEngine}


# ---------------------------------------------------------------- training


def train(args):
    if args.dtype == "float64":
        keras.config.set_floatx("float64")
    keras.config.set_dtype_policy(args.dtype)
    engine = ENGINES[args.backend](args)
    if args.batch_size % engine.replicas:
        raise SystemExit(
            f"--batch-size must be divisible by the {engine.replicas} data-parallel "
            f"replicas. Received: --batch-size {args.batch_size}."
        )
    keras.utils.set_random_seed(args.seed)  # The same weights in every process.
    engine.build(args)
    if engine.is_chief:
        print(f"{args.backend}, {engine.processes} processes: {engine.describe()}")
    losses = []
    for step in range(args.steps):
        inputs, labels = local_share(
            global_batch(args, step), engine.shard, engine.shards
        )
        losses.append(engine.step(inputs, labels))
        if engine.is_chief and (step % 20 == 0 or step == args.steps - 1):
            print(f"step {step}: loss {losses[-1]:.4f}", flush=True)
    os.makedirs(args.output, exist_ok=True)
    engine.save(os.path.join(args.output, "model.keras"))
    if engine.is_chief:
        results = {
            "losses": losses,
            "processes": engine.processes,
            "devices": engine.devices,
        }
        if args.backend == "jax":
            results["bytes_on_a_device"] = engine.bytes_on_a_device()
        with open(os.path.join(args.output, "results.json"), "w") as file:
            json.dump(results, file)
        print(f"saved {args.output}/model.keras; final loss {losses[-1]:.4f}")


if __name__ == "__main__":
    train(ARGS)
