"""What `MultiHeadLatentAttention` accepts, checked once at its door: its
rotary width, a call's tensors and its latent cache."""

from keras_attn._checks import (
    check_bool,
    check_fits,
    check_float,
    check_index,
    check_mask,
    check_positions,
    check_positive_int,
    check_rank,
    check_segment_ids_call,
    check_width,
)
from keras_attn.cache import LatentCache
from keras_attn.layers._attention_call import check_scores_allowed


def check_even(qk_rope_head_dim):
    value = check_positive_int("qk_rope_head_dim", qk_rope_head_dim)
    if value % 2:
        raise ValueError(
            "`qk_rope_head_dim` must be even: rotary channels turn in pairs. "
            f"Received: qk_rope_head_dim={value}."
        )
    return value


def check_call(layer, call):
    """Every argument of `call` (an `AttentionCall`) of `layer`."""
    query = call.query
    check_rank("query", query.shape, 3, "(batch, length, width)")
    check_float("query", query)
    if layer.built:
        check_width("query", query.shape, layer._width)
    check_bool("use_causal_mask", call.use_causal_mask)
    check_scores_allowed(layer.flash_attention, call.return_attention_scores)
    batch, target = query.shape[:2]
    keys = _check_cache_and_index(layer, call, batch, target)
    check_mask("value_mask", call.value_mask, (batch, keys))
    check_mask("attention_mask", call.attention_mask, (batch, target, keys))
    if call.attention_bias is not None:
        check_float("attention_bias", call.attention_bias)
    check_positions(call.positions, batch, target, layer.rope_max_wavelength)
    conflict = None if call.cache is None else "a `cache`"
    check_segment_ids_call(call.segment_ids, (batch, target), conflict)


def _check_cache_and_index(layer, call, batch, target):
    """The cache and its index; returns the number of keys."""
    cache, index = call.cache, call.cache_update_index
    if (cache is None) != (index is None):
        raise ValueError(
            "`cache` and `cache_update_index` go together (a latent cache "
            f"is always written). Received: cache={type(cache).__name__}, "
            f"cache_update_index={index}."
        )
    if cache is None:
        return target
    check_cache(layer, cache, batch)
    check_index("cache_update_index", index, target, cache.length)
    return cache.length


def check_cache(layer, cache, batch, name="cache"):
    """Raise unless `cache` is a float `LatentCache` of `layer`'s width."""
    if not isinstance(cache, LatentCache):
        raise TypeError(
            f"`{name}` must be a `keras_attn.cache.LatentCache` (as "
            "`get_empty_cache` makes it). "
            f"Received: {name} of type {type(cache).__name__}."
        )
    width = layer.kv_lora_rank + layer.qk_rope_head_dim
    check_fits(f"{name}.latent", cache.latent, (batch, None, width))
    check_float(f"{name}.latent", cache.latent)
