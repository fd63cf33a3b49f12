"""Layout maps for `keras.distribution`: Megatron-style tensor parallelism.

`get_layout_map` gives the `keras.distribution.LayoutMap` with which
`keras.distribution.ModelParallel` splits the weights of keras_attn layers over
the model axis of a device mesh while the batch is split over its data axis.
`keras.distribution` places arrays on the JAX backend only (Keras 3.15).
"""

import re

import keras

_SPLIT = "<model axis>"  # Stands for `model_parallel_dim_name` below.
_SHARD = "<batch axis>"  # `data_parallel_dim_name`, with `shard_weights_over_batch`.
_EXPERT = "<expert axis>"  # `expert_parallel_dim_name`, when given.

# Every keras_attn weight, by the end of its variable path: the axes of its
# layout and what the split dimension counts. As in Megatron-LM (Shoeybi et al.
# 2019), the first matrix of each sublayer is split over its outputs (heads,
# intermediate units) and the second over its inputs, so each attention and
# feed-forward sublayer needs a single all-reduce. Fully sharded (ZeRO-3 / FSDP,
# Rajbhandari et al. 2020), the batch axis also splits another dimension: the
# model width where the weight has one. The stacked weights of
# `MixtureOfExperts`, `(experts, ...)`, are split like the dense feed-forward
# network's, each expert over its intermediate units; with an expert axis, also
# over the experts (GShard, Lepikhin et al. 2020). A layout gives a mesh axis
# to one dimension only: where two claim it, the first keeps it.
_UNITS = "intermediate units"
_WEIGHTS = (
    ("query/kernel", (_SHARD, _SPLIT, None), "heads"),
    ("query/bias", (_SPLIT, _SHARD), "heads"),
    ("key/kernel", (_SHARD, _SPLIT, None), "key/value heads"),
    ("key/bias", (_SPLIT, _SHARD), "key/value heads"),
    ("value/kernel", (_SHARD, _SPLIT, None), "key/value heads"),
    ("value/bias", (_SPLIT, _SHARD), "key/value heads"),
    ("gate/kernel", (_SHARD, _SPLIT, None), "heads"),
    ("gate/bias", (_SPLIT, _SHARD), "heads"),
    ("attention_output/kernel", (_SPLIT, None, _SHARD), "heads"),
    ("attention_output/bias", (_SHARD,), None),
    *(
        rule
        for network in ("feedforward", "shared")  # dense; the shared experts
        for rule in (
            (f"{network}_intermediate_dense/kernel", (_SHARD, _SPLIT), _UNITS),
            (f"{network}_intermediate_dense/bias", (_SPLIT,), _UNITS),
            (f"{network}_gate_dense/kernel", (_SHARD, _SPLIT), _UNITS),
            (f"{network}_gate_dense/bias", (_SPLIT,), _UNITS),
            (f"{network}_output_dense/kernel", (_SPLIT, _SHARD), _UNITS),
            (f"{network}_output_dense/bias", (_SHARD,), None),
        )
    ),
    ("intermediate_kernel", (_EXPERT, _SHARD, _SPLIT), _UNITS),
    ("gate_kernel", (_EXPERT, _SHARD, _SPLIT), _UNITS),
    ("output_kernel", (_EXPERT, _SPLIT, _SHARD), _UNITS),
    ("intermediate_bias", (_EXPERT, _SPLIT), _UNITS),
    ("gate_bias", (_EXPERT, _SPLIT), _UNITS),
    ("output_bias", (_EXPERT, _SHARD), None),
    ("router/kernel", (_SHARD, None), None),
    ("router/bias", (None,), None),
    ("score_correction_bias", (None,), None),
    ("expert_load", (None,), None),
    ("embeddings", (_SHARD, _SPLIT), "embedding width"),
    *(
        (f"{sublayer}_{norm}/{weight}", (_SHARD,), None)
        for sublayer in ("self_attention", "cross_attention", "feedforward")
        for norm in ("layer_norm", "output_norm")
        for weight in ("gamma", "beta", "scale")
    ),
    *((f"{name}_norm/scale", (_SHARD,), None) for name in ("query", "key")),
)
# Replicated where the model axis does not divide them: the key/value heads of
# grouped-query attention. Every other split dimension must be divisible.
_REPLICATED_IF_INDIVISIBLE = ("key/kernel", "key/bias", "value/kernel", "value/bias")


