"""The one engine factory: a rollout engine of the `runtime.engine` kind, sized from the config.

Used wherever an engine is started: the local runtime, each Ray engine replica, `molt eval` and
`molt serve`, so one sizing formula holds for all. Engine kinds are registered in `ENGINES` by name; adding a
rollout engine is one builder here plus its class behind `molt.engine.interface.Engine`. The built-in engine's
KV cache is the slot cache (num_slots x max_len positions preallocated; fastest on CPU) or the paged cache
(blocks sized from a memory budget, so memory follows the tokens in flight); `auto` takes the paged one on CUDA
for dense text models."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch

from molt.config import Config, ConfigError
from molt.engine.blocks import KVBudgetError, bytes_per_block
from molt.engine.interface import Engine
from molt.models.config import TransformerConfig
from molt.models.transformer import Transformer
from molt.registry import Registry
from molt.train.precision import resolve_dtype


def engine_kwargs(
    cfg: Config, model_cfg: TransformerConfig, *, num_slots: int | None = None, max_len: int | None = None
) -> dict[str, Any]:
    """Keyword arguments of `TorchEngine` for this run's engine (not the model, tokenizer or version): twice the
    episodes in flight in slots of `rollout.max_len` (+1) positions, unless `num_slots` / `max_len` are given."""
    rt = cfg.runtime
    slots = num_slots or cfg.rollout.episodes_in_flight * 2
    max_len = max_len or cfg.rollout.max_len
    kwargs: dict[str, Any] = dict(num_slots=slots, max_seq_len=max_len + 1, compile=rt.engine_compile)
    if cfg.runtime.kv_cache_kind(model_cfg) == "paged":
        kwargs["graphs"] = rt.cuda_graphs and rt.device.startswith("cuda")
        if rt.kv_gb > 0:
            kwargs["kv_bytes"] = int(rt.kv_gb * 1e9)
        elif rt.device.startswith("cuda"):
            kwargs["kv_memory_fraction"] = rt.kv_memory_fraction
        else:  # the slot cache's positions, in blocks
            kwargs |= dict(kv_blocks=-(-slots * (max_len + 1) // 16), block_size=16)
    return kwargs


def check_slot_memory(model_cfg: TransformerConfig, sizing: dict[str, Any], key: str, dtype: torch.dtype) -> None:
    """A ConfigError naming `key` when the slot cache (every slot's positions, reserved up front, in `dtype`) needs
    more than the memory this machine has available (Linux MemAvailable; unknown elsewhere: not checked)."""
    try:
        meminfo = dict(line.split(":", 1) for line in open("/proc/meminfo").read().splitlines())  # noqa: SIM115
        free = int(meminfo["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return
    per_position = bytes_per_block(model_cfg.num_layers, model_cfg.num_kv_heads, model_cfg.head_dim, dtype.itemsize, 1)
    need = sizing["num_slots"] * sizing["max_seq_len"] * per_position
    if need > free:
        slots, positions = sizing["num_slots"], sizing["max_seq_len"]
        raise ConfigError(f"{key}: the engine's KV cache of {slots} sequences x {positions} positions needs "
                          f"{need / 1e9:.1f} GB, more than the {free / 1e9:.1f} GB available here: lower {key}, or "
                          "use --runtime.kv_cache paged --runtime.kv_gb N (memory follows the tokens)")  # fmt: skip


ENGINES: Registry[Callable[..., Engine]] = Registry("runtime.engine")  # builders with `torch_engine`'s signature


@ENGINES.register("torch")
def torch_engine(cfg: Config, model: Transformer, tokenizer, *, version: int, threads: int, sizing: dict) -> Engine:
    """The built-in engine over `model` (cast to the compute dtype; its thread runs `threads` torch threads)."""
    from molt.engine import TorchEngine

    model = model.eval().to(device=cfg.runtime.device, dtype=resolve_dtype(cfg.model.dtype, cfg.runtime.device))
    threads = cfg.runtime.engine_threads or threads
    return TorchEngine(model, tokenizer=tokenizer, num_threads=threads, version=version, **sizing)


@ENGINES.register("vllm")
def vllm_engine(cfg: Config, model: Transformer, tokenizer, *, version: int, threads: int, sizing: dict) -> Engine:
    """vLLM over a saved copy of `model`, in the run's compute dtype; the trainer step of this process runs with
    `threads` torch threads."""
    from molt.engine.vllm import VLLMEngine

    slots, max_len = sizing["num_slots"], sizing["max_seq_len"]
    dtype = resolve_dtype(cfg.model.dtype, cfg.runtime.device)
    return VLLMEngine.from_model(
        model, tokenizer, num_slots=slots, max_model_len=max_len, dtype=dtype, version=version, compute_threads=threads
    )


def build_engine(
    cfg: Config,
    model: Transformer,
    tokenizer,
    *,
    threads: int,
    version: int = 0,
    owned: bool = False,
    num_slots: int | None = None,
    max_len: int | None = None,
) -> Engine:
    """A `runtime.engine` engine holding `model` at `version` (a copy unless `owned`: the trainer keeps its own);
    `threads`: torch threads of its compute (`runtime.engine_threads` wins for the built-in engine's thread);
    `num_slots` / `max_len` override the rollout's sizing (`molt serve`)."""
    sizing = engine_kwargs(cfg, model.cfg, num_slots=num_slots, max_len=max_len)
    if cfg.runtime.engine == "torch" and cfg.runtime.kv_cache_kind(model.cfg) == "slot" and cfg.runtime.device == "cpu":
        dtype = resolve_dtype(cfg.model.dtype, "cpu")
        check_slot_memory(model.cfg, sizing, "chat.max_len" if max_len else "rollout.max_len", dtype)
    if cfg.runtime.engine == "torch" and not owned:
        model = copy.deepcopy(model)
    try:
        return ENGINES.get(cfg.runtime.engine)(cfg, model, tokenizer, version=version, threads=threads, sizing=sizing)
    except KVBudgetError as e:
        raise ConfigError(f"runtime.kv_gb: {e}; raise the budget (or lower rollout.max_len / chat.max_len)") from None
