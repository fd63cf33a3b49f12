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
        "auto_map",  # remote code transformers runs only if trusted
    }
)
# Entries a family's transformers config class fills in when config.json
# lacks them (transformers 5.24's class defaults): an absent entry means
# these, an entry of `null` means none.
DEFAULTS = {
    "gpt2": {"activation_function": "gelu_new", "layer_norm_epsilon": 1e-5},
    "llama": {"hidden_act": "silu", "rms_norm_eps": 1e-6},
    "mistral": {"hidden_act": "silu", "rms_norm_eps": 1e-6, "sliding_window": 4096},
    "qwen2": {"hidden_act": "silu", "rms_norm_eps": 1e-6, "max_window_layers": 28},
    "qwen3": {"hidden_act": "silu", "rms_norm_eps": 1e-6, "max_window_layers": 28},
    "phi3": {"hidden_act": "silu", "rms_norm_eps": 1e-5},
    "smollm3": {"hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 2e6},
    "gemma": {"hidden_act": "gelu_pytorch_tanh", "rms_norm_eps": 1e-6},
    "gemma2": {
        "hidden_activation": "gelu_pytorch_tanh",
        "rms_norm_eps": 1e-6,
        "sliding_window": 4096,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
        "query_pre_attn_scalar": 256,
    },
    "gemma3_text": {
        "hidden_activation": "gelu_pytorch_tanh",
        "rms_norm_eps": 1e-6,
        "sliding_window": 4096,
        "query_pre_attn_scalar": 256,
        "rope_theta": 1e6,
        "rope_local_base_freq": 1e4,
    },
    "mixtral": {"hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 1e6},
    "qwen3_moe": {
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "norm_topk_prob": False,
        "decoder_sparse_step": 1,
        "max_window_layers": 28,
    },
    "gpt_oss": {
        "attention_bias": True,
        "rms_norm_eps": 1e-5,
        "sliding_window": 128,
        "swiglu_limit": 7.0,
        "swiglu_alpha": 1.702,
        "head_dim": 64,
    },
    "deepseek_v3": {
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "norm_topk_prob": True,
        "n_group": 8,
        "topk_group": 4,
        "routed_scaling_factor": 2.5,
        "n_shared_experts": 1,
        "first_k_dense_replace": 3,
        "rope_interleave": True,
        "num_nextn_predict_layers": 1,
        "q_lora_rank": 1536,
    },
}


class HFConfig(ConfigEntries):
    """`config.json`'s entries (`values`), each read at most through
    `get`/`[]`; `check_all_read` refuses any entry nobody read that is not
    `NEUTRAL`."""

    verb = "load"

    def __init__(self, values):
        family = values.get("model_type")
        super().__init__(values, family, "from_hugging_face", NEUTRAL)
        self.read.add("model_type")
        self.defaults = DEFAULTS.get(family, {})

    def __getitem__(self, key):
        if key not in self.values and key in self.defaults:
            return self.get(key)
        return super().__getitem__(key)

    def get(self, key, default=None):
        """The entry; where config.json lacks it, the family's default (as
        transformers fills it in), else `default`; `default` for a null."""
        if key not in self.values and key in self.defaults:
            self.read.add(key)
            return self.defaults[key]
        return super().get(key, default)

    def require(self, key, expected, why):
        """Refuse unless the entry is absent or `expected` (a value we compute)."""
        value = self.get(key)
        if value is not None and value != expected:
            self.refuse(key, why)