def get_layout_map(
    device_mesh,
    model_parallel_dim_name="model",
    data_parallel_dim_name="batch",
    *,
    model=None,
    shard_weights_over_batch=False,
    expert_parallel_dim_name=None,
):
    """A `keras.distribution.LayoutMap` for Megatron-style tensor parallelism.

    Splits the weights of keras_attn layers over the `model_parallel_dim_name`
    axis of `device_mesh` as Megatron-LM does (Shoeybi et al. 2019): the
    query/key/value projections over their heads and the output projection
    `W_O` over its input heads, the first feed-forward matrix over its
    intermediate units and the second over its inputs, the token embeddings
    over their width. Layouts, `"model"` standing for the model axis:

    - `query/kernel`, `key/kernel`, `value/kernel`, `gate/kernel`:
      `(None, "model", None)`; their biases `("model", None)`.
    - `attention_output/kernel`: `("model", None, None)`.
    - `feedforward_intermediate_dense/kernel` and `feedforward_gate_dense/kernel`
      (gated networks): `(None, "model")`, their biases `("model",)`;
      `feedforward_output_dense/kernel`: `("model", None)`.
    - `embeddings` (the `token_embedding` of `SinusoidalEmbedding`):
      `(None, "model")`.
    - `attention_output/bias`, `feedforward_output_dense/bias`, the layer
      and RMS norms (the sublayer output norms too) and the QK-norms:
      replicated, `(None,)`.
    - `MixtureOfExperts` (a block's `feedforward`), whose experts are stacked
      along a first dimension of E experts: each expert split like the dense
      network, over its F intermediate units. `intermediate_kernel` and
      `gate_kernel` `(E, D, F)`: `(None, None, "model")`; `output_kernel`
      `(E, F, D)`: `(None, "model", None)`; `intermediate_bias` and
      `gate_bias` `(E, F)`: `(None, "model")`; `output_bias` `(E, D)`
      replicated. The shared experts (`shared_intermediate_dense`,
      `shared_gate_dense`, `shared_output_dense`) as the dense network; the
      `router`, `score_correction_bias` and `expert_load` replicated.

    Every keras_attn weight is matched by exactly one rule. Keras'
    `keras.layers.MultiHeadAttention` has the same sublayers and weights, so
    it is split the same way; other layers' weights match none, and
    `ModelParallel` replicates them (as it does the scales of quantized
    kernels and LoRA adapters). Every weight is
    replicated across `data_parallel_dim_name`, over which the batch is split,
    unless `shard_weights_over_batch=True`.
    Layouts only place the numbers: training gives the results of one device,
    up to float rounding. They take effect on the JAX backend; on TensorFlow
    and PyTorch, Keras 3.15 accepts a `ModelParallel` but places nothing.

    Fully sharded weights (`shard_weights_over_batch=True`), as ZeRO-3
    (Rajbhandari et al. 2020) and PyTorch's FSDP keep them: every weight is
    also split over the batch axis, and with it the optimizer's variables
    (Keras gives them their weight's layout), so each device holds
    `1 / (batch axis size)` of what it held. XLA's SPMD partitioner gathers a
    weight where a step needs it whole and reduce-scatters its gradient, so
    training gives the same numbers, at the cost of that traffic. Use it when
    the weights and Adam's moments, not the activations, fill the devices. The
    batch axis splits the model width of each weight: `query/kernel` becomes
    `("batch", "model", None)`, `attention_output/kernel`
    `("model", None, "batch")`, `feedforward_output_dense/kernel`
    `("model", "batch")`, the norms and output biases `("batch",)`; the
    projection biases split their head size, `("model", "batch")`, and the
    token embeddings their rows, `("batch", "model")`. The feed-forward
    intermediate biases stay `("model",)`: a Keras layout gives each dimension
    one mesh axis. With `model`, a dimension that the batch axis does not
    divide stays whole, and the weights of other layers (a `Dense` head) are
    split over the batch axis along their largest dimension that it divides;
    without `model` the batch axis must divide the dimensions above.

    Expert parallelism (`expert_parallel_dim_name`, as GShard, Lepikhin et
    al. 2020, places experts): the stacked expert weights are split over that
    mesh axis along E, each device holding E / (axis size) whole experts;
    `intermediate_kernel` becomes `("expert", None, "model")`, `output_kernel`
    `("expert", "model", None)`, `output_bias` `("expert", None)`. The axis
    may be the model axis, whose F split the expert split then replaces
    (`("model", None, None)`: a layout gives each mesh axis one dimension),
    the batch axis, or an axis of its own (whose devices then hold the same
    attention weights and repeat the rest of the model's work). The layout
    places weights; it does not send tokens to their experts' devices, and
    XLA's SPMD partitioner partitions the layer's grouped computation around
    it. In a JAX 0.10 training step on 8 CPU devices there was no
    all-to-all (GShard's token exchange): every device sorted the token
    assignments of the whole batch (their expert ids all-gathered over the
    batch axis), and, experts over the model axis, the matrices of each
    block of sorted tokens were taken from the shards and moved between
    devices (collective permutes; there are more blocks than experts), then
    partial results all-reduced. So expert parallelism here divides the
    experts' weights and optimizer state among devices, at the cost of
    moving weights in each step; it does not divide the routing work.

    Two modes:

    - Without `model` (the usual order: the layout map first, then the model
      created under the distribution), the keys are regular expressions on the
      ends of the weights' paths (`.*/query/kernel$`), which match whatever
      the layers are called. Every split dimension must then be divisible by
      the model axis size, and the experts E by the expert axis size (JAX
      raises when the weight is created otherwise).
      Any `keras.layers.Embedding`'s `embeddings` is split like the token
      embeddings, and a weight of another kind of layer whose path ends like
      a rule (a `Dense` named `query`) would get its layout: use the `model`
      mode then, which checks the ranks.
    - With a built `model`, the same rules are resolved against its weights,
      keyed by their exact paths, and checked: the key/value projections of
      grouped-query attention whose key/value heads the model axis size does
      not divide are replicated; any other split dimension it does not divide
      raises a `ValueError` naming the weight, as do experts E that the
      expert axis size does not divide. Create the distributed model
      with the same layer names: `keras.Model.from_config(model.get_config())`
      under the distribution's scope, or a builder that names its layers
      (generated names such as `transformer_encoder_1` change from one build
      to the next).

    Args:
        device_mesh: `keras.distribution.DeviceMesh`, e.g. of shape
            `(data, model)` with axis names `["batch", "model"]`.
        model_parallel_dim_name: str. The mesh axis the weights are split over.
            Defaults to `"model"`.
        data_parallel_dim_name: str or `None`. The mesh axis the batch is split
            over (pass it to `ModelParallel` as `batch_dim_name`); `None` for a
            mesh without one. Defaults to `"batch"`.
        model: optional built `keras.Model` or layer, whose weights get exact
            rules, checked against the model axis size. Defaults to `None`.
        shard_weights_over_batch: bool. Whether to split every weight over
            `data_parallel_dim_name` too (fully sharded, FSDP style).
            Defaults to `False`.
        expert_parallel_dim_name: str or `None`. A mesh axis the experts of
            `MixtureOfExperts` layers are split over, along their expert
            dimension; `None` splits each expert over the model axis only.
            Defaults to `None`.

    Returns:
        A `keras.distribution.LayoutMap` on `device_mesh`.

    Example (a one-device mesh, for any backend; on JAX,
    `keras.distribution.list_devices()` gives the devices to build one from):
    >>> mesh = keras.distribution.DeviceMesh(
    ...     (1, 1), ["batch", "model"], devices=["cpu:0"])
    >>> layout_map = keras_attn.distribution.get_layout_map(mesh)
    >>> layout_map["translator/encoder/self_attention/query/kernel"].axes
    (None, 'model', None)
    >>> layout_map["translator/encoder/feedforward_output_dense/kernel"].axes
    ('model', None)
    >>> distribution = keras.distribution.ModelParallel(
    ...     layout_map=layout_map, batch_dim_name="batch")

    Then create, compile and fit the model under `with distribution.scope():`.
    With a model, exact paths:

    >>> encoder = keras_attn.TransformerEncoder(
    ...     64, num_heads=4, num_key_value_heads=2, name="encoder")
    >>> _ = encoder(np.zeros((1, 3, 16)))
    >>> layout_map = keras_attn.distribution.get_layout_map(mesh, model=encoder)
    >>> layout_map["encoder/self_attention/key/kernel"].axes
    (None, 'model', None)

    Fully sharded:

    >>> layout_map = keras_attn.distribution.get_layout_map(
    ...     mesh, shard_weights_over_batch=True)
    >>> layout_map["translator/encoder/self_attention/query/kernel"].axes
    ('batch', 'model', None)

    Experts split over the model axis (a mesh `(batch, expert, model)` and
    `expert_parallel_dim_name="expert"` would split them over both):

    >>> path = "lm/transformer_layer_0/feedforward/intermediate_kernel"
    >>> keras_attn.distribution.get_layout_map(mesh)[path].axes
    (None, None, 'model')
    >>> layout_map = keras_attn.distribution.get_layout_map(
    ...     mesh, expert_parallel_dim_name="model")
    >>> layout_map[path].axes
    ('model', None, None)
    """
    sizes = _axis_sizes(
        device_mesh,
        model_parallel_dim_name,
        data_parallel_dim_name,
        expert_parallel_dim_name,
    )
    names = {
        _SPLIT: model_parallel_dim_name,
        _SHARD: _fully_sharded_axis(shard_weights_over_batch, data_parallel_dim_name),
        _EXPERT: expert_parallel_dim_name,
    }
    rules = [
        (f".*/{re.escape(suffix)}$", suffix, axes, _axes(axes, names), what)
        for suffix, axes, what in _WEIGHTS
    ]
    layout_map = keras.distribution.LayoutMap(device_mesh)
    if model is None:
        for pattern, _, _, axes, _ in rules:
            layout_map[pattern] = axes
        return layout_map
    # `LayoutMap` matches keys as regexes, even `in`: keep track of the paths.
    paths = set()
    for variable in _built_weights(model):
        axes = _weight_axes(variable, rules, sizes, names[_SHARD])
        if axes is None:
            continue  # Not a keras_attn weight, and not fully sharded.
        if variable.path in paths:
            raise ValueError(
                f"Two weights of `model` have the path '{variable.path}', so a "
                "layout map cannot tell them apart. Give the layers distinct "
                "names."
            )
        paths.add(variable.path)
        # Escaped: exact even with `.` or `+` in layer names.
        layout_map[re.escape(variable.path)] = axes
    return layout_map


