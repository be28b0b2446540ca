"""`--runtime.backend local` (the default): the trainer, its extra models and one engine in this process.

The engine comes from the one factory (`molt/runtime/factory.py`) as a copy of the policy in the compute
dtype; the trainer keeps the training copy. No Ray is imported.
"""

from __future__ import annotations

from molt.config import Config
from molt.engine.interface import Engine
from molt.models.transformer import Transformer
from molt.runtime.base import Runtime
from molt.runtime.factory import build_engine
from molt.train.trainer import Trainer


class LocalRuntime(Runtime):
    """One process: `Trainer(model)` here, the engine started by `start_engines`."""

    def __init__(self, cfg: Config, model: Transformer, threads: int):
        self.cfg, self.model, self.threads = cfg, model, threads
        self.trainer = Trainer(model, cfg)
        self.engine: Engine | None = None

    def start_engines(self, tokenizer, version: int) -> Engine:
        """One `runtime.engine` engine over a copy of the policy (`threads`: its compute threads)."""
        self.engine = build_engine(self.cfg, self.model, tokenizer, version=version, threads=self.threads)
        return self.engine

    async def close(self) -> None:
        if self.engine is not None:
            await self.engine.close()
