"""Text in and out for a Hugging Face checkpoint folder: its `tokenizer.json`,
read with the `tokenizers` package, and the special token ids the folder
declares."""

import os

import numpy as np

from keras_attn.models.hugging_face._files import checked_folder, read_json

TOKENIZER = "tokenizer.json"
# Where a folder declares its special token ids (`bos_token_id`, ...), first
# to last: what transformers' `generate` reads, then the model's config.
ID_FILES = ("generation_config.json", "config.json")
# Where it names its special tokens (`bos_token`, ...): the tokenizer's view.
TOKEN_FILES = ("tokenizer_config.json", "special_tokens_map.json")
SPECIAL = ("bos", "eos", "pad")
# transformers' `clean_up_tokenization`: the spaces its decoding removes, in
# its order.
CLEAN_UP = (" .", " ?", " !", " ,", " ' ", " n't", " 'm", " 's", " 've", " 're")


def load_tokenizer(path):
    """The tokenizer of a local Hugging Face checkpoint folder.

    Reads the folder's `tokenizer.json` (the `tokenizers` package's format,
    which every checkpoint of the families `from_hugging_face` loads has) with
    the `tokenizers` package: `pip install keras-attn[huggingface]`. Other
    tokenizer files (`tokenizer.model`, `vocab.json` + `merges.txt`) are not
    read; transformers writes a `tokenizer.json` from them with
    `AutoTokenizer.from_pretrained(folder).save_pretrained(folder)`.

    Encoding and decoding follow `tokenizer.json` as written, as transformers'
    `AutoTokenizer` does for the folder (no padding, no truncation; for some
    tokenizer classes transformers 5 rebuilds the steps before and after the
    vocabulary lookup from its code, meant to give the same ids and texts).
    The special token ids are the ones the folder declares, each from the
    first file that does: `generation_config.json`, then `config.json` (or
    its `text_config`), then the token named in `tokenizer_config.json` (or
    `special_tokens_map.json`) looked up in `tokenizer.json`; `None` where
    none does (no id is guessed: transformers' `generate` pads with the first
    end id where no pad id is declared). Chat templates are left to the
    caller: format the conversation as the model card says before `encode`.

    Args:
        path: str or os.PathLike. The folder holding `tokenizer.json`.

    Returns:
        A `Tokenizer`.

    Example:
    >>> import json, os, shutil, tempfile
    >>> from tokenizers import Tokenizer, models, pre_tokenizers, processors
    >>> words = {"<unk>": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4}
    >>> backend = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    >>> backend.pre_tokenizer = pre_tokenizers.Whitespace()
    >>> backend.add_special_tokens(["<s>", "</s>"])
    2
    >>> backend.post_processor = processors.TemplateProcessing(
    ...     single="<s> $A", special_tokens=[("<s>", 1)])
    >>> folder = tempfile.mkdtemp()
    >>> backend.save(os.path.join(folder, "tokenizer.json"))
    >>> with open(os.path.join(folder, "config.json"), "w") as file:
    ...     json.dump({"bos_token_id": 1, "eos_token_id": 2}, file)
    >>> tokenizer = keras_attn.models.load_tokenizer(folder)
    >>> tokenizer.encode("hello world"), tokenizer.adds_bos_token
    ([1, 3, 4], True)
    >>> tokenizer.decode([1, 3, 4, 2]), tokenizer.decode([[3], [4, 4]])
    ('hello world', ['hello', 'world world'])
    >>> tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id
    (1, 2, None)
    >>> shutil.rmtree(folder)
    """
    folder = _checked_folder(path)
    declared = [
        read_json(folder, name, optional=True) for name in (*ID_FILES, *TOKEN_FILES)
    ]
    tokenizers = _import_tokenizers()
    file = os.path.join(folder, TOKENIZER)
    try:
        backend = tokenizers.Tokenizer.from_file(file)
    except Exception as error:  # tokenizers raises its own exception types
        raise ValueError(
            f"Cannot read {file} with the `tokenizers` package "
            f"{tokenizers.__version__}: {error}"
        ) from error
    generation, config, tokenizer_config, special_map = declared
    sources = (generation, config, config.get("text_config") or {})
    ids = {
        key: value
        if value is not None
        else _token_id(backend, key, (tokenizer_config, special_map))
        for key, value in _special_ids(sources).items()
    }
    clean_up = bool(tokenizer_config.get("clean_up_tokenization_spaces", False))
    return Tokenizer(backend, **ids, clean_up_tokenization_spaces=clean_up)


