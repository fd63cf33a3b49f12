"""The explicit path's masked logits on PyTorch: one `torch.baddbmm`.

The one place the explicit path imports a backend module. `QK^T` and the
additive terms (the bias, and the mask as the dtype's lowest number where it
hides a key) come out of one batched product, `added + Q K^T`, rather than a
product and then a pass over the logits to add them: in eager PyTorch the
add was 13% of a causal call in chunks (8,192 logits a row of 4,096,
`torch.profiler`), and the call takes 0.88x the time with it folded in
(`benchmarks/block_skipping.py`). The numbers are the same to the bit: the
product is the one `einsum` computes, and the add is the same add.
"""

import torch


def masked_logits(query, key, added, heads_major):
    """`added + query key^T`: `query` `(B, T, H, D)`, `key` `(B, S, K, D)`
    (or `(B, K, S, D)` when `heads_major`), both in the logits' dtype, and
    `added` broadcasting to `(B, H, T, S)`; returns `(B, H, T, S)`.

    Grouped key heads (`K < H`) are repeated to the query heads: `S x H x D`
    numbers, a `T`-th of the logits."""
    batch, length, heads, width = query.shape
    keys = key.permute(0, 1, 3, 2) if heads_major else key.permute(0, 2, 3, 1)
    if keys.shape[1] != heads:  # query head `h` reads key head `h // G`
        keys = keys.repeat_interleave(heads // keys.shape[1], dim=1)
    key_length = keys.shape[-1]
    rows = query.permute(0, 2, 1, 3).reshape(batch * heads, length, width)
    keys = keys.reshape(batch * heads, width, key_length)
    # A view where `added` broadcasts over the batch alone or is whole; a copy
    # (the pass the add was) where it broadcasts over heads of several rows.
    added = added.expand(batch, heads, length, key_length)
    added = added.reshape(batch * heads, length, key_length)
    logits = torch.baddbmm(added, rows, keys)
    return logits.view(batch, heads, length, key_length)