def _axis_sizes(device_mesh, model_dim, data_dim, expert_dim):
    """Raise unless the axis names are the mesh's; the size of each axis."""
    if not isinstance(device_mesh, keras.distribution.DeviceMesh):
        raise TypeError(
            "`device_mesh` must be a `keras.distribution.DeviceMesh`. "
            f"Received: device_mesh={device_mesh!r} of type "
            f"{type(device_mesh).__name__}."
        )
    names = list(device_mesh.axis_names)
    if model_dim not in names:
        raise ValueError(
            "`model_parallel_dim_name` must name an axis of `device_mesh`. "
            f"Received: model_parallel_dim_name={model_dim!r}, "
            f"device_mesh.axis_names={names}."
        )
    if data_dim is not None and (data_dim not in names or data_dim == model_dim):
        raise ValueError(
            "`data_parallel_dim_name` must name another axis of `device_mesh` "
            f"than the model axis, or be None. Received: "
            f"data_parallel_dim_name={data_dim!r}, model_parallel_dim_name="
            f"{model_dim!r}, device_mesh.axis_names={names}."
        )
    if expert_dim is not None and expert_dim not in names:
        raise ValueError(
            "`expert_parallel_dim_name` must name an axis of `device_mesh` (the "
            "model axis, the batch axis or another one), or be None. Received: "
            f"expert_parallel_dim_name={expert_dim!r}, "
            f"device_mesh.axis_names={names}."
        )
    return dict(zip(names, device_mesh.shape, strict=True))


