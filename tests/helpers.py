"""Shared test helpers: the layer contract every public layer must satisfy,
the float64 references, and small makers of inputs."""

import inspect
import os
import signal
import subprocess
import sys
import warnings

import keras
import numpy as np

from keras_attn import (
    MultiHeadAttention,
    SinusoidalEmbedding,
    TransformerDecoder,
    TransformerEncoder,
)

BACKEND = keras.backend.backend()

# `model.quantize(mode)` output error relative to float (`||q - f|| / ||f||`),
# measured ~0.01, ~0.05-0.09 and ~0.09-0.11 on small random layers.
QUANTIZATION_TOLERANCE = {"int8": 0.05, "float8": 0.25, "int4": 0.35}
QUANTIZABLE = (keras.layers.EinsumDense, keras.layers.Dense, keras.layers.Embedding)


def has_accelerator():
    """Whether the current backend runs on a GPU/TPU (CI machines have none)."""
    if BACKEND == "jax":
        import jax

        return jax.devices()[0].platform != "cpu"
    if BACKEND == "tensorflow":
        import tensorflow as tf

        return bool(tf.config.list_physical_devices("GPU"))
    import torch

    return torch.cuda.is_available()


def has_fused_kernel(batch, length, heads, head_dim):
    """Whether the backend has a fused (flash-type) attention kernel for
    bfloat16 self-attention of this shape on its device, asked of the
    backend itself: JAX's cuDNN attention, PyTorch's fused kernels (cuDNN,
    flash, memory-efficient; the flash kernel on a CPU too). TensorFlow has
    none."""
    if BACKEND == "tensorflow":
        return False
    if BACKEND == "jax":
        import jax

        x = jax.numpy.zeros((batch, length, heads, head_dim), "bfloat16")
        try:
            jax.nn.dot_product_attention(x, x, x, implementation="cudnn")
        except Exception:  # noqa: BLE001 - JAX raises several kinds
            return False
        return True
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.zeros(batch, heads, length, head_dim, dtype=torch.bfloat16, device=device)
    fused = [
        SDPBackend.CUDNN_ATTENTION,
        SDPBackend.FLASH_ATTENTION,
        SDPBackend.EFFICIENT_ATTENTION,
    ]
    try:
        with sdpa_kernel(fused):
            torch.nn.functional.scaled_dot_product_attention(x, x, x)
    except RuntimeError:
        return False
    return True


def to_numpy(x):
    return keras.ops.convert_to_numpy(x)


def flat_numpy(outputs):
    """The outputs of a call (a tensor or a tuple) as a list of numpy arrays."""
    return [to_numpy(x) for x in keras.tree.flatten(outputs)]


def random_floats(*shape, seed=0, scale=1.0):
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(
        "float32"
    )


# The arguments each layer cannot do without.
REQUIRED_ARGUMENTS = {
    MultiHeadAttention: {"num_heads": 2},
    TransformerEncoder: {"intermediate_dim": 8, "num_heads": 2},
    TransformerDecoder: {"intermediate_dim": 8, "num_heads": 2},
    SinusoidalEmbedding: {},
}
VOCAB = 11  # vocabulary of the token-id tests, a size no other axis has


def random_ids(*shape, seed=0, high=VOCAB):
    """Int32 token ids in [1, high): no padding."""
    return np.random.default_rng(seed).integers(1, high, shape).astype("int32")


