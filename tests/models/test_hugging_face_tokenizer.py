"""`load_tokenizer`: the same ids and texts as transformers' `AutoTokenizer`
on tiny tokenizer folders of each kind the families use, the special ids
each file declares (against transformers' `GenerationConfig`), and the
errors a folder can raise."""

import json
import os
import sys

import numpy as np
import pytest

from keras_attn.models.hugging_face.tokenizer import load_tokenizer

transformers = pytest.importorskip("transformers")

from tests.helpers import tiny_tokenizers as tiny  # noqa: E402

# name: (tokenizer builder, extra tokenizer_config.json entries, adds BOS)
KINDS = {
    "byte_level": (tiny.byte_level_bpe, {}, True),
    "byte_level_no_bos": (lambda: tiny.byte_level_bpe(adds_bos=False), {}, False),
    "metaspace": (tiny.metaspace_bpe, {}, True),
    # transformers cleans up decoded spaces for a WordPiece, never for a BPE.
    "word_piece_clean_up": (
        tiny.word_piece,
        {"clean_up_tokenization_spaces": True},
        False,
    ),
    "byte_level_clean_up": (
        tiny.byte_level_bpe,
        {"clean_up_tokenization_spaces": True},
        True,
    ),
}


def write_json(folder, name, content):
    with open(os.path.join(folder, name), "w", encoding="utf-8") as file:
        json.dump(content, file)


