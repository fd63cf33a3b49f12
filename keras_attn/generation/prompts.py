"""Prompt layout: every row left-padded for decoding, then back to the
user's layout; and the checks of the prompt's and the encoder inputs' ids.
Plain numpy, before and after the compiled loop."""

import keras
import numpy as np


def left_pad(prompt, pad_token_id):
    """Left-pad every row: `(prompt, pads per row, was right-padded)`.

    Raises unless the prompt is int ids `(batch, length)`, each row with at
    least one token, all rows padded on the same side with no gaps. A Python
    list of rows of different lengths is right-padded with `pad_token_id`.
    """
    prompt = np.asarray(
        keras.ops.convert_to_numpy(_right_pad_rows(prompt, pad_token_id))
    )
    if prompt.size == 0:  # before its dtype: numpy makes `[[]]` float64
        raise ValueError(
            "The prompt is empty: `generate` needs int token ids `(batch, "
            "length)` with at least one row and a token in each. Received: "
            f"shape={prompt.shape}."
        )
    if prompt.ndim != 2 or prompt.dtype.kind not in "iu":
        raise ValueError(
            "The prompt must be int token ids `(batch, length)`. Received: "
            f"shape={prompt.shape}, dtype={prompt.dtype}."
        )
    real = prompt != pad_token_id
    lengths = real.sum(axis=1)
    if np.any(lengths == 0):
        raise ValueError(
            f"Every prompt needs at least one token that is not pad_token_id="
            f"{pad_token_id}. Received empty rows: {np.flatnonzero(lengths == 0)}."
        )
    run_starts = real & ~np.pad(real, [(0, 0), (1, 0)])[:, :-1]
    left, right = real[:, -1], real[:, 0]  # rows ending / starting with tokens
    if np.any(run_starts.sum(axis=1) != 1) or not np.all(left | right):
        raise ValueError(
            f"Prompts must be padded with pad_token_id={pad_token_id} on one side "
            "(left or right), with no padding between tokens."
        )
    if np.any(~left) and np.any(~right):
        raise ValueError(
            "Prompts must be all left-padded or all right-padded, not a mix."
        )
    pads = (real.shape[1] - lengths).astype("int32")
    right_padded = bool(np.any(~left))
    if right_padded:
        prompt = np.stack(
            [np.roll(row, p) for row, p in zip(prompt, pads, strict=True)]
        )
    return prompt.astype("int32"), pads, right_padded


def _right_pad_rows(prompt, pad_token_id):
    """A list of 1-D rows of different lengths, right-padded to the longest
    with `pad_token_id`; anything else unchanged."""
    sequences = list | tuple | np.ndarray
    if not isinstance(prompt, list | tuple) or not prompt:
        return prompt
    if not all(isinstance(row, sequences) for row in prompt):
        return prompt
    rows = [np.asarray(row) if len(row) else np.zeros(0, "int32") for row in prompt]
    if any(row.ndim != 1 for row in rows) or len({len(row) for row in rows}) == 1:
        return prompt
    width = max(len(row) for row in rows)
    return np.stack(
        [
            np.pad(row, (0, width - len(row)), constant_values=pad_token_id)
            for row in rows
        ]
    )


def decoding_length(settings, width, pads, right_padded):
    """Positions the decoder runs to (prompt width included), and the length
    returned to the user; raises if `max_length` is shorter than the prompt.

    With `max_length`, left-padded rows get `max_length - width` new tokens
    and right-padded rows are filled up to `max_length`, so the decoding runs
    `max(pads)` positions further. With `max_new_tokens`, every row gets that
    many.
    """
    if settings.max_new_tokens is not None:
        return width + settings.max_new_tokens, width + settings.max_new_tokens
    if width > settings.max_length:
        raise ValueError(
            "`max_length` must be at least the prompt length. Received: "
            f"max_length={settings.max_length}, prompt length={width}."
        )
    extra = int(pads.max()) if right_padded else 0
    return settings.max_length + extra, settings.max_length


