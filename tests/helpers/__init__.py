"""Shared test helpers, one module per job: `backend` (the backend under
test), `builders` (inputs and models), `contract` (the layer contract),
`references` (float64 numpy references), `processes` (subprocesses)."""