@pytest.fixture(scope="module", params=KINDS)
def folders(request, tmp_path_factory):
    """`(ours, transformers' AutoTokenizer, adds BOS)` of one kind's folder."""
    build, config, adds_bos = KINDS[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    tiny.write_tokenizer_folder(folder, build(), **config)
    reference = transformers.AutoTokenizer.from_pretrained(folder)
    return load_tokenizer(folder), reference, adds_bos


def test_encode_as_transformers(folders):
    ours, reference, adds_bos = folders
    for text in tiny.TEXTS:
        assert ours.encode(text) == reference(text)["input_ids"], text
        assert (
            ours.encode(text, add_special_tokens=False)
            == reference(text, add_special_tokens=False)["input_ids"]
        )
    assert ours.encode(tiny.TEXTS) == reference(tiny.TEXTS)["input_ids"]
    assert ours.encode(tuple(tiny.TEXTS[:2])) == ours.encode(tiny.TEXTS[:2])
    assert ours.encode([]) == []
    assert ours.adds_bos_token is adds_bos
    assert (ours.encode("a")[0] == ours.bos_token_id) is adds_bos


def test_decode_as_transformers(folders):
    ours, reference, _ = folders
    rows = reference(tiny.TEXTS)["input_ids"]
    for row in rows:
        row = [*row, reference.eos_token_id, reference.pad_token_id]
        for skip in (True, False):
            expected = reference.decode(row, skip_special_tokens=skip)
            assert ours.decode(row, skip_special_tokens=skip) == expected
    # A batch as `generate` returns it: numpy int32, padded.
    width = max(map(len, rows))
    padded = [row + [reference.pad_token_id] * (width - len(row)) for row in rows]
    padded = np.array(padded, "int32")
    assert ours.decode(padded) == reference.batch_decode(
        padded.tolist(), skip_special_tokens=True
    )
    assert ours.decode(rows) == [ours.decode(row) for row in rows]  # ragged
    assert ours.decode(padded[0]) == ours.decode(padded[0].tolist())


def test_decode_takes_any_row_of_ids(folders):
    ours, _, _ = folders
    ids = ours.encode("Hello world!", add_special_tokens=False)
    text = ours.decode(ids)
    assert ours.decode(tuple(ids)) == text
    assert ours.decode(np.array(ids, "int64")) == text
    assert ours.decode(np.array([ids, ids], "uint16")) == [text, text]
    assert ours.decode(ids[0]) == ours.decode(ids[:1])
    assert ours.decode([]) == ""


@pytest.fixture
def folder(tmp_path):
    """A byte-level tokenizer folder naming BOS, end and padding tokens (ids
    0, 1 and 2)."""
    return tiny.write_tokenizer_folder(tmp_path)


def special_ids(tokenizer):
    return tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id


def test_special_ids_from_the_tokenizer_config_as_transformers(folder):
    reference = transformers.AutoTokenizer.from_pretrained(folder)
    assert special_ids(load_tokenizer(folder)) == special_ids(reference) == (0, 1, 2)


def test_special_ids_named_as_added_tokens(tmp_path):
    """Older folders name the tokens as `AddedToken` dicts, in
    tokenizer_config.json or special_tokens_map.json."""
    tiny.write_tokenizer_folder(tmp_path, bos_token=None, pad_token=None)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["eos_token"] = {"__type": "AddedToken", "content": tiny.PAD}
    write_json(tmp_path, "tokenizer_config.json", config)
    write_json(tmp_path, "special_tokens_map.json", {"bos_token": tiny.EOS})
    reference = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert special_ids(load_tokenizer(tmp_path)) == special_ids(reference)
    assert special_ids(reference) == (1, 2, None)


def test_generation_config_then_config_then_tokenizer(folder):
    write_json(folder, "config.json", {"bos_token_id": 5, "pad_token_id": 6})
    write_json(folder, "generation_config.json", {"eos_token_id": [1, 7]})
    assert special_ids(load_tokenizer(folder)) == (5, [1, 7], 6)
    write_json(folder, "generation_config.json", {"bos_token_id": 9})
    tokenizer = load_tokenizer(folder)
    reference = transformers.GenerationConfig.from_pretrained(folder)
    assert tokenizer.bos_token_id == reference.bos_token_id == 9
    assert tokenizer.eos_token_id == 1  # from tokenizer_config.json
    assert not tokenizer.adds_bos_token  # 0 starts the texts, not 9


def test_special_ids_of_a_text_config_as_transformers(tmp_path):
    """Multimodal configs (Gemma 3's) keep the decoder's ids in `text_config`."""
    tiny.write_tokenizer_folder(tmp_path, bos_token=None, eos_token=None)
    config = {"eos_token_id": [1, 106], "text_config": {"bos_token_id": 2}}
    write_json(tmp_path, "config.json", config)
    reference = transformers.GenerationConfig.from_model_config(config)
    tokenizer = load_tokenizer(tmp_path)
    assert special_ids(tokenizer) == (2, [1, 106], 2)
    assert (reference.bos_token_id, reference.eos_token_id) == (2, [1, 106])


def test_no_special_ids_declared(tmp_path):
    tiny.write_tokenizer_folder(
        tmp_path, bos_token=None, eos_token=None, pad_token=None
    )
    tokenizer = load_tokenizer(tmp_path)
    assert special_ids(tokenizer) == (None, None, None)
    assert not tokenizer.adds_bos_token  # no id declared to say it is a BOS
    assert "bos_token_id=None" in repr(tokenizer)


@pytest.mark.parametrize(
    "declared",
    [{"eos_token_id": "1"}, {"bos_token_id": [0]}, {"pad_token_id": -1}],
)
def test_bad_special_ids_raise(folder, declared):
    write_json(folder, "config.json", declared)
    with pytest.raises(ValueError, match=f"`{next(iter(declared))}` .*expected"):
        load_tokenizer(folder)


def test_missing_folder_raises(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist.*hf download"):
        load_tokenizer(tmp_path / "absent")
    with pytest.raises(TypeError, match="`path` must be a local folder.*int"):
        load_tokenizer(3)


def test_a_file_for_the_folder_raises(folder):
    with pytest.raises(ValueError, match="not a file.*tokenizer.json"):
        load_tokenizer(folder / "tokenizer.json")


def test_a_folder_without_tokenizer_json_raises(tmp_path):
    (tmp_path / "vocab.json").write_text("{}")
    (tmp_path / "merges.txt").write_text("")
    with pytest.raises(
        FileNotFoundError,
        match=r"no tokenizer.json; it holds \['merges.txt', 'vocab.json'\].*"
        r"reads tokenizer.json only.*save_pretrained",
    ):
        load_tokenizer(tmp_path)


def test_unreadable_files_raise(folder):
    write_json(folder, "generation_config.json", [1, 2])
    with pytest.raises(ValueError, match="generation_config.json must hold a JSON"):
        load_tokenizer(folder)
    (folder / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="Cannot read .*generation_config.json as"):
        load_tokenizer(folder)
    os.remove(folder / "generation_config.json")
    (folder / "tokenizer.json").write_text('{"version": "1.0"}')
    with pytest.raises(ValueError, match="Cannot read .*tokenizer.json with the"):
        load_tokenizer(folder)


def test_without_the_tokenizers_package(folder, tmp_path, monkeypatch):
    """The folder is checked first; then the missing package names the extra."""
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokenizer(tmp_path / "absent")
    with pytest.raises(ImportError, match=r"keras-attn\[huggingface\]"):
        load_tokenizer(folder)


@pytest.mark.parametrize(
    "method, value, match",
    [
        ("encode", 3, "`text` must be a str or a list of str.*int"),
        ("encode", ["a", 3], "`text` must be a str or a list of str"),
        ("decode", np.zeros((1, 2, 3), "int32"), r"shape \(1, 2, 3\)"),
        ("decode", [0.5, 1.5], "must be int token ids.*float64"),
    ],
)
def test_bad_encode_and_decode_inputs_raise(folder, method, value, match):
    with pytest.raises(TypeError, match=match):
        getattr(load_tokenizer(folder), method)(value)