def check_positions(length, pads, max_positions, spare=0, model="model"):
    """Raise if a row's sequence (prompt, new tokens and the `spare`
    positions a speculative round runs past `length`) runs past the learned
    position table (`max_positions`; None: no table) of `model` (the
    argument's name)."""
    longest = length + spare - int(pads.min())
    if max_positions is None or longest <= max_positions:
        return
    fix = "Pass a `max_length` (or `max_new_tokens`) that fits."
    if spare and longest - spare <= max_positions:
        fix = (
            f"{spare} of them are spare positions a speculative round runs "
            "past the returned length (`num_speculative_tokens` - 1 draft "
            "tokens, discarded there). Pass a smaller `max_length` (or "
            "`max_new_tokens`) or `num_speculative_tokens`."
        )
    raise ValueError(
        f"`generate` would run a sequence of {longest} tokens through "
        f"`{model}`, whose PositionEmbedding holds {max_positions} positions. " + fix
    )


def to_user_layout(rows, pads, right_padded, length, fill):
    """Right-padded rows back to the user's side: tokens first, `fill` after."""
    if not right_padded:
        return rows[:, :length]
    return np.stack(
        [
            np.concatenate([row[p:], np.full(p, fill, row.dtype)])[:length]
            for row, p in zip(rows, pads, strict=True)
        ]
    )


def check_token_ids(prompt, vocabulary_size, **ids):
    """Raise unless the ids are in `[0, vocabulary_size)` of the token
    embedding; `ids` are ints or tuples of ints by argument name."""
    for name, values in ids.items():
        for value in values if isinstance(values, tuple) else (values,):
            if value >= vocabulary_size:
                raise ValueError(
                    f"`{name}` must be a token id < vocabulary_size="
                    f"{vocabulary_size} of the model's embedding. "
                    f"Received: {name}={value}."
                )
    _check_id_range(
        prompt, vocabulary_size, "The prompt's token ids", "the model's embedding"
    )


def _check_id_range(ids, vocabulary_size, what, embedding):
    if ids.size and (ids.min() < 0 or ids.max() >= vocabulary_size):
        raise ValueError(
            f"{what} must be in [0, vocabulary_size={vocabulary_size}) "
            f"of {embedding}. Received: ids from {ids.min()} to {ids.max()}."
        )


def check_sources(sources, specs, batch):
    """The encoder inputs as numpy arrays, each checked against its
    `graph.SourceSpec`: an array of the input's shape, one row per prompt row
    (`batch`), int ids in the vocabulary of the embedding that reads them."""
    return [
        _check_source(source, spec, batch)
        for source, spec in zip(sources, specs, strict=True)
    ]


def _check_source(source, spec, batch):
    name = f"The encoder input {spec.name!r} of `inputs`"
    expected = (batch, *spec.shape[1:])
    try:
        array = np.asarray(keras.ops.convert_to_numpy(source))
    except ValueError:  # numpy refuses rows of different lengths
        raise ValueError(
            f"{name} must be an array of shape {expected}. Received rows of "
            "different lengths: pad them to one length (with the id its "
            "embedding masks, 0 for `mask_zero=True`)."
        ) from None
    if array.dtype.kind not in "biuf":  # None, strings, objects
        raise TypeError(
            f"{name} must be an array of numbers of shape {expected}. "
            f"Received: {source!r} of type {type(source).__name__}."
        )
    if array.ndim != len(expected) or any(
        want is not None and want != got
        for want, got in zip(expected, array.shape, strict=True)
    ):
        raise ValueError(
            f"{name} must have shape {expected}: one row per prompt row "
            f"(batch={batch}), the rest as its keras.Input's {spec.shape}. "
            f"Received: shape={array.shape}."
        )
    kinds = "iu" if spec.integer else "biuf"
    if array.dtype.kind not in kinds:
        raise ValueError(
            f"{name} must be {'int token ids' if spec.integer else 'numbers'}. "
            f"Received: dtype={array.dtype}."
        )
    if spec.vocabulary_size is not None:
        what = f"The token ids of the encoder input {spec.name!r} of `inputs`"
        _check_id_range(array, spec.vocabulary_size, what, "its embedding")
    return array
