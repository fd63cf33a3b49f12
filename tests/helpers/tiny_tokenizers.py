"""Tiny Hugging Face tokenizer folders, built in-process with the `tokenizers`
package (trained on a few sentences) and written by transformers'
`save_pretrained`, as the hub's folders are: `tokenizer.json` and
`tokenizer_config.json`."""

import json

from tokenizers import (
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

CORPUS = [
    "Hello world, this is a tiny corpus for a tiny tokenizer.",
    "The quick brown fox jumps over the lazy dog!",
    "Attention is all you need; don't you think so?",
    "Keras runs on JAX, TensorFlow and PyTorch.",
]
BOS, EOS, PAD = "<|begin|>", "<|end|>", "<|pad|>"
# Texts to compare with transformers on: spaces, punctuation, accents and
# a script the corpus lacks (byte fallback), and special tokens as text.
TEXTS = [
    "Hello world!",
    "  the lazy fox , don't jump .",
    "héllo wörld 你好",
    f"{BOS}tiny{EOS} tokens",
    "",
]


def byte_level_bpe(adds_bos=True):
    """GPT-2 / Llama 3 style: a byte-level BPE; `adds_bos`: its post-processor
    starts each text with BOS (Llama 3's), else adds nothing (GPT-2's)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    _train(tokenizer, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    if adds_bos:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{BOS} $A",
            pair=f"{BOS} $A {BOS} $B",
            special_tokens=[(BOS, tokenizer.token_to_id(BOS))],
        )
    else:
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    return tokenizer


def metaspace_bpe():
    """Llama 2 / Gemma style: spaces as "▁" in the pieces, and the 256 byte
    pieces `<0x00>`... in the vocabulary (not special) for the characters
    outside it; BOS added."""
    trained = Tokenizer(models.BPE())
    trained.normalizer = normalizers.Replace(" ", "▁")
    _train(trained)
    model = json.loads(trained.to_str())["model"]
    vocabulary = model["vocab"]
    for byte in range(256):
        vocabulary[f"<0x{byte:02X}>"] = len(vocabulary)
    merges = [tuple(merge) for merge in model["merges"]]
    tokenizer = Tokenizer(models.BPE(vocabulary, merges, byte_fallback=True))
    tokenizer.add_special_tokens([BOS, EOS, PAD])
    tokenizer.normalizer = trained.normalizer
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A",
        special_tokens=[(BOS, tokenizer.token_to_id(BOS))],
    )
    return tokenizer


def word_piece():
    """BERT style: WordPiece on whitespace and punctuation (transformers
    cleans up the spaces it decodes before punctuation)."""
    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(
        vocab_size=200, special_tokens=["[UNK]", BOS, EOS, PAD]
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    return tokenizer


def _train(tokenizer, initial_alphabet=()):
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=[BOS, EOS, PAD],
        initial_alphabet=list(initial_alphabet),
    )
    tokenizer.train_from_iterator(CORPUS, trainer)


def write_tokenizer_folder(folder, tokenizer=None, **tokenizer_config):
    """Write `tokenizer` (default: `byte_level_bpe()`) to `folder` with
    transformers' `save_pretrained`, naming BOS, end and padding tokens (each
    overridable, or left out with None, through `tokenizer_config`, which
    also takes other `tokenizer_config.json` entries). Returns `folder`."""
    from transformers import PreTrainedTokenizerFast

    names = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}
    names.update(tokenizer_config)
    names = {key: value for key, value in names.items() if value is not None}
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer or byte_level_bpe(), **names
    )
    fast.save_pretrained(folder)
    return folder
