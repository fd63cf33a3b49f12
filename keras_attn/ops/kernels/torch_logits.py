"""The explicit path's masked logits on PyTorch: one `torch.baddbmm`.

The one place the explicit path imports a backend module. `QK^T` and the
additive terms (the bias, and the mask as the dtype's lowest number where it
hides a key) come out of one batched product, `added + Q K^T`, rather than a
product and then a pass over the logits to add them: in eager PyTorch the
add was 13% of a causal call in chunks (8,192 logits a row of 4,096,
`torch.profiler`; `benchmarks/results/block_skipping_torch.md`). The numbers
are those of the product and the add, up to rounding: a GEMM may add
`added` before the last of its partial sums.

`baddbmm` broadcasts `added` only over the product's whole batch (its first
axis is 1), so it goes into the product where it is the same for every batch
row and key head (a causal mask, a window's band), or already whole; a mask
per batch row (key padding) or a bias per head of several rows would have to
be copied to the logits' size first, a pass like the add, so there the add
comes after the product as before.
"""

import torch


def masked_logits(query, key, added, heads_major):
    """`added + query key^T`: `query` `(B, T, H, D)`, `key` `(B, S, K, D)`
    (or `(B, K, S, D)` when `heads_major`), both in the logits' dtype, and
    `added` broadcasting to `(B, H, T, S)`; returns `(B, H, T, S)`.

    Query heads `h = k * G + g` share key head `k`, as in the explicit
    path's einsums: each key head's `G` query heads go in one product as
    `G x T` rows, so no key is repeated."""
    batch, length, heads, width = query.shape
    keys = key.permute(0, 1, 3, 2) if heads_major else key.permute(0, 2, 3, 1)
    key_heads, key_length = keys.shape[1], keys.shape[-1]
    groups = heads // key_heads
    rows = query.reshape(batch, length, key_heads, groups, width)
    rows = rows.permute(0, 2, 3, 1, 4).reshape(batch * key_heads, -1, width)
    keys = keys.reshape(batch * key_heads, width, key_length)
    shape = (batch, heads, length, key_length)
    added = added.reshape((1,) * (4 - added.dim()) + tuple(added.shape))
    if tuple(added.shape) == shape:  # whole: a view in the product's layout
        added = added.reshape(batch * key_heads, groups * length, key_length)
    elif added.shape[0] == added.shape[1] == 1:  # one block, for every row
        added = added.expand(1, groups, length, key_length)
        added = added.reshape(1, groups * length, key_length)
    else:
        return torch.bmm(rows, keys).view(shape) + added
    return torch.baddbmm(added, rows, keys).view(shape)
