"""How big the built-in engine is: sequence slots, context length and KV cache, from the config.

One formula for every engine `molt/runtime/factory.py` starts (local, Ray replicas, eval, serve). The KV cache is
the slot cache (num_slots x max_len positions preallocated; fastest on CPU) or the paged cache (blocks sized from a
memory budget, so memory follows the tokens in flight); `auto` takes the paged one on CUDA for dense text models.
"""

from __future__ import annotations

from typing import Any

from molt.config import Config
from molt.models.config import TransformerConfig


def kv_cache_kind(cfg: Config, model_cfg: TransformerConfig) -> str:
    """`slot` or `paged`: `runtime.kv_cache`, with `auto` resolved by device and model."""
    if cfg.runtime.kv_cache != "auto":
        return cfg.runtime.kv_cache
    dense_text = not model_cfg.num_moe_layers() and model_cfg.vision is None
    return "paged" if cfg.runtime.device.startswith("cuda") and dense_text else "slot"


def engine_kwargs(
    cfg: Config, model_cfg: TransformerConfig, *, num_slots: int | None = None, max_len: int | None = None
) -> dict[str, Any]:
    """Keyword arguments of `TorchEngine` for this run's engine (not the model, tokenizer or version): twice the
    episodes in flight in slots of `rollout.max_len` (+1) positions, unless `num_slots` / `max_len` are given."""
    rt = cfg.runtime
    slots = num_slots or cfg.rollout.episodes_in_flight * 2
    max_len = max_len or cfg.rollout.max_len
    kwargs: dict[str, Any] = dict(num_slots=slots, max_seq_len=max_len + 1, compile=rt.engine_compile)
    if kv_cache_kind(cfg, model_cfg) == "paged":
        kwargs["graphs"] = rt.cuda_graphs and rt.device.startswith("cuda")
        if rt.kv_gb > 0:
            kwargs["kv_bytes"] = int(rt.kv_gb * 1e9)
        elif rt.device.startswith("cuda"):
            kwargs["kv_memory_fraction"] = rt.kv_memory_fraction
        else:  # the slot cache's positions, in blocks
            kwargs["kv_blocks"] = -(-slots * (max_len + 1) // 16)
            kwargs["block_size"] = 16
    return kwargs
