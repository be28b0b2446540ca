"""The `Trainer` protocol: what the loop, the runtimes and checkpoints need of a policy trainer.

Implemented by `molt.train.trainer.Trainer` (one process) and `molt.runtime.ranks.RayTrainer` (data-parallel
Ray ranks)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from molt.data.trajectory import Trajectory
from molt.engine.interface import Weights


class Trainer(Protocol):
    """A policy trainer (see the module docstring)."""

    version: int
    num_skipped_steps: int
    sharded: bool  # checkpoints hold torch.distributed shards (resume with the same backend)

    def step(self, trajs: list[Trajectory]) -> dict[str, float]:
        """One optimizer step on `trajs` (complete groups), bumping `version`; scalar metrics."""

    def weights(self) -> Weights:
        """The weights rollout engines load, under Molt names."""

    def save(self, folder: Path, tokenizer) -> dict[str, Any]:
        """Write the HF policy folder `folder`; return the trainer state to store beside it."""

    def load(self, folder: Path, state: dict[str, Any]) -> None:
        """Restore the trainer state `save` returned (optimizer, schedule, extra models)."""