def _fully_sharded_axis(shard_weights_over_batch, data_dim):
    """The axis that also splits every weight, or None."""
    if not isinstance(shard_weights_over_batch, bool):
        raise TypeError(
            "`shard_weights_over_batch` must be a bool. Received: "
            f"shard_weights_over_batch={shard_weights_over_batch!r}."
        )
    if shard_weights_over_batch and data_dim is None:
        raise ValueError(
            "`shard_weights_over_batch=True` splits the weights over the batch "
            "axis, so `data_parallel_dim_name` must name it. Received: "
            "data_parallel_dim_name=None."
        )
    return data_dim if shard_weights_over_batch else None


def _axes(template, names):
    """A rule's mesh axes; each axis splits one dimension, the first claiming it
    (experts over the model axis leave their intermediate units whole)."""
    axes = []
    for axis in (names.get(axis, axis) for axis in template):
        axes.append(None if axis in axes else axis)
    return tuple(axes)


def _built_weights(model):
    if not getattr(model, "built", False):
        raise ValueError(
            "`model` must be built, so that its weights exist: create it from "
            "`keras.Input`s or call it once on data. "
            f"Received: model '{model.name}', not built."
        )
    return model.weights


def _weight_axes(variable, rules, sizes, batch_dim):
    """The layout axes of one weight of a built model, or None to replicate."""
    rule = next((r for r in rules if re.fullmatch(r[0], variable.path)), None)
    if rule is None or len(variable.shape) != len(rule[2]):
        if batch_dim is None:
            return None
        return _largest_dimension_over(variable.shape, batch_dim, sizes[batch_dim])
    return tuple(
        _checked_axis(variable, rule, dim, sizes) for dim in range(len(rule[2]))
    )