def padded_ids(*shape, seed=0):
    """`random_ids` whose first row is padding (id 0) from its middle on."""
    ids = random_ids(*shape, seed=seed)
    ids[0, shape[1] // 2 :] = 0
    return ids


def functional_model(layer, inputs, call_kwargs=None):
    """Wrap `layer` in a functional model with one `keras.Input` per input array.

    Batch and length are left unknown (None), as users build them.
    """
    symbolic = {}
    for name, array in inputs.items():
        unknown = (None,) * (array.ndim - 1)  # every axis but the batch
        if array.dtype.kind == "f":  # keep the feature width
            unknown = unknown[:-1] + array.shape[-1:]
        symbolic[name] = keras.Input(shape=unknown, dtype=str(array.dtype), name=name)
    outputs = layer(**symbolic, **(call_kwargs or {}))
    return keras.Model(symbolic, outputs)


def save_and_load(model, tmp_path, name):
    path = os.path.join(str(tmp_path), f"{name}.keras")
    model.save(path)
    return keras.models.load_model(path)


def assert_outputs_close(actual, expected, tolerance=1e-6):
    for a, e in zip(flat_numpy(actual), flat_numpy(expected), strict=True):
        np.testing.assert_allclose(a, e, atol=tolerance, rtol=tolerance)


def relative_error(actual, expected):
    actual, expected = to_numpy(actual), to_numpy(expected)
    return float(np.linalg.norm(actual - expected) / np.linalg.norm(expected))


def run_layer_contract(
    layer_cls,
    init_kwargs,
    inputs,
    call_kwargs=None,
    expected_output_shape=None,
    tmp_path=None,
    mixed_precision=True,
    machinery=True,
):
    """The contract: config round trip, explicit build, eager and symbolic calls,
    `compute_output_shape`/`compute_output_spec`, `.keras` save/load,
    jit-compiled predict, mixed-precision dtypes, and Keras' machinery:
    `quantize` in every mode, `enable_lora` and `DTypePolicyMap`, each with a
    `.keras` round trip.

    Args:
        layer_cls: the layer class.
        init_kwargs: dict of constructor arguments.
        inputs: dict of call argument name -> numpy array (float or int).
        call_kwargs: dict of extra (non-tensor) call arguments.
        expected_output_shape: tuple compared with the eager output's shape.
        tmp_path: directory for the `.keras` files; without it, nothing is
            saved (and Keras' machinery is not checked).
        mixed_precision: whether to check the mixed policies too.
        machinery: whether to check quantize, LoRA and policy maps (each
            with a `.keras` round trip).
    """
    call_kwargs = call_kwargs or {}
    check_config_round_trip(layer_cls, init_kwargs)

    # Explicit build creates every weight; a call then creates none.
    layer = layer_cls(**init_kwargs)
    layer.build(**{f"{name}_shape": array.shape for name, array in inputs.items()})
    assert layer.built
    weight_names = sorted(w.path for w in layer.weights)
    eager = layer(**inputs, **call_kwargs)
    assert sorted(w.path for w in layer.weights) == weight_names
    if expected_output_shape is not None:
        assert flat_numpy(eager)[0].shape == tuple(expected_output_shape)
    assert all(np.all(np.isfinite(x)) for x in flat_numpy(eager))
    check_output_spec(layer, inputs, call_kwargs, eager)

    # Symbolic call in a functional model with unknown batch and length.
    model = functional_model(layer, inputs, call_kwargs)
    assert_outputs_close(model(inputs), eager)
    if tmp_path is not None:
        assert_outputs_close(save_and_load(model, tmp_path, "float")(inputs), eager)

    # jit-compiled predict equals eager.
    model.compile(jit_compile=BACKEND != "torch")
    batch = len(next(iter(inputs.values())))
    predicted = model.predict(inputs, verbose=0, batch_size=batch)
    assert_outputs_close(predicted, eager, tolerance=1e-5)

    if mixed_precision:
        for policy in ("mixed_float16", "mixed_bfloat16"):
            check_mixed_precision(layer_cls, init_kwargs, inputs, call_kwargs, policy)
    if machinery and tmp_path is not None and _quantizable_sublayers(layer):
        for mode in QUANTIZATION_TOLERANCE:
            check_quantization(
                layer_cls, init_kwargs, inputs, call_kwargs, mode, tmp_path
            )
        check_lora(layer_cls, init_kwargs, inputs, call_kwargs, tmp_path)
        check_dtype_policy_map(layer_cls, init_kwargs, inputs, call_kwargs, tmp_path)
    return flat_numpy(eager)[0]


def check_config_round_trip(layer_cls, init_kwargs):
    """Every constructor argument is in the config, which recreates the layer."""
    layer = layer_cls(**init_kwargs)
    config = layer.get_config()
    for name, value in init_kwargs.items():
        if not isinstance(value, str | dict) and name not in ("dtype",):
            assert config[name] == value, (name, config[name], value)
    revived = layer_cls.from_config(config)
    assert revived.get_config() == config


def check_output_spec(layer, inputs, call_kwargs, eager):
    """`compute_output_spec` and `compute_output_shape` describe the eager call."""
    symbolic = {
        name: keras.KerasTensor(array.shape, dtype=str(array.dtype))
        for name, array in inputs.items()
    }
    spec = keras.tree.flatten(layer.compute_output_spec(**symbolic, **call_kwargs))
    outputs = keras.tree.flatten(eager)
    assert len(spec) == len(outputs)
    for expected, actual in zip(spec, outputs, strict=True):
        assert tuple(expected.shape) == tuple(actual.shape)
        assert keras.backend.standardize_dtype(
            expected.dtype
        ) == keras.backend.standardize_dtype(actual.dtype)
    accepted = inspect.signature(layer.compute_output_shape).parameters
    shapes = {
        f"{name}_shape": array.shape
        for name, array in inputs.items()
        if f"{name}_shape" in accepted
    }
    assert tuple(layer.compute_output_shape(**shapes)) == tuple(outputs[0].shape)


def check_mixed_precision(layer_cls, init_kwargs, inputs, call_kwargs, policy):
    """Float32 weights, compute-dtype outputs and specs, finite numbers."""
    layer = layer_cls(**init_kwargs, dtype=policy)
    output = layer(**inputs, **call_kwargs)
    compute_dtype = policy.split("_")[1]
    assert keras.backend.standardize_dtype(flat_output(output).dtype) == compute_dtype
    for weight in layer.weights:
        if weight.trainable:
            assert keras.backend.standardize_dtype(weight.dtype) == "float32", (
                weight.path
            )
    check_output_spec(layer, inputs, call_kwargs, output)
    assert np.all(np.isfinite(to_numpy(keras.ops.cast(flat_output(output), "float32"))))


def flat_output(outputs):
    return keras.tree.flatten(outputs)[0]


def _quantizable_sublayers(layer):
    return [
        s
        for s in layer._flatten_layers(include_self=False)
        if isinstance(s, QUANTIZABLE)
    ]


def _fresh_model(layer_cls, init_kwargs, inputs, call_kwargs, **layer_kwargs):
    keras.utils.set_random_seed(7)
    layer = layer_cls(**init_kwargs, **layer_kwargs)
    return layer, functional_model(layer, inputs, call_kwargs)


def check_quantization(layer_cls, init_kwargs, inputs, call_kwargs, mode, tmp_path):
    """`model.quantize(mode)` reaches every projection and token table (but
    the table in float8, which Keras' `Embedding` lacks), stays close to
    float, and reloads from `.keras` with identical outputs."""
    layer, model = _fresh_model(layer_cls, init_kwargs, inputs, call_kwargs)
    if not _eligible_sublayers(layer, mode):  # a token table alone, in float8
        return
    expected = model(inputs)
    with warnings.catch_warnings():  # "does not have a `quantize` method" for the rest
        warnings.simplefilter("ignore")
        model.quantize(mode)
    assert quantized_share(layer, mode) == 1.0
    quantized = model(inputs)
    error = relative_error(flat_output(quantized), flat_output(expected))
    assert error < QUANTIZATION_TOLERANCE[mode], (mode, error)
    assert_outputs_close(save_and_load(model, tmp_path, mode)(inputs), quantized)


def _eligible_sublayers(layer, mode):
    """The sublayers `mode` quantizes: Keras' `Embedding` has no float8 mode."""
    sublayers = _quantizable_sublayers(layer)
    if mode == "float8":
        sublayers = [s for s in sublayers if not isinstance(s, keras.layers.Embedding)]
    return sublayers


def quantized_share(layer, mode):
    """The share of the kernel/table parameters of `layer` that `mode` converted."""
    sublayers = _eligible_sublayers(layer, mode)
    sizes = {id(s): _parameter_count(s) for s in sublayers}
    converted = sum(sizes[id(s)] for s in sublayers if s.quantization_mode == mode)
    return converted / sum(sizes.values())


def _parameter_count(sublayer):
    if isinstance(sublayer, keras.layers.Embedding):
        return sublayer.input_dim * sublayer.output_dim
    shape = getattr(sublayer, "original_kernel_shape", None) or sublayer.kernel.shape
    return int(np.prod(shape))


def check_lora(layer_cls, init_kwargs, inputs, call_kwargs, tmp_path):
    """After `enable_lora`, only adapters train, `fit` trains them, and the
    model reloads (adapters merged) with identical outputs."""
    layer, model = _fresh_model(layer_cls, init_kwargs, inputs, call_kwargs)
    frozen = {w.path: to_numpy(w).copy() for w in model.weights}
    layer.enable_lora(2)
    adapters = model.trainable_weights
    assert adapters and all(w.name.startswith("lora_") for w in adapters)
    outputs = keras.tree.flatten(model(inputs))
    if len(outputs) == 1:  # one output: fit it to random targets
        target = np.random.default_rng(1).standard_normal(outputs[0].shape)
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        model.fit(inputs, target.astype("float32"), epochs=2, verbose=0)
        for weight in model.weights:
            if weight.path in frozen:
                np.testing.assert_array_equal(to_numpy(weight), frozen[weight.path])
        assert any(
            not np.allclose(to_numpy(w), 0.0) for w in adapters if w.name.endswith("b")
        )
    assert_outputs_close(
        save_and_load(model, tmp_path, "lora")(inputs), model(inputs), 1e-5
    )


def check_dtype_policy_map(layer_cls, init_kwargs, inputs, call_kwargs, tmp_path):
    """A `DTypePolicyMap` naming one sublayer's path quantizes that sublayer
    from the start, and the layer reloads from `.keras` with identical outputs."""
    probe = layer_cls(**init_kwargs, name="probe")
    probe.build(**{f"{name}_shape": array.shape for name, array in inputs.items()})
    target = _quantizable_sublayers(probe)[0].path
    policy_map = keras.dtype_policies.DTypePolicyMap()
    policy_map[target] = keras.dtype_policies.QuantizedDTypePolicy("int8", "float32")
    layer, model = _fresh_model(
        layer_cls, init_kwargs, inputs, call_kwargs, dtype=policy_map, name="probe"
    )
    (sublayer,) = [s for s in layer._flatten_layers() if s.path == target]
    assert sublayer.quantization_mode == "int8"
    others = [s for s in _quantizable_sublayers(layer) if s is not sublayer]
    assert all(s.quantization_mode is None for s in others)
    outputs = model(inputs)
    assert_outputs_close(save_and_load(model, tmp_path, "policy_map")(inputs), outputs)


# --- Reference implementations (float64 numpy) --------------------------------

EPS32 = 2.0**-24


def value_and_gradients(fn, *arrays):
    """`fn(*arrays)` and the gradients of `sum(fn(*arrays) * c)` for a fixed
    random `c`, as numpy arrays, with the backend's own autodiff."""
    tensors = [keras.ops.convert_to_tensor(x) for x in arrays]
    cotangent = None

    def loss(*xs):
        nonlocal cotangent
        output = fn(*xs)
        if cotangent is None:
            cotangent = keras.ops.convert_to_tensor(
                random_floats(*output.shape, seed=99)
            )
        return keras.ops.sum(output * cotangent), output

    if BACKEND == "jax":
        import jax

        (_, output), grads = jax.value_and_grad(
            loss, argnums=tuple(range(len(tensors))), has_aux=True
        )(*tensors)
    elif BACKEND == "tensorflow":
        import tensorflow as tf

        with tf.GradientTape() as tape:
            tape.watch(tensors)
            total, output = loss(*tensors)
        grads = tape.gradient(total, tensors)
    else:
        tensors = [x.clone().requires_grad_(True) for x in tensors]
        total, output = loss(*tensors)
        total.backward()
        grads = [x.grad for x in tensors]
    detach = getattr(output, "detach", lambda: output)  # torch
    return to_numpy(detach()), [to_numpy(g) for g in grads]


def dot_product_reference(query, key, value, mask=None, bias=None, soft_cap=None):
    """softmax(QK^T / sqrt(D) + bias) V in float64, the formula of
    `keras_attn.ops.dot_product_attention`.

    `query` `(B, T, H, D)`; `key`, `value` `(B, S, K, D|Dv)` with `K` dividing
    `H` (query head `h` uses key/value head `h // (H // K)`); `mask`: bool
    broadcastable to `(B, H, T, S)`, True where attention is allowed; `bias`:
    float broadcastable to `(B, H, T, S)`; `soft_cap`: logits become
    `soft_cap * tanh(logits / soft_cap)` before the bias. Returns
    `(context (B, T, H, Dv), weights (B, H, T, S))`; a query row that may
    attend to no key gives zeros (the documented behaviour), not NaN.
    """
    group = query.shape[2] // key.shape[2]
    key, value = np.repeat(key, group, axis=2), np.repeat(value, group, axis=2)
    logits = np.einsum("bthd,bshd->bhts", query, key) / np.sqrt(query.shape[-1])
    if soft_cap is not None:  # Gemma 2
        logits = soft_cap * np.tanh(logits / soft_cap)
    if bias is not None:
        logits = logits + bias
    if mask is not None:
        logits = np.where(mask, logits, -np.inf)
    with np.errstate(invalid="ignore"):
        weights = np.exp(logits - logits.max(-1, keepdims=True))
        weights /= weights.sum(-1, keepdims=True)
    weights = np.nan_to_num(weights, nan=0.0)  # rows with no allowed key
    return np.einsum("bhts,bshd->bthd", weights, value), weights


def attention_reference(layer, query, value, mask=None, bias=None):
    """softmax(QK^T / sqrt(d_k) + bias) V W_O from a MultiHeadAttention's own
    weights, in float64. `mask`: bool broadcastable to `(B, H, T, S)`; a query
    row that may attend to no key gives the output bias alone (the layer's
    documented behaviour), not NaN."""
    w = {
        name: {
            p: to_numpy(getattr(dense, p)).astype(np.float64)
            for p in ("kernel", "bias")
        }
        for name, dense in (
            ("q", layer.query_dense),
            ("k", layer.key_dense),
            ("v", layer.value_dense),
            ("o", layer.output_dense),
        )
    }
    q = np.einsum("btd,dhk->bthk", query, w["q"]["kernel"]) + w["q"]["bias"]
    k = np.einsum("bsd,dhk->bshk", value, w["k"]["kernel"]) + w["k"]["bias"]
    v = np.einsum("bsd,dhk->bshk", value, w["v"]["kernel"]) + w["v"]["bias"]
    context, _ = dot_product_reference(q, k, v, mask, bias)
    return np.einsum("bthk,hko->bto", context, w["o"]["kernel"]) + w["o"]["bias"]


def reference_encoding(length, dim, max_wavelength=10000.0, start=0):
    """The paper's sinusoid in float64, straight from its definition; and the
    angles (the float32 error bound grows with them)."""
    pos = np.arange(start, start + length, dtype=np.float64)[:, None]
    i = np.arange(dim)[None, :]
    angles = pos / np.power(max_wavelength, (2 * (i // 2)) / dim)
    return np.where(i % 2 == 0, np.sin(angles), np.cos(angles)), angles


def rotary_reference(x, positions, max_wavelength=10000.0, scaling_factor=1.0):
    """Rotate-half RoPE in float64, from its definition; and the angles."""
    dim = x.shape[-1]
    inverse = np.power(max_wavelength, -np.arange(0, dim, 2) / dim) / scaling_factor
    angles = np.asarray(positions, np.float64)[..., None] * inverse  # (..., T, D/2)
    angles = np.concatenate([angles, angles], -1)
    angles = angles[..., None, :] if angles.ndim == 3 else angles[None, :, None, :]
    half = dim // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], -1)
    return x * np.cos(angles) + rotated * np.sin(angles), angles


def masking_bias(mask):
    """An additive bias that does what the boolean `mask` does."""
    return np.where(mask, 0.0, -1e9).astype("float32")


# --- Generation: a tiny model and the references of `generate` ----------------


def decoder_only_model(vocabulary_size, width, num_key_value_heads=None, seed=0):
    """Two causal decoders on a padding-aware sinusoidal embedding, with a
    Dropout and a LayerNormalization on the way to a Dense head."""
    keras.utils.set_random_seed(seed)
    ids = keras.Input((None,), dtype="int32", name="ids")
    x = SinusoidalEmbedding(
        vocabulary_size=vocabulary_size, embedding_dim=width, mask_zero=True
    )(ids)
    x = TransformerDecoder(32, 4, num_key_value_heads=num_key_value_heads)(x)
    x = keras.layers.Dropout(0.1)(x)
    x = TransformerDecoder(32, 4, normalize_first=True)(x)
    x = keras.layers.LayerNormalization()(x)
    return keras.Model(ids, keras.layers.Dense(vocabulary_size)(x))


def next_token_logits(model, prefix, source=None, width=16):
    """The model's logits after `prefix`, from a call on the whole prefix.

    The prefix sits in a fixed-width buffer of trailing padding, which the causal
    decoder cannot see, so every call has one shape (JAX compiles it once).
    """
    ids = np.zeros((1, width), "int32")
    ids[0, : len(prefix)] = prefix
    inputs = ids if source is None else [np.array([source], "int32"), ids]
    return to_numpy(model(inputs))[0, len(prefix) - 1]


def naive_greedy(model, prompt, max_length, source=None):
    """Call the model on the whole prefix, take the argmax, repeat."""
    sequence = list(prompt)
    while len(sequence) < max_length:
        sequence.append(int(next_token_logits(model, sequence, source).argmax()))
    return sequence


def reference_decode(
    model,
    prompt,
    max_length,
    repetition_penalty=1.0,
    end_token_ids=(),
    min_new_tokens=0,
    pad_token_id=0,
):
    """Greedy decoding as Hugging Face's `generate` runs it, on the whole
    prefix each step, in float64: the repetition penalty (finite; logits of
    tokens seen so far divided if positive, multiplied if negative), end
    tokens removed before `min_new_tokens` new ones, the argmax; after an end
    token, `pad_token_id`. Returns `(tokens, scores)` as lists, scores the
    log-softmax of the processed logits at each chosen token (0 in the prompt
    and after the end)."""
    tokens, scores = list(prompt), [0.0] * len(prompt)
    while len(tokens) < max_length:
        logits = next_token_logits(model, tokens).astype(np.float64)
        seen = np.isin(np.arange(len(logits)), tokens)
        penalized = np.where(
            logits > 0, logits / repetition_penalty, logits * repetition_penalty
        )
        logits = np.where(seen, penalized, logits)
        if len(tokens) - len(prompt) < min_new_tokens:
            logits[list(end_token_ids)] = -np.inf
        token = int(logits.argmax())
        shifted = logits - logits.max()
        log_probs = shifted - np.log(np.exp(shifted).sum())
        tokens.append(token)
        scores.append(float(log_probs[token]))
        if token in end_token_ids:
            break
    padding = max_length - len(tokens)
    return tokens + [pad_token_id] * padding, scores + [0.0] * padding


def counter_uniform_reference(seed, rows, step):
    """`keras_attn.generation.strategies.counter_uniform` in np.uint32, whose
    arithmetic wraps: lowbias32 (C. Wellons, 2018) of `step ^ seed * golden`,
    then of that `^ row`; the top 24 bits over 2**24. `rows` an int array."""

    def lowbias32(x):
        x = x ^ (x >> np.uint32(16))
        x = x * np.uint32(0x7FEB352D)
        x = x ^ (x >> np.uint32(15))
        x = x * np.uint32(0x846CA68B)
        return x ^ (x >> np.uint32(16))

    with np.errstate(over="ignore"):
        golden = np.uint32(0x9E3779B9)
        x = lowbias32(np.uint32(step) ^ (np.uint32(seed) * golden))
        x = lowbias32(x ^ np.asarray(rows).astype(np.uint32))
    return (x >> np.uint32(8)).astype(np.float64) / 2**24


def start_process(args, cwd, **env):
    """`python ARGS` on CPU devices only, in its own process group (so that
    everything it starts can be stopped together), its output captured. `env`
    changes this process's environment; a `None` removes a variable."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "JAX_PLATFORMS": "cpu", **env}
    return subprocess.Popen(
        [sys.executable, *map(str, args)],
        cwd=cwd,
        env={k: v for k, v in env.items() if v is not None},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def stop_process(process):
    """Kill a process started by `start_process` and everything it started."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.communicate()


def finish_process(process, timeout):
    """Wait at most `timeout` seconds; its output, after checking that it
    succeeded. On a timeout or a failure, its whole group is killed."""
    try:
        log, _ = process.communicate(timeout=max(timeout, 1))
    except subprocess.TimeoutExpired:
        stop_process(process)
        raise AssertionError(
            f"Timed out after {timeout:.0f} s: {process.args}"
        ) from None
    if process.returncode:
        stop_process(process)  # Whatever it started and left running.
    assert process.returncode == 0, log[-5000:]
    return log
