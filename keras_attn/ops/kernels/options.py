"""What every kernel gets besides the tensors: the options of one call."""

import dataclasses


@dataclasses.dataclass(frozen=True)
class KernelOptions:
    """The options of one attention call, as the kernels read them.

    Attributes:
        scale: float. The logit scale.
        heads_major: bool. Keys and values are `(B, K, S, D)` (caches).
        dropout: callable on the weights, or `None` (explicit path only).
        logit_soft_cap: float or `None` (explicit path only).
        sink_logits: float tensor `(H,)` or `None` (explicit path only): a
            logit per query head that joins each row's softmax denominator
            and is then dropped (gpt-oss's attention sinks).
    """

    scale: float
    heads_major: bool = False
    dropout: object = None
    logit_soft_cap: float | None = None
    sink_logits: object = None
