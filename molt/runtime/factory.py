"""The one engine factory: a rollout engine of the `runtime.engine` kind, sized by `sizing.engine_kwargs`.

Used wherever an engine is started: the local runtime, each Ray engine replica, `molt eval` and
`molt serve`. Engine kinds are registered in `ENGINES` by name; adding a rollout engine is one
builder here plus its class behind `molt.engine.interface.Engine`.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

from molt.config import Config
from molt.engine.interface import Engine
from molt.models.transformer import Transformer
from molt.registry import Registry
from molt.runtime.sizing import engine_kwargs
from molt.train.precision import resolve_dtype

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
    """vLLM over a saved copy of `model`; the trainer step of this process runs with `threads` torch threads."""
    from molt.engine.vllm import VLLMEngine

    slots, max_len = sizing["num_slots"], sizing["max_seq_len"]
    return VLLMEngine.from_model(
        model, tokenizer, num_slots=slots, max_model_len=max_len, version=version, compute_threads=threads
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
    if cfg.runtime.engine == "torch" and not owned:
        model = copy.deepcopy(model)
    return ENGINES.get(cfg.runtime.engine)(cfg, model, tokenizer, version=version, threads=threads, sizing=sizing)
