"""Build a run's tokenizer and policy model from the `model` config group (every command starts here)."""

from __future__ import annotations

import torch

from molt.config import Config, ConfigError, ModelConfig, check
from molt.models import PRESETS, Transformer, from_pretrained, preset
from molt.models.config import TransformerConfig
from molt.models.tokenizer import IMAGE_PLACEHOLDER, TEMPLATE_ARGS, build_builtin_tokenizer, load_tokenizer
from molt.train.precision import resolve_dtype


def build_tokenizer(cfg: ModelConfig):
    """The configured tokenizer folder, the model folder's tokenizer, or Molt's built-in one; a ConfigError when it
    cannot load, has no chat template (every prompt is rendered with it) or has more tokens than the model folder's
    vocabulary."""
    if not cfg.tokenizer and not cfg.path:
        return with_template_args(build_builtin_tokenizer(image_token=PRESETS[cfg.preset].vision is not None), cfg)
    key = "model.tokenizer" if cfg.tokenizer else "model.path"
    try:
        tokenizer = load_tokenizer(cfg.tokenizer or cfg.path)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{key}: {e}") from None
    check(bool(tokenizer.chat_template), key, f"the tokenizer of {cfg.tokenizer or cfg.path} has no chat template "
          "(chat_template in tokenizer_config.json, or chat_template.jinja), and Molt renders every prompt and "
          "demonstration with one: add it, or pass --model.tokenizer FOLDER whose tokenizer has one")  # fmt: skip
    vocab = cfg.architecture().vocab_size if cfg.path else len(tokenizer)
    if len(tokenizer) > vocab:
        raise ConfigError(f"{key}: the tokenizer has {len(tokenizer)} tokens, more than the model's vocabulary {vocab}")
    return with_template_args(tokenizer, cfg)


def with_template_args(tokenizer, cfg: ModelConfig):
    """`tokenizer`, rendering every chat with `--model.template_args` (it travels with it, to agent workers too)."""
    setattr(tokenizer, TEMPLATE_ARGS, cfg.template_kwargs())
    return tokenizer


def check_same_tokenizer(tokenizer, folder: str, key: str) -> None:
    """A ConfigError naming `key` unless model folder `folder` has a tokenizer with `tokenizer`'s vocabulary and a
    model with a row for each of its tokens (a teacher or critic reads the policy's token ids)."""
    try:
        other = load_tokenizer(folder)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{key}: {e}; the folder needs the tokenizer it shares with the policy") from None
    if other.get_vocab() != tokenizer.get_vocab():
        sizes = f"{len(other)} vs {len(tokenizer)} tokens" if len(other) != len(tokenizer) else "other token ids"
        raise ConfigError(f"{key}: {folder}'s tokenizer is not the policy's ({sizes}); it must share the policy's")
    vocab = ModelConfig(path=folder).architecture().vocab_size
    check(vocab >= len(tokenizer), key, f"{folder}'s model has {vocab} vocabulary rows for {len(tokenizer)} tokens")


def build_model(
    cfg: ModelConfig, tokenizer, seed: int, device: str = "cpu", dtype: torch.dtype | None = None
) -> Transformer:
    """`cfg.path`'s model, or the preset sized to the tokenizer (seeded random weights); in `dtype` (or cfg.dtype's)."""
    dtype = dtype or resolve_dtype(cfg.dtype, device)
    if cfg.path:  # router precision is no HF config key: the run's setting applies
        return from_pretrained(cfg.path, dtype=dtype, device=device, router_fp32=cfg.router_fp32)
    model = Transformer(architecture(cfg, tokenizer)).init_weights(cfg.init_std, torch.Generator().manual_seed(seed))
    return model.to(device=device, dtype=dtype)


def architecture(cfg: ModelConfig, tokenizer) -> TransformerConfig:
    """The policy's architecture, no weights read: its folder's config, or the preset sized to the tokenizer."""
    if cfg.path:
        return cfg.architecture()
    ids = {f"{k}_token_id": getattr(tokenizer, f"{k}_token_id") for k in ("bos", "eos", "pad")}
    arch = preset(cfg.preset, vocab_size=len(tokenizer), router_fp32=cfg.router_fp32, **ids)
    if arch.vision is not None:
        arch.image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_PLACEHOLDER)
    return arch


def build_policy(cfg: Config, model_cfg: ModelConfig | None = None, dtype: torch.dtype | None = None):
    """(tokenizer, model) of `model_cfg` (default: the run's `model` group) on the run's device, seeded by it."""
    model_cfg = model_cfg or cfg.model
    tokenizer = build_tokenizer(model_cfg)
    return tokenizer, build_model(model_cfg, tokenizer, cfg.train.seed, cfg.runtime.device, dtype)
