"""The chunked path on PyTorch: each chunk under `keras.remat`, and the
gradient PyTorch's autograd takes through it (`plan.CHUNKS_REMATERIALIZED`:
our own gradient measured 1.33x its time there).
"""

import dataclasses

import keras
from keras import ops

from keras_attn.ops.kernels import blocks, explicit
from keras_attn.ops.kernels.chunk_layout import joined, split, stacked


def attention(query, key, value, masking, layout, options, extra):
    """`chunked.attention` with each chunk under `keras.remat`, differentiated
    by the backend (`plan.CHUNKS_REMATERIALIZED`); `masking`: a
    `chunked.Masking`; `layout`: `(count, rows, windows)`; `extra`: the bias
    and sink logits that are given, by name.

    PyTorch's autograd gives a tensor indexed or sliced in a loop the
    gradient of the whole tensor at every step: a chunk taken as `x[i]` (as
    Keras' `scan` takes it), or its keys sliced from all the keys, costs a
    pass over all of them in the backward pass, chunks x length in all (a
    window of 256 at 16,384 tokens: 42% of the call filled zeros). So the
    chunks are unstacked (`ops.unstack`, whose gradient is one stack) and
    looped over in Python (as Keras' PyTorch `scan` does; traced, the loop
    would unroll), and where a group's windows hold few keys
    (`blocks.few_keys`) the keys are taken for all its chunks at once
    (`blocks.take_windows`, whose gradient is one sum by position: on CUDA
    `index_add_`, whose sums may differ in rounding from run to run unless
    `torch.use_deterministic_algorithms(True)`)."""
    count, rows, windows = layout
    length = ops.shape(query)[1]
    chunks, all_shared = split(query, masking, count, rows)
    axis = 2 if options.heads_major else 1
    outputs = []
    for group, view in blocks.chunk_groups(chunks, windows, masking):
        steps = range(group["query"].shape[0])
        taken = [(None, None)] * len(steps)  # each chunk's keys and values
        if blocks.few_keys(len(steps), view, key.shape[axis]):
            keys, values = (
                ops.unstack(blocks.take_windows(x, axis, group["start"], view))
                for x in (key, value)
            )
            taken = list(zip(keys, values, strict=True))
        step = _step(all_shared, key, value, view, options, extra)
        parts = {name: ops.unstack(x, axis=0) for name, x in group.items()}
        chunk_outputs = [
            step({name: x[i] for name, x in parts.items()}, taken[i]) for i in steps
        ]
        outputs.append(ops.stack(chunk_outputs))
    return joined(stacked(outputs), length)


def _step(all_shared, all_key, all_value, window, options, extra):
    """One chunk's output in `attention`, for chunks over `window`, from
    the chunk and its keys and values taken already (`(None, None)`: not)."""

    def step(chunk, taken):
        chunk, shared, key, value = blocks.windowed(
            chunk, all_shared, all_key, all_value, window, options, taken
        )

        def attend(query, key, value, *tensors):
            # What may need a gradient is an argument.
            given = {**shared, **chunk, "query": query}
            given.update(zip(names, tensors, strict=True))
            own = dataclasses.replace(options, sink_logits=given.get("sink_logits"))
            return explicit.attention(
                query, key, value, blocks.chunk_mask(given, given), given.get("bias"),
                given.get("offset"), own, blocks.rows_have_keys(given, given, window),
                keep_weights=False,
            )[0]  # fmt: skip

        tensors = dict(extra)
        if "bias" in chunk:  # a bias per row: this chunk's rows
            tensors["bias"] = chunk["bias"]
        names = tuple(tensors)
        return keras.remat(attend)(chunk["query"], key, value, *tensors.values())

    return step
