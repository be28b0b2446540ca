"""`molt train --replay DIR`: the RL loop's train coroutine over a rollout dump, with no engine.

Step N trains on the batch `--rollout.dump` wrote for step N, checked line by line (`molt/loop/dump.py`), through
the same `trainer.step` as a live run, so a loss change can be debugged against fixed data. No engine, sync or
eval. The trainer steps on one thread with the torch threads the built-in engine's thread would have had, so a
replay of a run at `max_staleness 0` reproduces its losses bit for bit."""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from molt.config import Config, ConfigError
from molt.data.trajectory import Trajectory
from molt.engine.torch_engine import with_threads
from molt.log import read_metrics
from molt.loop.dump import read_shard, rollouts_folder, shard_name, shard_steps
from molt.loop.rl import LoopState, RLLoop
from molt.models import TransformerConfig
from molt.train.interface import Trainer

log = logging.getLogger("molt.loop")


def replay_folder(cfg: Config, start_step: int) -> Path:
    """The shards folder of `rollout.replay`, checked to hold steps `start_step + 1 .. train.max_steps` (a
    ConfigError before any model is built otherwise)."""
    folder = rollouts_folder(cfg.rollout.replay)
    steps = set(shard_steps(folder))
    if not steps:
        raise ConfigError(f"rollout.replay: {cfg.rollout.replay} holds no rollout shards (step-*.jsonl)")
    missing = [s for s in range(start_step + 1, cfg.train.max_steps + 1) if s not in steps]
    if missing:
        contiguous = len(steps) == max(steps) - min(steps) + 1
        have = f"steps {min(steps)}..{max(steps)}" if contiguous else "steps " + ", ".join(map(str, sorted(steps)))
        have = have if len(steps) > 1 else f"step {min(steps)}"
        raise ConfigError(
            f"rollout.replay: {folder} has no shard for step {missing[0]} (it has {have}); train.max_steps is "
            f"{cfg.train.max_steps}: lower it (the learning-rate schedule follows it) or replay a longer dump"
        )
    return folder


class ReplayLoop(RLLoop):
    """`RLLoop.train` fed from a dump: `_next_batch` reads the step's shard; rollout, sync and eval are off.
    `threads`: the run's compute threads (a live run's trainer steps with the built-in engine's, if set)."""

    def __init__(
        self,
        cfg: Config,
        *,
        trainer: Trainer,
        tokenizer,
        model_cfg: TransformerConfig,
        threads: int,
        state: LoopState | None = None,
        run_dir: str | Path | None = None,
    ):
        super().__init__(cfg, engine=None, trainer=trainer, tokenizer=tokenizer, make_env=lambda: None,  # type: ignore[arg-type]
                         train_rows=[], eval_rows=[], state=state, run_dir=run_dir)  # fmt: skip
        self.folder = replay_folder(cfg, self.state.step)
        self.model_cfg, self.vocab_size = model_cfg, model_cfg.vocab_size  # dumped ids, images and routing must fit
        moe = (model_cfg.num_moe_layers(), model_cfg.num_experts_per_tok, model_cfg.num_experts)
        self.moe = moe if model_cfg.num_experts else ()  # () a dense policy: recorded routing is refused
        if cfg.eval.every:
            log.warning("replay of %s: no eval (eval.every=%d): nothing generates without an engine",
                        self.folder, cfg.eval.every)  # fmt: skip
        if cfg.runtime.engine == "torch":
            threads = cfg.runtime.engine_threads or threads
        self.pool = ThreadPoolExecutor(1, "molt-replay", initializer=with_threads, initargs=(threads, lambda: None))

    async def _next_batch(self) -> list[Trajectory]:
        """This step's dumped batch, every line checked against the trainer's version."""
        step = self.state.step + 1
        path = self.folder / shard_name(step)
        return await asyncio.to_thread(read_shard, path, step=step, vocab_size=self.vocab_size,
                                       trainer_version=self.trainer.version,
                                       max_staleness=self.cfg.rollout.max_staleness, moe=self.moe,
                                       model_cfg=self.model_cfg)  # fmt: skip

    async def _compute(self, fn, *args):
        """On the one compute thread, with the torch threads a live run's trainer step has."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    async def sync(self) -> None:
        self.sync_s = 0.0

    async def evaluate(self) -> dict[str, float]:
        return {}

    def _engine_snapshot(self) -> dict[str, float]:
        return {}

    async def run(self, on_step=lambda m: None) -> list[dict[str, Any]]:
        """Train on the dumped batches until `train.max_steps`; returns per-step metrics."""
        self.state.buffer = []  # a resumed live run's buffered groups: the dump has what trained instead
        self.run_t0 = time.perf_counter() - self.state.elapsed_s
        first = self.state.step + 1

        def checked(metrics: dict[str, Any]) -> None:
            if metrics["step"] == first:
                self._check_policy(metrics)
            on_step(metrics)

        try:
            await self.train(checked)
        finally:
            self.pool.shutdown()
        return self.history

    def _check_policy(self, metrics: dict[str, Any]) -> None:
        """Warn when the first replayed step's log-prob gap to the dump is far above the run's own at that step:
        the policy rebuilt from config.yaml is then not the one that sampled it (another --model.path folder or
        warm-start cache, or another Molt), and every ratio of the replay is against other weights."""
        try:  # the run beside the dump (a copied rollouts folder has none: no check)
            rows = read_metrics(self.folder.parent) if (self.folder.parent / "metrics.jsonl").exists() else []
        except ConfigError:  # a mangled metrics.jsonl: no check, not a stopped replay
            rows = []
        own = [r for r in rows if r.get("step") == metrics["step"]]
        then = next((r["train/logprob_diff"] for r in own if "train/logprob_diff" in r), None)
        now = metrics.get("train/logprob_diff")
        if then is not None and now is not None and now > 10 * then + 1e-3:
            log.warning("replay step %d: train/logprob_diff %.3g against the run's %.3g: the policy rebuilt from its "
                        "config.yaml is not the one that sampled the dump (a changed model folder or warm-start "
                        "cache, another Molt version), or it computes otherwise (another --model.dtype, "
                        "--train.precision or device)", metrics["step"], now, then)  # fmt: skip
