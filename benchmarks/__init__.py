"""Benchmarks of `keras_attn`; `python -m benchmarks --backend jax` runs them all.

See `benchmarks/run.py`. Nothing here imports Keras, so the entry point can set
`KERAS_BACKEND` first.
"""
