"""A Hugging Face checkpoint folder on disk: `config.json` and safetensors
files, read one tensor at a time and written whole."""

import dataclasses
import json
import os

import keras
import numpy as np

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
# Tensor dtypes a checkpoint's float weights come in (safetensors' names).
FLOAT_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}


def safetensors_numpy():
    """The `safetensors` package, or an ImportError naming the extra."""
    try:
        from safetensors import numpy as numpy_io
        from safetensors import safe_open
    except ImportError as error:
        raise ImportError(
            "Hugging Face checkpoint folders are read and written with the "
            "`safetensors` package: `pip install keras-attn[huggingface]`."
        ) from error
    return numpy_io, safe_open


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """A checkpoint folder's config and its tensors' names, shapes and
    dtypes (from the files' headers: no weight is read until `read`)."""

    path: str
    config: dict
    shapes: dict  # name: tuple
    dtypes: dict  # name: safetensors dtype name ("BF16", ...)
    files: dict  # name: file path

    def read(self, name, start=None, stop=None):
        """One tensor as a numpy array (bfloat16 as ml-dtypes'), or its rows
        `start:stop`. The file is opened for this read alone, so its mapped
        pages are let go at once: loading holds one tensor beside the model,
        never the checkpoint."""
        _, safe_open = safetensors_numpy()
        with safe_open(self.files[name], framework="numpy") as file:
            if start is None:
                return file.get_tensor(name)
            return file.get_slice(name)[start:stop]


def open_checkpoint(path):
    """The `Checkpoint` of the folder `path`; a clear error where the folder,
    its config or its weights are missing or unreadable."""
    path = checked_folder(path, "config.json and safetensors files")
    config = read_json(path, CONFIG)
    shapes, dtypes, files = {}, {}, {}
    for file in _weight_files(path):
        for name, (shape, dtype) in _header(file).items():
            shapes[name], dtypes[name], files[name] = shape, dtype, file
    return Checkpoint(path, config, shapes, dtypes, files)


def checked_folder(path, holding):
    """`path` as a str, once it is an existing folder (`holding`: what it
    should hold, for the messages)."""
    if not isinstance(path, (str, os.PathLike)):
        shown = repr(path) if len(repr(path)) <= 80 else repr(path)[:77] + "..."
        raise TypeError(
            f"`path` must be a local folder (a str or os.PathLike) holding "
            f"{holding}. Received: {shown} of type {type(path).__name__}."
        )
    folder = os.fspath(path)
    if not os.path.exists(folder):
        raise FileNotFoundError(
            f"`path` must be a local checkpoint folder; {folder!r} does not "
            "exist. Nothing is downloaded: fetch the folder first with the "
            "hub's own tool (e.g. `hf download <repo> --local-dir <folder>`)."
        )
    if not os.path.isdir(folder):
        raise ValueError(
            f"`path` must be the checkpoint folder, not a file. Received: "
            f"{folder!r}. Pass the folder that holds {holding}."
        )
    return folder


def read_json(folder, name, optional=False):
    """The JSON object in the folder's file `name`; `{}` for a missing
    `optional` file, a FileNotFoundError for a missing required one."""
    file = os.path.join(folder, name)
    if not os.path.isfile(file):
        if optional:
            return {}
        raise FileNotFoundError(
            f"The checkpoint folder {folder!r} has no {name}. "
            f"It holds: {sorted(os.listdir(folder))}."
        )
    try:
        with open(file, encoding="utf-8") as handle:
            content = json.load(handle)
    except (OSError, ValueError) as error:
        raise ValueError(f"Cannot read {file} as JSON: {error}") from error
    if not isinstance(content, dict):
        raise ValueError(
            f"{file} must hold a JSON object. Received: {type(content).__name__}."
        )
    return content


def _weight_files(path):
    """The safetensors files of the folder: `model.safetensors`, else those
    its index names (transformers' order, where a folder has both)."""
    index = os.path.join(path, INDEX)
    if not os.path.isfile(os.path.join(path, SINGLE)) and os.path.isfile(index):
        weight_map = read_json(path, INDEX).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index} has no `weight_map` of tensor names to files.")
        files = sorted({os.path.join(path, f) for f in weight_map.values()})
    else:
        files = [os.path.join(path, SINGLE)]
    missing = [f for f in files if not os.path.isfile(f)]
    if missing:
        raise FileNotFoundError(
            f"The checkpoint folder {path!r} lacks the weights file(s) "
            f"{[os.path.basename(f) for f in missing]} (safetensors: "
            f"{SINGLE} or a sharded {INDEX}). It holds: {sorted(os.listdir(path))}."
        )
    return files


def _header(file):
    """`{name: (shape, dtype)}` of a safetensors file, from its header."""
    _, safe_open = safetensors_numpy()
    try:
        with safe_open(file, framework="numpy") as handle:
            return {
                name: (
                    tuple(handle.get_slice(name).get_shape()),
                    handle.get_slice(name).get_dtype(),
                )
                for name in handle.keys()
            }
    except Exception as error:  # safetensors raises its own error types
        raise ValueError(f"Cannot read {file} as safetensors: {error}") from error


def checked_new_folder(path):
    """`path` as a str, once it names a folder to write a checkpoint into:
    new, or without a config or weights (which a write would leave stale)."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(
            f"`path` must be a folder (a str or os.PathLike). Received: "
            f"{type(path).__name__}."
        )
    folder = os.fspath(path)
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise ValueError(f"`path` must be a folder; {folder!r} is a file.")
    taken = [
        f for f in (CONFIG, SINGLE, INDEX) if os.path.exists(os.path.join(folder, f))
    ]
    if taken:
        raise ValueError(
            f"`path` {folder!r} already holds a checkpoint ({taken}): a new "
            "model.safetensors beside old shards would be read as either. "
            "Write into a new or empty folder."
        )
    return folder


def write_checkpoint(path, config, tensors):
    """Write `config` as config.json and `tensors` (`{name: array}`) as
    model.safetensors in the folder `path` (created if needed)."""
    numpy_io, _ = safetensors_numpy()
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, CONFIG), "w", encoding="utf-8") as handle:
        json.dump(config, handle, indent=2, sort_keys=True)
    tensors = {name: np.ascontiguousarray(value) for name, value in tensors.items()}
    numpy_io.save_file(tensors, os.path.join(path, SINGLE), metadata={"format": "pt"})


def as_dtype(value, dtype):
    """`value` as a numpy array of the variable's dtype (bfloat16 through
    ml-dtypes): every backend converts that without a guess."""
    if keras.backend.standardize_dtype(dtype) == "bfloat16":
        import ml_dtypes  # with safetensors: the huggingface extra

        return np.asarray(value).astype(ml_dtypes.bfloat16, copy=False)
    return np.asarray(value).astype(keras.backend.standardize_dtype(dtype), copy=False)
