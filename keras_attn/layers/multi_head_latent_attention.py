"""Multi-head latent attention (DeepSeek-V2/V3): keys and values decompressed
from one small latent per token, which is all a decoding cache keeps."""

import math

import keras
from keras import ops

from keras_attn._checks import (
    check_bool,
    check_positive_float,
    check_positive_int,
    check_rank,
    check_rate,
    check_size,
    get_keras_object,
)
from keras_attn.cache import LatentCache
from keras_attn.layers import _int8
from keras_attn.layers import _latent_attention_checks as _checks
from keras_attn.layers._attention_axes import AttentionAxes
from keras_attn.layers._attention_call import AttentionCall
from keras_attn.layers._docs import shared_docs
from keras_attn.layers._initializers import MatrixInitializer
from keras_attn.layers._lean_call import call_sublayer
from keras_attn.layers._machinery import (
    ConfigCheck,
    clone_initializer,
    dtype_config,
    enable_lora,
    leaf_dtype,
)
from keras_attn.ops.attention import attend
from keras_attn.ops.dtypes import dtype_name
from keras_attn.ops.plan import fused_limits, refuse_flash
from keras_attn.ops.positions import check_rope_scaling, rotate


@keras.saving.register_keras_serializable(package="keras_attn")
@shared_docs
class MultiHeadLatentAttention(ConfigCheck, keras.layers.Layer):
    """Multi-head latent attention (MLA, DeepSeek-AI 2024: DeepSeek-V2, V3).

    Each token is compressed to a latent `c = RMSNorm(x W_DKV)` of
    `kv_lora_rank` numbers and one rotary key `k_rope = RoPE(x W_KR)` that
    all heads share; each head's key is `[c W_UK, k_rope]` and its value
    `c W_UV`. Queries are `[q_nope, RoPE(q_rope)]` from `x W_Q`, or from the
    low-rank `RMSNorm(x W_DQ) W_UQ` with `q_lora_rank`. The scores are
    scaled by `attention_scale` (`1 / sqrt(qk_nope_head_dim +
    qk_rope_head_dim)` by default). Numbers as Hugging Face's
    `DeepseekV3Attention`, including its interleaved rotary channels
    (`rope_interleave=True`: channel pairs `(2i, 2i + 1)` rotate together).

    A cache (`get_empty_cache`, a `keras_attn.cache.LatentCache`) keeps
    only `c` and `k_rope` per token. `call` expands them into keys and
    values; `decode_unchecked` (the decoding steps of
    `keras_attn.generation.generate`) attends over them directly in the
    absorbed form of the paper's appendix: `q_nope W_UK^T` against `c`,
    `q_rope` against `k_rope`, and `W_UV` after the weighted sum, one
    key/value head of width `kv_lora_rank + qk_rope_head_dim` for every
    query head (as vLLM runs MLA).

    Sublayers (Keras `EinsumDense` and `RMSNormalization`, so quantization,
    LoRA and dtype-policy maps reach them): `query` `(width, heads,
    nope + rope)`, or `query_a` `(width, q_lora_rank)`, `query_a_norm` and
    `query_b` `(q_lora_rank, heads, nope + rope)`; `key_value_a` `(width,
    kv_lora_rank + rope)`, `key_value_a_norm`, `key_value_b`
    `(kv_lora_rank, heads, nope + v)`; `attention_output` `(heads, v,
    width)`. Biases (`use_bias`) on `query_a`, `key_value_a` and
    `attention_output`, as in DeepSeek's `attention_bias`.

    Args:
        num_heads: int. Number of query heads.
        kv_lora_rank: int. Width of the key/value latent `c`.
        qk_nope_head_dim: int. Per-head query/key channels without rotation.
        qk_rope_head_dim: int, even. Per-head query channels, and the shared
            key's, that are rotated.
        v_head_dim: int. Per-head value width.
        q_lora_rank: optional int, keyword only. Width of the query latent;
            `None` (default) projects queries directly.
        rope_max_wavelength: float. RoPE base. Defaults to `10000.0`.
        rope_scaling: optional dict, as `keras_attn.ops.rotary_embedding`'s
            `scaling` (`{"rope_type": "yarn", ...}`).
        rope_interleave: bool. DeepSeek's interleaved rotary channels.
            Defaults to `True`.
        attention_scale: optional float. Scale of the scores.
        norm_epsilon: float. Epsilon of the latent RMS norms. Defaults to
            `1e-6`.
        use_bias: bool. Defaults to `False`.
        dropout: float in [0, 1). Dropout on the attention weights.
        flash_attention: `None`, `True` or `False`, as in
            `keras_attn.MultiHeadAttention` (`True` needs `v_head_dim ==
            qk_nope_head_dim + qk_rope_head_dim`).
        kernel_initializer: initializer of the kernels.
        **kwargs: Base layer arguments (`name`, `dtype`, ...).

    Call arguments:
        query: float `(batch, length, width)` (self-attention).
        value_mask: optional bool `(batch, key_length)`, True for real keys
            (the cache's positions with a cache).
        attention_mask: optional bool `(batch, length, key_length)`.
        use_causal_mask: bool. Defaults to `False`.
        cache: optional `LatentCache`, with `cache_update_index` (the
            position of the first query): the new tokens are written there
            and every position is attended over.
        positions: optional int `(length,)` or `(batch, length)`: rotary
            positions; default `cache_update_index` (or 0) onwards.
        training, return_attention_scores, attention_bias, segment_ids:
            as in `keras_attn.MultiHeadAttention`.

    Returns:
        `output` `(batch, length, width)`; with `return_attention_scores`,
        `(output, scores (batch, num_heads, length, key_length))`; with a
        cache, the updated cache last.

    Example:
    >>> mla = keras_attn.layers.MultiHeadLatentAttention(
    ...     num_heads=4, kv_lora_rank=8, qk_nope_head_dim=6,
    ...     qk_rope_head_dim=4, v_head_dim=5)
    >>> x = np.random.rand(2, 7, 16).astype("float32")
    >>> tuple(mla(x, use_causal_mask=True).shape)
    (2, 7, 16)
    >>> cache = mla.get_empty_cache(2, max_length=7)
    >>> tuple(cache.latent.shape)  # kv_lora_rank + qk_rope_head_dim a token
    (2, 7, 12)
    """

    def __init__(
        self,
        num_heads,
        kv_lora_rank,
        qk_nope_head_dim,
        qk_rope_head_dim,
        v_head_dim,
        *,
        q_lora_rank=None,
        rope_max_wavelength=10000.0,
        rope_scaling=None,
        rope_interleave=True,
        attention_scale=None,
        norm_epsilon=1e-6,
        use_bias=False,
        dropout=0.0,
        flash_attention=None,
        kernel_initializer="glorot_uniform",
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.num_heads = check_positive_int("num_heads", num_heads)
        self.kv_lora_rank = check_positive_int("kv_lora_rank", kv_lora_rank)
        self.qk_nope_head_dim = check_positive_int("qk_nope_head_dim", qk_nope_head_dim)
        self.qk_rope_head_dim = _checks.check_even(qk_rope_head_dim)
        self.v_head_dim = check_positive_int("v_head_dim", v_head_dim)
        self.q_lora_rank = check_positive_int("q_lora_rank", q_lora_rank, True)
        self.rope_max_wavelength = check_positive_float(
            "rope_max_wavelength", rope_max_wavelength
        )
        self.rope_scaling = check_rope_scaling(rope_scaling, "rope_scaling")
        self.rope_interleave = check_bool("rope_interleave", rope_interleave)
        self.attention_scale = check_positive_float(
            "attention_scale", attention_scale, allow_none=True
        )
        self.norm_epsilon = check_positive_float("norm_epsilon", norm_epsilon)
        self.use_bias = check_bool("use_bias", use_bias)
        self.dropout = check_rate("dropout", dropout)
        self.flash_attention = check_bool("flash_attention", flash_attention, True)
        self.kernel_initializer = get_keras_object(
            "kernel_initializer", keras.initializers.get, kernel_initializer
        )
        qk_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        limits = fused_limits(
            key_width=qk_dim, value_width=self.v_head_dim, dropout=self.dropout > 0
        )
        if self.flash_attention and limits:
            refuse_flash(limits, f"v_head_dim={v_head_dim}, dropout={dropout}")
        self._scale = self.attention_scale or 1.0 / math.sqrt(qk_dim)
        self.supports_masking = True

    # --- Building -------------------------------------------------------------

    def build(self, query_shape):
        check_rank("query", query_shape, 3, "(batch, length, width)")
        width = query_shape[-1]
        heads, qk_dim = self.num_heads, self.qk_nope_head_dim + self.qk_rope_head_dim
        if self.q_lora_rank is None:
            self.query = self._dense("query", (width,), (heads, qk_dim))
        else:
            rank = self.q_lora_rank
            self.query_a = self._dense("query_a", (width,), (rank,), self.use_bias)
            self.query_a_norm = self._norm("query_a_norm", rank)
            self.query_b = self._dense("query_b", (rank,), (heads, qk_dim))
        latent = self.kv_lora_rank
        self.key_value_a = self._dense(
            "key_value_a", (width,), (latent + self.qk_rope_head_dim,), self.use_bias
        )
        self.key_value_a_norm = self._norm("key_value_a_norm", latent)
        self.key_value_b = self._dense(
            "key_value_b", (latent,), (heads, self.qk_nope_head_dim + self.v_head_dim)
        )
        self.attention_output = self._dense(
            "attention_output", (heads, self.v_head_dim), (width,), self.use_bias
        )
        self._attention_dropout = keras.layers.Dropout(
            self.dropout, dtype=leaf_dtype(self, "dropout"), name="dropout"
        )
        self._width, self._axes = width, AttentionAxes(None, 3)
        self.built = True

    def _dense(self, name, inputs, outputs, use_bias=False):
        """`EinsumDense` `(B, T, *inputs)` -> `(B, T, *outputs)`."""
        ins, outs = "cd"[: len(inputs)], "efg"[: len(outputs)]
        dense = _int8.EinsumDense(
            f"ab{ins},{ins}{outs}->ab{outs}",
            output_shape=(None, *outputs),
            bias_axes=outs if use_bias else None,
            kernel_initializer=MatrixInitializer(
                clone_initializer(self.kernel_initializer), fan_in_axes=len(inputs)
            ),
            dtype=leaf_dtype(self, name),
            name=name,
        )
        dense.supports_masking = True  # position-wise
        dense.build((None, None, *inputs))
        return dense

    def _norm(self, name, width):
        norm = keras.layers.RMSNormalization(
            epsilon=self.norm_epsilon, dtype=leaf_dtype(self, name), name=name
        )
        norm.supports_masking = True
        norm.build((None, None, width))
        return norm

    # --- The call -------------------------------------------------------------

    def call(
        self,
        query,
        query_mask=None,
        value_mask=None,
        attention_mask=None,
        use_causal_mask=False,
        cache=None,
        cache_update_index=None,
        positions=None,
        training=None,
        return_attention_scores=False,
        attention_bias=None,
        segment_ids=None,
        mask=None,
    ):
        call = AttentionCall(
            query, None, None, query_mask, value_mask, None, attention_mask,
            return_attention_scores, training, use_causal_mask, attention_bias,
            cache, cache_update_index, positions, segment_ids, mask,
        )  # fmt: skip
        self._check_call(call)
        return self._attend(call)

    def call_unchecked(self, query, value=None, key=None, **kwargs):
        """`call` without its checks, for a block that checked what it
        passes (`value` and `key`: self-attention only, `None`)."""
        return self._attend(AttentionCall(query, **kwargs))

    def _attend(self, call):
        """The expanded form: each head's keys and values from the latents
        (the call's own, or the cache's after they are written)."""
        positions, _ = call.rope_positions()
        q = self._queries(call.query, positions)  # (B, T, H, nope + rope)
        latent, rope = self._latents(call.query, positions)  # (B, T, r), (B, T, R)
        cache = call.cache
        if cache is not None:
            cache = cache.update(latent, rope, call.cache_update_index)
            latent, rope = self._split(cache.read(q.dtype))
        k, v = self._expanded(latent, rope)  # (B, S, H, nope + rope), (B, S, H, v)
        lengths = ops.shape(q)[1], ops.shape(k)[1]
        mask, causal = call.merged_mask(self._axes, None, lengths)
        result = attend(
            q, k, v,
            mask=mask,
            bias=call.attention_bias,
            is_causal=causal,
            scale=self._scale,
            flash_attention=self.flash_attention,
            dropout=self._dropout(call.training),
            return_scores=call.return_attention_scores,
            segment_ids=None if call.segments is None else (call.segments,) * 2,
            training=call.training is True,
        )  # fmt: skip
        outputs = result if call.return_attention_scores else (result,)
        outputs = (call_sublayer(self.attention_output, outputs[0]), *outputs[1:])
        outputs += () if cache is None else (cache,)
        return outputs[0] if len(outputs) == 1 else outputs

    def decode_unchecked(
        self, query, cache, index=None, positions=None, mask=None, calls=None
    ):
        """One decoding step over a `LatentCache`, unchecked, in the absorbed
        form: the contract of `keras_attn.MultiHeadAttention.decode_unchecked`
        (self-attention: `index` is required).

        `query` `(batch, length, width)` at positions `index, ...` (rotary
        `positions`, `(batch, length)` or `(length,)`, default those); `mask`
        bool `(batch or 1, 1, length, slots)` (`cache.mask`). Returns
        `(output (batch, length, width), cache)`. Quantized `key_value_b`
        kernels are expanded instead (their stored kernel is not `W_UK`).
        """
        calls = calls or call_sublayer
        prefill = cache.top_left_causal(index)
        if positions is None:
            positions = index + ops.arange(0, ops.shape(query)[1], dtype="int32")
        q = self._queries(query, positions, calls)
        cache = cache.update(*self._latents(query, positions, calls), index)
        cached = cache.read(q.dtype)  # (B, S, r + R)
        if self.key_value_b.quantization_mode is not None:
            k, v = self._expanded(*self._split(cached), calls)
            context = attend(
                q, k, v, mask=mask, within_causal=prefill,
                scale=self._scale,
            )  # fmt: skip
            return calls(self.attention_output, context), cache
        kernel = ops.cast(self.key_value_b.kernel, q.dtype)  # (r, H, nope + v)
        nope = self.qk_nope_head_dim
        absorbed = ops.einsum("bthn,rhn->bthr", q[..., :nope], kernel[..., :nope])
        q = ops.concatenate([absorbed, q[..., nope:]], axis=-1)  # (B, T, H, r + R)
        latents = ops.expand_dims(cached, 1)  # (B, 1, S, r + R): one shared head
        context = attend(
            q, latents, latents[..., : self.kv_lora_rank],
            mask=mask,
            within_causal=prefill,
            scale=self._scale,
            flash_attention=False if self.flash_attention is False else None,
            heads_major=True,
        )  # fmt: skip  # (B, T, H, r)
        return calls(
            self.attention_output, _per_head(context, kernel[..., nope:])
        ), cache

    def _queries(self, x, positions, calls=call_sublayer):
        """`(B, T, H, nope + rope)`, the rotary channels rotated."""
        if self.q_lora_rank is None:
            q = calls(self.query, x)
        else:
            q = calls(self.query_a_norm, calls(self.query_a, x))
            q = calls(self.query_b, q)
        nope = self.qk_nope_head_dim
        return ops.concatenate(
            [q[..., :nope], self._rotate(q[..., nope:], positions)], -1
        )

    def _latents(self, x, positions, calls=call_sublayer):
        """What a cache keeps: the normalized latent `(B, T, r)` and the
        rotated shared key `(B, T, R)`."""
        latent, rope = self._split(calls(self.key_value_a, x))
        rope = self._rotate(ops.expand_dims(rope, 2), positions)[:, :, 0]
        return calls(self.key_value_a_norm, latent), rope

    def _split(self, latents):
        return latents[..., : self.kv_lora_rank], latents[..., self.kv_lora_rank :]

    def _expanded(self, latent, rope, calls=call_sublayer):
        """Each head's keys `(B, S, H, nope + R)` (the shared rotary key
        broadcast) and values `(B, S, H, v)` of the latents."""
        kv = calls(self.key_value_b, latent)  # (B, S, H, nope + v)
        nope = self.qk_nope_head_dim
        shape = (*ops.shape(kv)[:3], self.qk_rope_head_dim)
        rope = ops.broadcast_to(ops.expand_dims(rope, 2), shape)
        return ops.concatenate([kv[..., :nope], rope], axis=-1), kv[..., nope:]

    def _rotate(self, x, positions):
        """RoPE on `x` `(B, T, H, R)`; interleaved channel pairs (DeepSeek's
        layout) are first gathered into halves, as Hugging Face's
        `apply_rotary_pos_emb_interleave` lays its output out."""
        if self.rope_interleave:
            x = ops.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)
        return rotate(x, positions, self.rope_max_wavelength, 1.0, self.rope_scaling)

    def _dropout(self, training):
        if not (training and self.dropout):
            return None
        return lambda weights: self._attention_dropout(weights, training=True)

    # --- Checks ---------------------------------------------------------------

    def _check_call(self, call):
        """Every argument of a call, once, before anything is computed."""
        _checks.check_call(self, call)

    def check_cache(self, cache, batch, name="cache"):
        """Raise unless `cache` is a float `LatentCache` of this layer's
        width, `(batch, length, kv_lora_rank + qk_rope_head_dim)`."""
        _checks.check_cache(self, cache, batch, name)

    # --- Caches ---------------------------------------------------------------

    def get_empty_cache(self, batch_size, max_length, dtype=None):
        """An all-zeros `keras_attn.cache.LatentCache` of `max_length`
        positions, `(batch_size, max_length, kv_lora_rank +
        qk_rope_head_dim)`, in `dtype` (default: the compute dtype; a float
        dtype). The layer must be built."""
        if not self.built:
            raise ValueError(
                f"{self.name} must be built (called once) before it makes a cache."
            )
        check_size("batch_size", batch_size, minimum=1)
        check_positive_int("max_length", max_length)
        dtype = dtype or self.compute_dtype
        if dtype_name(dtype) not in ("float16", "bfloat16", "float32", "float64"):
            raise ValueError(
                "A latent cache holds float latents. Received: "
                f"dtype={dtype!r}. Pass a float dtype (or None)."
            )
        width = self.kv_lora_rank + self.qk_rope_head_dim
        return LatentCache.empty(batch_size, max_length, width, dtype)

    # --- Keras machinery ------------------------------------------------------

    @shared_docs
    def enable_lora(
        self, rank, lora_alpha=None, a_initializer="he_uniform", b_initializer="zeros"
    ):
        """Low-rank adapters (Hu et al. 2021) on every projection; the rest
        frozen (norms included). Saving merges them into the kernels.

        Args:
            {lora_arguments}
        """
        enable_lora(
            self, self._lora_targets(), rank, lora_alpha, a_initializer, b_initializer
        )

    def _lora_targets(self):
        names = ("query",) if self.q_lora_rank is None else ("query_a", "query_b")
        names += ("key_value_a", "key_value_b", "attention_output")
        return [getattr(self, name) for name in names]

    def compute_output_shape(self, query_shape):
        return tuple(query_shape)

    def compute_output_spec(self, query, *args, **kwargs):
        call = AttentionCall(query, None, None, *args, **kwargs)
        if self.built:
            self._check_call(call)
        outputs = (keras.KerasTensor(query.shape, dtype=self.compute_dtype),)
        if call.return_attention_scores:
            keys = query.shape[1] if call.cache is None else call.cache.length
            shape = (query.shape[0], self.num_heads, query.shape[1], keys)
            outputs += (keras.KerasTensor(shape, dtype=self.compute_dtype),)
        if call.cache is not None:
            outputs += (
                keras.tree.map_structure(
                    lambda t: keras.KerasTensor(t.shape, dtype=t.dtype), call.cache
                ),
            )
        return outputs[0] if len(outputs) == 1 else outputs

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "num_heads": self.num_heads,
                "kv_lora_rank": self.kv_lora_rank,
                "qk_nope_head_dim": self.qk_nope_head_dim,
                "qk_rope_head_dim": self.qk_rope_head_dim,
                "v_head_dim": self.v_head_dim,
                "q_lora_rank": self.q_lora_rank,
                "rope_max_wavelength": self.rope_max_wavelength,
                "rope_scaling": None
                if self.rope_scaling is None
                else dict(self.rope_scaling),
                "rope_interleave": self.rope_interleave,
                "attention_scale": self.attention_scale,
                "norm_epsilon": self.norm_epsilon,
                "use_bias": self.use_bias,
                "dropout": self.dropout,
                "flash_attention": self.flash_attention,
                "kernel_initializer": keras.initializers.serialize(
                    self.kernel_initializer
                ),
                "dtype": dtype_config(self),
            }
        )
        return config


def _per_head(context, kernel):
    """Each head's `context` `(B, T, H, r)` times its matrix of `kernel`
    `(r, H, v)`: `(B, T, H, v)`. Heads-major matrices multiplied, not
    `einsum("bthr,rhv->bthv")`, which XLA on a CPU runs about 8x slower
    (the batch axis of the kernel not leading)."""
    kernel = ops.transpose(kernel, (1, 0, 2))  # (H, r, v)
    context = ops.matmul(ops.transpose(context, (0, 2, 1, 3)), kernel)  # (B, H, T, v)
    return ops.transpose(context, (0, 2, 1, 3))