class Tokenizer:
    """Text to token ids and back: a `tokenizers.Tokenizer` with the special
    token ids of its checkpoint folder. Made by `load_tokenizer`.

    Attributes:
        bos_token_id: int or `None`. The beginning-of-sequence id declared.
        eos_token_id: int, list of ints or `None`. The end id(s) declared:
            pass it as `generate`'s `end_token_id`.
        pad_token_id: int or `None`. The padding id declared.
        adds_bos_token: bool. Whether `encode` starts each text with
            `bos_token_id` itself (the `post_processor` of `tokenizer.json`
            adds it): if so, do not add it again.
        vocabulary_size: int. Ids the tokenizer knows, added tokens included
            (at most the model's vocabulary; often fewer).
        backend_tokenizer: the `tokenizers.Tokenizer`, for anything else.
    """

    def __init__(
        self,
        backend_tokenizer,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        clean_up_tokenization_spaces=False,
    ):
        backend_tokenizer.no_padding()  # as transformers' default call
        backend_tokenizer.no_truncation()
        self.backend_tokenizer = backend_tokenizer
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        # transformers (5) cleans up only where the model is not a BPE.
        model = type(backend_tokenizer.model).__name__
        self.clean_up_tokenization_spaces = clean_up_tokenization_spaces and (
            model != "BPE"
        )
        self.adds_bos_token = self._adds_bos_token()
        self.vocabulary_size = backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text, add_special_tokens=True):
        """Token ids of a text (a list of ints), or of each text of a list.

        Args:
            text: str, or a list or tuple of str.
            add_special_tokens: bool. Whether the `post_processor` of
                `tokenizer.json` adds its special tokens (e.g. a BOS: see
                `adds_bos_token`), as transformers does by default. Defaults
                to `True`.

        Returns:
            A list of ints for a str; a list of such lists for a list of str
            (of different lengths: `generate` pads a list of rows itself).
        """
        if isinstance(text, str):
            return self.backend_tokenizer.encode(
                text, add_special_tokens=add_special_tokens
            ).ids
        if not isinstance(text, (list, tuple)) or not all(
            isinstance(t, str) for t in text
        ):
            raise TypeError(
                "`text` must be a str or a list of str. Received: "
                f"{_shown(text)} of type {type(text).__name__}."
            )
        encodings = self.backend_tokenizer.encode_batch(
            list(text), add_special_tokens=add_special_tokens
        )
        return [encoding.ids for encoding in encodings]

    def decode(self, ids, skip_special_tokens=True):
        """The text of token ids, or the texts of a batch of them.

        Args:
            ids: int token ids: an int, or a list, numpy array or tensor
                `(length,)`, for one text; `(batch, length)` (or a list of
                rows of different lengths, such as `encode` returns) for a
                list of texts.
            skip_special_tokens: bool. Whether special tokens (BOS, end and
                padding ids, ...) are left out of the text. Defaults to
                `True`.

        Returns:
            A str for one row of ids; a list of str for a batch.
        """
        rows, batched = _id_rows(ids)
        texts = self.backend_tokenizer.decode_batch(
            rows, skip_special_tokens=skip_special_tokens
        )
        if self.clean_up_tokenization_spaces:
            texts = [_cleaned_up(text) for text in texts]
        return texts if batched else texts[0]

    def _adds_bos_token(self):
        if self.bos_token_id is None:
            return False
        plain = self.backend_tokenizer.encode("a", add_special_tokens=False).ids
        full = self.backend_tokenizer.encode("a", add_special_tokens=True).ids
        return full[:1] == [self.bos_token_id] and full[1 : len(plain) + 1] == plain

    def __repr__(self):
        return (
            f"Tokenizer(vocabulary_size={self.vocabulary_size}, "
            f"bos_token_id={self.bos_token_id}, eos_token_id={self.eos_token_id}, "
            f"pad_token_id={self.pad_token_id}, "
            f"adds_bos_token={self.adds_bos_token})"
        )


