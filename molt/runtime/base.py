"""The runtime interface: where a run's trainer, extra models and rollout engines live.

A `Runtime` places the policy trainer (with its reference, critic and teacher models), starts the rollout engines
from the one engine factory (`molt/runtime/factory.py`) and reports its own metrics. Weight sync goes through the
interfaces it hands out: `trainer.weights()` into `engine.update_weights(...)`. Backends are registered in
`RUNTIMES` by `runtime.backend` name: `local` (`LocalRuntime`, below: one process, the default, no Ray) and `ray`
(actors; Ray is imported only then)."""

from __future__ import annotations

import abc
from typing import Any

from molt.config import Config
from molt.engine.interface import Engine
from molt.models.transformer import Transformer
from molt.registry import Registry
from molt.runtime.factory import build_engine
from molt.train.interface import Trainer
from molt.train.trainer import Trainer as LocalTrainer


class Runtime(abc.ABC):
    """One backend's placement of a run: built from the config and the policy model (on the driver)."""

    trainer: Trainer

    @abc.abstractmethod
    def start_engines(self, tokenizer, version: int) -> Engine:
        """The rollout engine(s) holding the policy at `version`, as one `Engine`."""

    def metrics(self) -> dict[str, Any]:
        """Per-step metrics of the runtime itself (replica load, weight-sync bandwidth); none by default."""
        return {}

    @abc.abstractmethod
    async def close(self) -> None:
        """Stop the engines and release everything this runtime placed."""


RUNTIMES: Registry = Registry("runtime.backend")


@RUNTIMES.register("local")
class LocalRuntime(Runtime):
    """One process: `Trainer(model)` here, and one engine from the factory over a copy of the policy in the
    compute dtype (the trainer keeps the training copy)."""

    def __init__(self, cfg: Config, model: Transformer, threads: int):
        self.cfg, self.model, self.threads = cfg, model, threads
        self.trainer = LocalTrainer(model, cfg)
        self.engine: Engine | None = None

    def start_engines(self, tokenizer, version: int) -> Engine:
        """One `runtime.engine` engine over a copy of the policy (`threads`: its compute threads)."""
        self.engine = build_engine(self.cfg, self.model, tokenizer, version=version, threads=self.threads)
        return self.engine

    async def close(self) -> None:
        if self.engine is not None:
            await self.engine.close()


@RUNTIMES.register("ray")
def _ray(cfg: Config, model: Transformer, threads: int) -> Runtime:
    from molt.runtime.backend import RayRuntime

    return RayRuntime(cfg, model)


def start_runtime(cfg: Config, model: Transformer, threads: int) -> Runtime:
    """The `runtime.backend` runtime of this run, holding the trainer of `model` (`threads`: local compute)."""
    return RUNTIMES.get(cfg.runtime.backend)(cfg, model, threads)
