"""A sparse mixture-of-experts feed-forward layer (Mixtral, Qwen3-MoE,
gpt-oss, DeepSeek-V3), dropless: every token reaches its `top_k` experts."""

import keras
from keras import ops

from keras_attn._checks import (
    check_bool,
    check_count,
    check_one_of,
    check_positive_float,
    check_positive_int,
    check_rank,
    check_width,
    get_keras_object,
)
from keras_attn.layers._lean_call import call_sublayer
from keras_attn.layers._machinery import (
    ConfigCheck,
    all_layers,
    clone_initializer,
    leaf_dtype,
)
from keras_attn.ops import routing
from keras_attn.ops.experts import ExpertWeights, expert_feedforward

ROUTERS = ("softmax", "top_k_softmax", "sigmoid")


@keras.saving.register_keras_serializable(package="keras_attn")
class MixtureOfExperts(ConfigCheck, keras.layers.Layer):
    """Sparse mixture of experts: each token through `top_k` of `num_experts`
    feed-forward networks, weighted by a learned router (Shazeer et al. 2017;
    Fedus et al. 2021), dropless (no capacity: no token is dropped).

    Routers (`router`), on the logits of a `Dense` named `router`:
    `"softmax"`: softmax over all experts, the `top_k` largest, renormalized
    to sum 1 with `normalize_top_k` (Mixtral; Qwen3-MoE's `norm_topk_prob`);
    `"top_k_softmax"`: the `top_k` largest logits, softmax over them
    (gpt-oss; `normalize_top_k` unused); `"sigmoid"`: DeepSeek-V3's sigmoid
    scores, chosen with the `score_correction_bias` added and within the
    `top_k_groups` best of `num_expert_groups` groups, weighted by the
    uncorrected scores (divided by their sum with `normalize_top_k`).
    `routed_scaling_factor` multiplies the weights of every router.

    Each expert: gated `activation(x W_g + b_g) * (x W_1 + b_1)`, or plain
    `activation(x W_1 + b_1)`, then `W_2`. With `swiglu_limit` (gpt-oss):
    `(clip(up, -l, l) + 1) * g * sigmoid(swiglu_alpha * g)`, `g = min(gate,
    l)`, and `activation` is unused. Shared experts (DeepSeek-V3) see every
    token and are added unweighted.

    Weights: `intermediate_kernel` `(E, D, F)`, `gate_kernel` `(E, D, F)`
    (gated), `output_kernel` `(E, F, D)`, with `use_bias` `intermediate_bias`
    `(E, F)`, `gate_bias` `(E, F)`, `output_bias` `(E, D)`; the `router`
    Dense; `score_correction_bias` `(E,)` (not trainable); `expert_load`
    `(E,)` (not trainable): the token assignments each expert received in
    the last training call (updated in training only, as BatchNormalization
    updates its statistics: a compiled decoding loop could not carry it);
    shared experts: Dense layers `shared_gate_dense`,
    `shared_intermediate_dense`, `shared_output_dense`.

    In training, `load_balancing_loss * E * sum_e f_e P_e` (Switch
    Transformer, as `transformers`' `load_balancing_loss_func` computes it
    for one layer) and `router_z_loss * mean(logsumexp(logits)^2)` are
    added with `add_loss` (nothing for a zero coefficient).

    LoRA and quantization: Keras' reach Dense layers, not these expert
    tensors. `enable_lora` and `quantize` on this layer raise; a model's
    `model.quantize(...)` quantizes the `router` and shared-expert Dense
    layers (Keras quantizes leaf layers) and leaves the experts in float.

    Args:
        num_experts: int. Number of routed experts `E`.
        intermediate_dim: int. Each expert's hidden width `F`.
        top_k: int. Experts per token, at most `num_experts`.
        activation: Hidden activation. Defaults to `"silu"`.
        gated: bool. Gated (SwiGLU with silu) experts. Defaults to `True`.
        use_bias: bool. Biases on the experts' and shared experts'
            matrices. Defaults to `False`.
        router: `"softmax"`, `"top_k_softmax"` or `"sigmoid"`.
        normalize_top_k: bool. Renormalize the `k` weights. Defaults to
            `True`.
        routed_scaling_factor: float. Multiplies the routing weights.
        num_expert_groups: optional int dividing `num_experts`: groups of
            the `"sigmoid"` router's group-limited choice.
        top_k_groups: optional int: groups kept (with `num_expert_groups`).
        use_router_bias: bool. A bias on the router. Defaults to `False`.
        use_score_correction_bias: bool. The `"sigmoid"` router's
            `score_correction_bias`. Defaults to `False`.
        num_shared_experts: int >= 0. Defaults to `0`.
        shared_intermediate_dim: optional int. The shared experts' width;
            defaults to `num_shared_experts * intermediate_dim`.
        swiglu_limit: optional positive float: gpt-oss' clamped SwiGLU
            (requires `gated`).
        swiglu_alpha: float. Its sigmoid's slope. Defaults to `1.702`.
        load_balancing_loss: float >= 0. Coefficient. Defaults to `0.0`.
        router_z_loss: float >= 0. Coefficient. Defaults to `0.0`.
        kernel_initializer: Initializer of every matrix.
        bias_initializer: Initializer of every bias.
        **kwargs: Base layer arguments (`name`, `dtype`, ...).

    Call arguments:
        inputs: float tensor `(batch, length, width)`.
        training: bool. Adds the losses and records `expert_load`.
        mask: optional bool `(batch, length)`, False for padding tokens,
            which the losses and `expert_load` leave out (the blocks pass
            their padding mask).

    Returns:
        Tensor of the input's shape.

    Example:
    >>> moe = keras_attn.layers.MixtureOfExperts(4, intermediate_dim=8, top_k=2)
    >>> tuple(moe(np.zeros((2, 3, 6))).shape)
    (2, 3, 6)
    """

    def __init__(
        self,
        num_experts,
        intermediate_dim,
        top_k,
        *,
        activation="silu",
        gated=True,
        use_bias=False,
        router="softmax",
        normalize_top_k=True,
        routed_scaling_factor=1.0,
        num_expert_groups=None,
        top_k_groups=None,
        use_router_bias=False,
        use_score_correction_bias=False,
        num_shared_experts=0,
        shared_intermediate_dim=None,
        swiglu_limit=None,
        swiglu_alpha=1.702,
        load_balancing_loss=0.0,
        router_z_loss=0.0,
        kernel_initializer="glorot_uniform",
        bias_initializer="zeros",
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.num_experts = check_positive_int("num_experts", num_experts)
        self.intermediate_dim = check_positive_int("intermediate_dim", intermediate_dim)
        self.top_k = check_positive_int("top_k", top_k)
        self.activation = get_keras_object(
            "activation", keras.activations.get, activation
        )
        self.gated = check_bool("gated", gated)
        self.use_bias = check_bool("use_bias", use_bias)
        self.router_kind = check_one_of("router", router, ROUTERS)
        self.normalize_top_k = check_bool("normalize_top_k", normalize_top_k)
        self.routed_scaling_factor = check_positive_float(
            "routed_scaling_factor", routed_scaling_factor
        )
        self.num_expert_groups = check_positive_int(
            "num_expert_groups", num_expert_groups, allow_none=True
        )
        self.top_k_groups = check_positive_int(
            "top_k_groups", top_k_groups, allow_none=True
        )
        self.use_router_bias = check_bool("use_router_bias", use_router_bias)
        self.use_score_correction_bias = check_bool(
            "use_score_correction_bias", use_score_correction_bias
        )
        self.num_shared_experts = check_count("num_shared_experts", num_shared_experts)
        self.shared_intermediate_dim = check_positive_int(
            "shared_intermediate_dim", shared_intermediate_dim, allow_none=True
        )
        self.swiglu_limit = check_positive_float(
            "swiglu_limit", swiglu_limit, allow_none=True
        )
        self.swiglu_alpha = check_positive_float("swiglu_alpha", swiglu_alpha)
        self.load_balancing_loss = _coefficient(
            "load_balancing_loss", load_balancing_loss
        )
        self.router_z_loss = _coefficient("router_z_loss", router_z_loss)
        self.kernel_initializer = get_keras_object(
            "kernel_initializer", keras.initializers.get, kernel_initializer
        )
        self.bias_initializer = get_keras_object(
            "bias_initializer", keras.initializers.get, bias_initializer
        )
        self._check_routing()
        self.supports_masking = True

    def _check_routing(self):
        """The arguments that depend on each other."""
        if self.top_k > self.num_experts:
            raise ValueError(
                "`top_k` must be at most `num_experts`. Received: "
                f"top_k={self.top_k}, num_experts={self.num_experts}."
            )
        if self.swiglu_limit is not None and not self.gated:
            raise ValueError(
                "`swiglu_limit` (gpt-oss' clamped SwiGLU) needs gated experts. "
                f"Received: swiglu_limit={self.swiglu_limit}, gated=False. "
                "Pass `gated=True` or leave `swiglu_limit` out."
            )
        sigmoid_only = {
            "use_score_correction_bias": self.use_score_correction_bias,
            "num_expert_groups": self.num_expert_groups,
        }
        for name, value in sigmoid_only.items():
            if value and self.router_kind != "sigmoid":
                raise ValueError(
                    f"`{name}` needs `router='sigmoid'` (DeepSeek-V3's router). "
                    f"Received: {name}={value!r}, router={self.router_kind!r}."
                )
        if self.load_balancing_loss and self.router_kind == "sigmoid":
            raise ValueError(
                "`load_balancing_loss` is Switch's loss over a softmax's top-k, "
                "and the 'sigmoid' router chooses otherwise (its correction "
                "bias and groups balance the load instead, as DeepSeek-V3's "
                f"does). Received: load_balancing_loss={self.load_balancing_loss}, "
                "router='sigmoid'. Pass load_balancing_loss=0.0."
            )
        self._check_groups()

    def _check_groups(self):
        groups, kept = self.num_expert_groups, self.top_k_groups
        if (groups is None) != (kept is None):
            raise ValueError(
                "`num_expert_groups` and `top_k_groups` go together. Received: "
                f"num_expert_groups={groups}, top_k_groups={kept}."
            )
        if groups is None:
            return
        if self.num_experts % groups:
            raise ValueError(
                "`num_expert_groups` must divide `num_experts`. Received: "
                f"num_expert_groups={groups}, num_experts={self.num_experts}."
            )
        if kept > groups:
            raise ValueError(
                "`top_k_groups` must be at most `num_expert_groups`. Received: "
                f"top_k_groups={kept}, num_expert_groups={groups}."
            )
        if self.top_k > kept * (self.num_experts // groups):
            raise ValueError(
                "`top_k` must be at most the experts of the kept groups "
                "(`top_k_groups * num_experts / num_expert_groups`). Received: "
                f"top_k={self.top_k}, top_k_groups={kept}, num_experts="
                f"{self.num_experts}, num_expert_groups={groups}."
            )

    def build(self, inputs_shape):
        check_rank("inputs", inputs_shape, 3, "(batch, length, width)")
        width = inputs_shape[-1]
        # DeepSeek-V3's sigmoid router and its correction bias are float32
        # whatever the model's dtype (transformers' DeepseekV3TopkRouter):
        # a bfloat16 logit would change which experts are chosen.
        float32 = self.router_kind == "sigmoid"
        self.router = self._dense(
            "router", self.num_experts, width, self.use_router_bias, float32
        )
        self._add_experts(width)
        self.score_correction_bias = None
        if self.use_score_correction_bias:
            self.score_correction_bias = self.add_weight(
                name="score_correction_bias",
                shape=(self.num_experts,),
                initializer="zeros",
                dtype="float32",
                trainable=False,
            )
        self.expert_load = self.add_weight(
            name="expert_load",
            shape=(self.num_experts,),
            initializer="zeros",
            dtype="float32",
            trainable=False,
        )
        self._build_shared(width)
        self.built = True

    def _add_experts(self, width):
        experts, hidden = self.num_experts, self.intermediate_dim
        self.intermediate_kernel = self._expert_weight(
            "intermediate_kernel", (experts, width, hidden)
        )
        self.intermediate_bias = self._expert_bias("intermediate_bias", hidden)
        self.gate_kernel = self.gate_bias = None
        if self.gated:
            self.gate_kernel = self._expert_weight(
                "gate_kernel", (experts, width, hidden)
            )
            self.gate_bias = self._expert_bias("gate_bias", hidden)
        self.output_kernel = self._expert_weight(
            "output_kernel", (experts, hidden, width)
        )
        self.output_bias = self._expert_bias("output_bias", width)

    def _expert_weight(self, name, shape, initializer=None):
        return self.add_weight(
            name=name,
            shape=shape,
            initializer=clone_initializer(initializer or self.kernel_initializer),
        )

    def _expert_bias(self, name, units):
        """An `(E, units)` bias with `use_bias`, else `None`."""
        if not self.use_bias:
            return None
        return self._expert_weight(
            name, (self.num_experts, units), self.bias_initializer
        )

    def _build_shared(self, width):
        self.shared_gate_dense = None
        self.shared_intermediate_dense = self.shared_output_dense = None
        if not self.num_shared_experts:
            return
        hidden = self.shared_intermediate_dim or (
            self.num_shared_experts * self.intermediate_dim
        )
        if self.gated:
            self.shared_gate_dense = self._dense("shared_gate_dense", hidden, width)
        self.shared_intermediate_dense = self._dense(
            "shared_intermediate_dense", hidden, width
        )
        self.shared_output_dense = self._dense("shared_output_dense", width, hidden)

    def _dense(self, name, units, input_width, use_bias=None, float32=False):
        dense = keras.layers.Dense(
            units,
            use_bias=self.use_bias if use_bias is None else use_bias,
            kernel_initializer=clone_initializer(self.kernel_initializer),
            bias_initializer=clone_initializer(self.bias_initializer),
            dtype="float32" if float32 else leaf_dtype(self, name),
            name=name,
        )
        dense.build((None, input_width))
        return dense

    def call(self, inputs, training=None, mask=None):
        width = self.intermediate_kernel.shape[1]
        check_width("inputs", inputs.shape, width)
        x = ops.reshape(inputs, (-1, width))  # (N, D)
        logits = call_sublayer(self.router, x)  # (N, E)
        weights, ids = self.route(logits)  # (N, k)
        out = expert_feedforward(
            x, ids, ops.cast(weights, x.dtype), self._expert_weights(), self._hidden
        )
        if self.num_shared_experts:
            out = out + self._shared(x)
        if training:
            real = (
                None if mask is None else ops.reshape(ops.cast(mask, "float32"), (-1,))
            )
            self._add_losses(logits, real)
            self._record_load(ids, real)
        return ops.reshape(out, ops.shape(inputs))

    def route(self, logits):
        """`(weights (N, k) float32, expert_ids (N, k) int32)` of the
        router's `logits` `(N, E)`, by this layer's router."""
        scale = self.routed_scaling_factor
        if self.router_kind == "softmax":
            return routing.softmax_top_k(
                logits, self.top_k, self.normalize_top_k, scale
            )
        if self.router_kind == "top_k_softmax":
            return routing.top_k_softmax(logits, self.top_k, scale)
        return routing.sigmoid_top_k(
            logits,
            self.top_k,
            self.score_correction_bias,
            self.num_expert_groups,
            self.top_k_groups,
            self.normalize_top_k,
            scale,
        )

    def _expert_weights(self):
        def read(variable):
            return None if variable is None else ops.cast(variable, self.compute_dtype)

        return ExpertWeights(
            read(self.intermediate_kernel),
            read(self.output_kernel),
            read(self.gate_kernel),
            read(self.intermediate_bias),
            read(self.gate_bias),
            read(self.output_bias),
        )

    def _hidden(self, gate, up):
        """The experts' hidden units of `gate` (None: plain) and `up`."""
        if self.swiglu_limit is not None:
            limit = self.swiglu_limit
            gate = ops.minimum(gate, limit)
            up = ops.clip(up, -limit, limit)
            return (up + 1) * gate * ops.sigmoid(gate * self.swiglu_alpha)
        if gate is None:
            return self.activation(up)
        return self.activation(gate) * up

    def _shared(self, x):
        up = call_sublayer(self.shared_intermediate_dense, x)
        gate = None
        if self.gated:
            gate = call_sublayer(self.shared_gate_dense, x)
        return call_sublayer(self.shared_output_dense, self._hidden(gate, up))

    def _add_losses(self, logits, real):
        """`real`: float `(N,)`, 0 for padding tokens (left out), or None."""
        if self.load_balancing_loss:
            loss = routing.load_balancing_loss(logits, self.top_k, real)
            self.add_loss(self.load_balancing_loss * loss)
        if self.router_z_loss:
            self.add_loss(self.router_z_loss * routing.router_z_loss(logits, real))

    def _record_load(self, ids, real):
        chosen = ops.one_hot(ids, self.num_experts, dtype="float32")  # (N, k, E)
        if real is not None:
            chosen = chosen * real[:, None, None]
        self.expert_load.assign(ops.sum(chosen, axis=(0, 1)))

    def compute_output_shape(self, inputs_shape):
        return inputs_shape

    def enable_lora(self, *args, **kwargs):
        raise ValueError(
            "`MixtureOfExperts` does not support `enable_lora`: Keras' LoRA "
            "adapts Dense layers, and the experts are (E, D, F) tensors of this "
            "layer. Train it fully, or freeze it (`layer.trainable = False`)."
        )

    def quantize(self, mode=None, *args, **kwargs):
        # NotImplementedError, as Keras' own unsupported layers: Keras 3.16's
        # `Model.quantize` asks every layer and skips those that raise it.
        raise NotImplementedError(
            "`MixtureOfExperts` does not support `quantize`: Keras quantizes "
            "Dense layers, and the experts are (E, D, F) tensors of this layer. "
            f"Received: mode={mode!r}. Note that `model.quantize(...)` "
            "quantizes only the router and shared-expert Dense layers."
        )

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "num_experts": self.num_experts,
                "intermediate_dim": self.intermediate_dim,
                "top_k": self.top_k,
                "activation": keras.activations.serialize(self.activation),
                "gated": self.gated,
                "use_bias": self.use_bias,
                "router": self.router_kind,
                "normalize_top_k": self.normalize_top_k,
                "routed_scaling_factor": self.routed_scaling_factor,
                "num_expert_groups": self.num_expert_groups,
                "top_k_groups": self.top_k_groups,
                "use_router_bias": self.use_router_bias,
                "use_score_correction_bias": self.use_score_correction_bias,
                "num_shared_experts": self.num_shared_experts,
                "shared_intermediate_dim": self.shared_intermediate_dim,
                "swiglu_limit": self.swiglu_limit,
                "swiglu_alpha": self.swiglu_alpha,
                "load_balancing_loss": self.load_balancing_loss,
                "router_z_loss": self.router_z_loss,
                "kernel_initializer": keras.initializers.serialize(
                    self.kernel_initializer
                ),
                "bias_initializer": keras.initializers.serialize(self.bias_initializer),
            }
        )
        return config


def state_paths(model):
    """The paths of `model`'s variables that are state a training step
    computes, not weights a checkpoint holds: each `MixtureOfExperts`'
    `expert_load`. Converters leave them at their initial value."""
    return {
        layer.expert_load.path
        for layer in all_layers(model)
        if isinstance(layer, MixtureOfExperts) and layer.built
    }


def _coefficient(name, value):
    """A loss coefficient: a float >= 0."""
    if value == 0:
        return 0.0
    return check_positive_float(name, value)