def _largest_dimension_over(shape, batch_dim, batch_size):
    """Another layer's weight, fully sharded: its largest dimension that the
    batch axis divides is split over it."""
    divisible = [i for i, size in enumerate(shape) if size % batch_size == 0]
    if not divisible:
        return (None,) * len(shape)
    largest = max(divisible, key=lambda i: shape[i])
    return tuple(batch_dim if i == largest else None for i in range(len(shape)))


def _checked_axis(variable, rule, dim, sizes):
    """The rule's axis for dimension `dim` where its size divides it. Where
    not: whole for the fully sharded split and for grouped-query key/value
    heads; a `ValueError` for any other split."""
    _, suffix, template, axes, what = rule
    axis, size = axes[dim], variable.shape[dim]
    if axis is None or size % sizes[axis] == 0:
        return axis
    if template[dim] == _SHARD:
        return None
    if template[dim] == _SPLIT and suffix in _REPLICATED_IF_INDIVISIBLE:
        return None
    received = (
        f"Received: weight '{variable.path}' of shape {tuple(variable.shape)}, "
        f"whose dimension {dim} "
    )
    if template[dim] == _EXPERT:
        raise ValueError(
            f"`expert_parallel_dim_name` '{axis}' (size {sizes[axis]}) must "
            "divide the experts of every MixtureOfExperts layer: expert "
            f"parallelism splits them over it. {received}(experts) is {size}. "
            f"Use an expert axis whose size divides {size}, or "
            "`expert_parallel_dim_name=None` (each expert split over its "
            "intermediate units instead)."
        )
    raise ValueError(
        f"The model axis '{axis}' (size {sizes[axis]}) must divide the "
        f"{what} of every keras_attn layer: tensor parallelism splits them over "
        f"it. {received}({what}) is {size}. "
        f"Use a model axis whose size divides {size}, or change the layer."
    )
