"""The fused kernel on PyTorch: `torch.nn.functional.scaled_dot_product_attention`.

The one place the fused path imports a backend module. Keras'
`ops.dot_product_attention` on PyTorch (3.15) pins FlashAttention alone
whenever its check passes (where torch itself would choose cuDNN's faster
kernel on a Hopper GPU), repeats grouped key/value heads to the full head
count, copies every input to a contiguous heads-major layout, and turns a
boolean mask into a float one. Here torch gets the tensors as they are:

- `(B, T, H, D)` inputs as heads-major views (`transpose`, no copy), and a
  key/value cache, already heads-major, unchanged;
- grouped-query keys and values unrepeated (`enable_gqa=True`), which the
  flash and cuDNN kernels take in half precision and the CPU flash kernel
  in any (the plan repeats them where no fused kernel would take them);
- causal attention without a mask or bias as `is_causal=True` (torch raises
  for both: the plan folds the causal mask into the mask then);
- a boolean mask as it is (torch keeps a fused kernel for it where one takes
  masks), or a float bias with the mask folded in.

With no kernel pinned, torch picks its fastest (cuDNN, flash,
memory-efficient, then its composite "math" kernel); while `torch.export`
traces a dynamic length the plan pins the composite kernel, whose program
holds no guards from the fused kernels' shape checks. `flash_attention=True`
rules out the composite kernel: a fused kernel runs, or a `ValueError` says
why none can.
"""

import torch
from torch.nn import functional
from torch.nn.attention import SDPBackend, sdpa_kernel

_FUSED = [
    SDPBackend.CUDNN_ATTENTION,
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
]


def attention(
    query,
    key,
    value,
    mask,
    is_causal,
    scale,
    heads_major,
    require_fused=False,
    composite=False,
):
    """Attention of `query` `(B, T, H, D)` over `key` and `value`
    `(B, S, K, D)` (or `(B, K, S, D)` with `heads_major`), the logits scaled
    by `scale`.

    `mask` is `None`, a bool mask or a float bias, of rank 4 and broadcastable
    to `(B, H, T, S)`. A query row that a bool mask leaves without a key
    attends to nothing: zeros (torch's kernels would give NaN, or zeros).
    Returns `(B, T, H, Dv)`.
    """
    query = query.transpose(1, 2)  # (B, H, T, D)
    if not heads_major:
        key, value = key.transpose(1, 2), value.transpose(1, 2)  # (B, K, S, D)
    rows = None
    if mask is not None and mask.dtype == torch.bool:  # open empty rows
        rows = mask.any(-1, keepdim=True)  # (B, 1|H, T, 1)
        mask = mask | ~rows
    arguments = {
        "attn_mask": mask,
        "is_causal": is_causal,
        "scale": scale,
        # `bool`: in a traced export (ONNX) the head counts are tensors.
        "enable_gqa": bool(key.shape[1] != query.shape[1]),
    }
    if require_fused:
        output = _fused_only(query, key, value, arguments)
    elif composite:
        with sdpa_kernel([SDPBackend.MATH]):
            output = functional.scaled_dot_product_attention(
                query, key, value, **arguments
            )
    else:
        output = functional.scaled_dot_product_attention(query, key, value, **arguments)
    if rows is not None:  # a Python zero: no tensor made from host memory
        output = torch.where(rows, output, 0.0)
    return output.transpose(1, 2)  # (B, T, H, Dv)


def _fused_only(query, key, value, arguments):
    """The call with torch's composite kernel ruled out."""
    try:
        with sdpa_kernel(_FUSED):
            return functional.scaled_dot_product_attention(
                query, key, value, **arguments
            )
    except RuntimeError as error:
        mask = arguments["attn_mask"]
        raise ValueError(
            "`flash_attention=True`, but PyTorch has no fused attention kernel "
            f"(cuDNN, flash or memory-efficient) for these inputs on "
            f"{query.device.type}: query {tuple(query.shape)} {query.dtype}, "
            f"key {tuple(key.shape)}, mask {None if mask is None else mask.dtype}, "
            f"is_causal={arguments['is_causal']}. Torch said: {error}. Pass "
            "`flash_attention=None` to let torch fall back."
        ) from error
