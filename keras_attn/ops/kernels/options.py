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
    """

    scale: float
    heads_major: bool = False
    dropout: object = None
    logit_soft_cap: float | None = None
