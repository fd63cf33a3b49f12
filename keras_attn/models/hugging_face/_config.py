"""A Hugging Face `config.json`, read entry by entry: every entry is read by
the family's reader, or known not to change the logits, or refused by name."""

from keras_attn.models._config_entries import ConfigEntries

# Entries that never change what a causal LM computes from token ids:
# bookkeeping, special token ids, caching, initialization, label maps, and
# heads a causal LM does not use (GPT-2's sequence summary).
NEUTRAL = frozenset(
    {
        "_name_or_path",
        "architectures",
        "transformers_version",
        "dtype",
        "torch_dtype",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "sep_token_id",
        "decoder_start_token_id",
        "use_cache",
        "cache_implementation",
        "initializer_range",
        "initializer_factor",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "id2label",
        "label2id",
        "task_specific_params",
        "problem_type",
        "tokenizer_class",
        "is_decoder",
        "tie_encoder_decoder",
        "chunk_size_feed_forward",
        "pretraining_tp",  # Llama 2: the same products, split (no longer used)
        "summary_type",
        "summary_use_proj",
        "summary_activation",
        "summary_proj_to_labels",
        "summary_first_dropout",
        "max_position_embeddings",  # a limit, not a number in the maths
        "n_ctx",
        "generation_config",
    }
)


class HFConfig(ConfigEntries):
    """`config.json`'s entries (`values`), each read at most through
    `get`/`[]`; `check_all_read` refuses any entry nobody read that is not
    `NEUTRAL`."""

    verb = "load"

    def __init__(self, values, path):
        super().__init__(values, values.get("model_type"), "from_hugging_face", NEUTRAL)
        self.read.add("model_type")
        self.path = path

    def require(self, key, expected, why):
        """Refuse unless the entry is absent or `expected` (a value we compute)."""
        value = self.get(key)
        if value is not None and value != expected:
            self.refuse(key, why)
