"""Hugging Face checkpoint folders (`config.json`, safetensors and
`tokenizer.json`) in and out of keras_attn models."""

from keras_attn.models.hugging_face._load import from_hugging_face
from keras_attn.models.hugging_face._save import to_hugging_face
from keras_attn.models.hugging_face.tokenizer import Tokenizer, load_tokenizer

__all__ = ["Tokenizer", "from_hugging_face", "load_tokenizer", "to_hugging_face"]