def _checked_folder(path):
    """`path` as a str, once it is a folder holding tokenizer.json."""
    folder = checked_folder(path, TOKENIZER)
    if not os.path.isfile(os.path.join(folder, TOKENIZER)):
        raise FileNotFoundError(
            f"The checkpoint folder {folder!r} has no {TOKENIZER}; it holds "
            f"{sorted(os.listdir(folder))}. This loader reads {TOKENIZER} "
            "only; transformers writes one from other tokenizer files with "
            "`AutoTokenizer.from_pretrained(folder).save_pretrained(folder)`."
        )
    return folder


def _import_tokenizers():
    try:
        import tokenizers
    except ImportError as error:
        raise ImportError(
            "`load_tokenizer` reads tokenizer.json with the `tokenizers` "
            "package, which is not installed: `pip install "
            "keras-attn[huggingface]`."
        ) from error
    return tokenizers


def _special_ids(sources):
    """`{"bos_token_id": ..., ...}`: each from the first source declaring it
    (not None), checked to be an id (eos: or a list of ids)."""
    ids = {}
    for key in (f"{name}_token_id" for name in SPECIAL):
        value = next((s[key] for s in sources if s.get(key) is not None), None)
        listed = key == "eos_token_id" and isinstance(value, list)
        for id_ in value if listed else [value]:
            if id_ is not None and (
                not isinstance(id_, int) or isinstance(id_, bool) or id_ < 0
            ):
                raise ValueError(
                    f"The checkpoint folder declares `{key}` {value!r}; "
                    "expected a token id (an int >= 0"
                    f"{', or a list of them' if key == 'eos_token_id' else ''})."
                )
        ids[key] = value
    return ids


def _token_id(backend, key, token_files):
    """The id of the special token `key` names in the tokenizer's files (a
    str or an `AddedToken`'s dict); None if none names one or tokenizer.json
    does not hold it."""
    name = key.removesuffix("_id")
    token = next((f[name] for f in token_files if f.get(name) is not None), None)
    if isinstance(token, dict):
        token = token.get("content")
    return backend.token_to_id(token) if isinstance(token, str) else None


def _id_rows(ids):
    """`(rows, batched)`: the ids as lists of Python ints, one per text."""
    if isinstance(ids, (list, tuple)) and any(np.ndim(row) > 0 for row in ids):
        rows, batched = [np.asarray(row) for row in ids], True
    else:
        array = np.asarray(ids)
        array = array[None] if array.ndim == 0 else array  # one id
        batched = array.ndim == 2
        rows = list(array) if batched else [array]
    for row in rows:
        if row.ndim != 1 or (row.size and not np.issubdtype(row.dtype, np.integer)):
            raise TypeError(
                "`ids` must be int token ids: `(length,)` for one text, "
                "`(batch, length)` or a list of rows for several. Received: "
                f"{_shown(ids)} (rows of shape {row.shape}, dtype {row.dtype})."
            )
    return [row.astype("int64").tolist() for row in rows], batched


def _cleaned_up(text):
    for spaced in CLEAN_UP:
        text = text.replace(spaced, spaced.strip())
    return text


def _shown(value, limit=80):
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
