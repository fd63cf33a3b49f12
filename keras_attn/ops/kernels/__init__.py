"""The attention kernels, each carrying out an `AttentionPlan` (they decide
nothing): `explicit` (the weights materialized, float32 softmax), `chunked`
(the explicit path in chunks of query rows, memory linear in the length) and
`fused` (the backend's fused kernel; on PyTorch through `torch_sdpa`)."""
