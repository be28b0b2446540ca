"""Molt's model family: one transformer (dense and MoE), HF-format I/O, tokenizers and presets."""

from molt.models.attention import KVCache, PackedCausal, doc_ids_from_lengths
from molt.models.config import PRESETS, TransformerConfig, config_from_hf, config_to_hf, preset
from molt.models.hf_io import from_pretrained, load_config, save_pretrained
from molt.models.moe import NO_ROUTE, Routing
from molt.models.tokenizer import apply_chat_template, assistant_mask, build_builtin_tokenizer, load_tokenizer
from molt.models.transformer import Transformer

__all__ = ["NO_ROUTE", "PRESETS", "KVCache", "PackedCausal", "Routing", "Transformer", "TransformerConfig",
           "apply_chat_template", "assistant_mask", "build_builtin_tokenizer", "config_from_hf", "config_to_hf",
           "doc_ids_from_lengths", "from_pretrained", "load_config", "load_tokenizer", "preset",
           "save_pretrained"]  # fmt: skip
