"""The asynchronous RL loop: rollout -> bounded buffer -> train -> sync, plus eval and checkpoints.

Named coroutines share one asyncio loop. `rollout` keeps episodes in flight and admits a prompt group only while it
would not be older than `max_staleness` versions when trained, were groups to finish in the order they started (0 =
synchronous training on the same code path); `train` takes complete groups as they finish, re-checks staleness (a
slow group overtaken by later ones can exceed it: dropped as `stale`, counted), steps the trainer on the engine's
thread, and `sync` pushes the weights.
Every sample is trained on or dropped with a counted reason (`drop/<reason>`, see `molt/loop/accounting.py`). A
ChatAgent rollout may yield several segments sharing reward and rollout id; a group holds all of them. Group filters
read `reward` (or `score`: `rollout.filter_on`); `rollout.dump` writes each trained batch for `molt/loop/replay.py`."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import math
import random
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from molt import algo
from molt.agents.chat.agent import local_rollout
from molt.agents.runner import EpisodeLimits, real_number
from molt.agents.watchdog import SWALLOWED
from molt.agents.workers import AgentWorkers
from molt.config import Config
from molt.data.dataset import rows_digest
from molt.data.trajectory import Trajectory
from molt.engine.interface import Engine, SamplingParams, work_since
from molt.errors import RolloutDrop, RunFatalError
from molt.loop.accounting import (
    FAILURE_LOG,
    Accounting,
    Dropped,
    Failed,
    LoopState,
    RolloutOutcome,
    Sampled,
    check_same_rows,
)
from molt.loop.dump import ROLLOUTS, drop_shards_after, write_shard
from molt.loop.evaluate import chat_runner, episode_limits, evaluate, named_reward_means, rollout_sampling
from molt.train.interface import Trainer

log = logging.getLogger("molt.loop")
CANCEL_GRACE_S = 10.0  # how long a stopping loop waits for its cancelled rollouts


class RLLoop(Accounting):
    """Drives one RL run; `make_env()` builds a fresh Env per episode."""

    def __init__(
        self,
        cfg: Config,
        *,
        engine: Engine,
        trainer: Trainer,
        tokenizer,
        make_env: Callable[[], Any],
        train_rows: list[dict],
        eval_rows: list[dict],
        state: LoopState | None = None,
        run_dir: str | Path | None = None,
        workers: AgentWorkers | None = None,
    ):
        run_dir = run_dir or cfg.log.run_dir or cfg.ckpt.resume  # where run.py puts the run (when it is known)
        super().__init__(cfg, state or LoopState(), Path(run_dir) / FAILURE_LOG if run_dir else None)
        self.engine, self.trainer, self.tokenizer = engine, trainer, tokenizer
        self.train_rows, self.eval_rows = train_rows, eval_rows
        self._check_same_rows()
        ro = cfg.rollout
        self.group_size, self.groups_per_step = ro.n_samples_per_prompt, ro.prompts_per_step
        self.limits, self.sampling = episode_limits(cfg), rollout_sampling(cfg, tokenizer, ro.temperature)
        self.buffer: asyncio.Queue[list[Trajectory]] = asyncio.Queue()
        self.in_flight = asyncio.Semaphore(ro.episodes_in_flight)
        self.version_changed = asyncio.Condition()
        # groups assigned to steps >= state.step: started and not dropped (in flight, buffered, or taken)
        self.scheduled = len(self.state.buffer)
        self.running: set[int] = set()
        self.counted: dict[int, list[int]] = {}  # a running group's episodes counted in state: [rollouts, failures]
        self.group_tasks: set[asyncio.Task] = set()
        self.fatal: BaseException | None = None
        self.dump_dir = Path(run_dir) / ROLLOUTS if run_dir and cfg.rollout.dump else None
        if run_dir:
            drop_shards_after(Path(run_dir) / ROLLOUTS, self.state.step)
        self.said_no_eval = False
        self.history: list[dict[str, Any]] = []
        self.rollout_tokens, self.rollout_t0 = 0, time.perf_counter()  # `run` starts them again
        self.run_t0 = time.perf_counter() - self.state.elapsed_s  # `run` starts it again: the eval before is no step
        # the first segment of each rollout sampled since the last step (a resume: what its checkpoint had not logged)
        self.step_rollouts = [SimpleNamespace(reward=r, info=i, group_id=None) for r, i in self.state.unlogged]
        self.state.unlogged = []
        self.engine_stats: dict[str, float] = {}
        self.chat = chat_runner(cfg, engine, tokenizer)  # the server starts on first use
        self.workers = workers  # rollout.agent_workers processes, started by the command
        self.local = local_rollout(self.chat, engine, tokenizer, make_env)  # rollouts on this event loop

    # ---- rollout ---------------------------------------------------------------------------------
    def _may_start(self) -> bool:
        """A group started now is trained at step `state.step + scheduled // P` (0-based); its tokens are sampled
        at version >= engine.version, so it may start only if that difference is <= max_staleness, and only for a
        step the run will train."""
        lands_at = self.state.step + self.scheduled // self.groups_per_step
        fresh = lands_at - self.engine.version <= self.cfg.rollout.max_staleness
        return self.fatal is not None or (fresh and lands_at < self.cfg.train.max_steps)

    async def _notify(self) -> None:
        async with self.version_changed:
            self.version_changed.notify_all()

    async def rollout(self) -> None:
        """Keep prompt groups in flight; put complete, unfiltered groups in the buffer."""
        while True:
            async with self.version_changed:
                await self.version_changed.wait_for(self._may_start)
            if self.fatal is not None:
                raise self.fatal
            if self.state.restart_groups:
                group_index = self.state.restart_groups.pop(0)
            else:
                group_index, self.state.next_group = self.state.next_group, self.state.next_group + 1
            self.scheduled += 1
            self.running.add(group_index)
            task = asyncio.create_task(self._group(group_index))
            self.group_tasks.add(task)
            task.add_done_callback(self.group_tasks.discard)

    async def _group(self, group_index: int) -> None:
        row = self.train_rows[row_index(group_index, len(self.train_rows), self.cfg.data.seed)]
        try:
            outcomes = await asyncio.gather(*(self._episode(row, group_index, k) for k in range(self.group_size)))
            group = [segment for o in outcomes if isinstance(o, Sampled) for segment in o.segments]
            reason = next((o.reason for o in outcomes if isinstance(o, Dropped)), None)  # e.g. over the context
            num_failed = sum(isinstance(o, Failed) for o in outcomes)
            too_few = self.complete_groups or self.group_size - num_failed < self.min_rollouts
            if reason is None and num_failed and too_few:
                reason = "agent_failure"
            if reason is not None:
                self._drop(reason, self.group_size)
                self._check_progress(reason)
            else:
                if num_failed:  # the failed samples only; the group trains on
                    self.state.drops["agent_failure"] += num_failed
                if self._keep(group):
                    await self.buffer.put(group)
        except asyncio.CancelledError:
            raise  # stays in `running`: a checkpoint written after the loop stopped restarts it on resume
        except BaseException as e:  # noqa: BLE001 - surfaced by the rollout coroutine
            self.fatal = e
        self.running.discard(group_index)
        self.counted.pop(group_index, None)
        await self._notify()

    async def _rollout(self, row: dict, sampling: SamplingParams, limits: EpisodeLimits, **kw) -> list[Trajectory]:
        """One rollout of a fresh Env or ChatAgent: in an agent worker process if the run has them, else here."""
        return await (self.workers.run if self.workers is not None else self.local)(row, sampling, limits, **kw)

    async def _episode(self, row: dict, group_index: int, k: int) -> RolloutOutcome:
        rollout_id = group_index * self.group_size + k
        sampling = dataclasses.replace(self.sampling, seed=self.cfg.train.seed * 1_000_003 + rollout_id)
        keep_ids = self.cfg.train.check_tokens == "exhaustive"
        async with self.in_flight:
            try:
                ids = {"rollout_id": rollout_id, "group_id": group_index}
                segments = await self._rollout(row, sampling, self.limits, keep_ids=keep_ids, **ids)
            except RolloutDrop as e:  # e.g. an image that does not fit the context: dropped, not failed
                return self._count_drop(e, row)
            except RunFatalError:  # e.g. an engine replica that is gone for good
                raise
            except Exception as e:  # noqa: BLE001 - agent code fails this rollout only
                counted = self.counted.setdefault(group_index, [0, 0])
                counted[0], counted[1] = counted[0] + 1, counted[1] + 1
                self._count_failure(e, rollout_id, group_index, row)
                return Failed(e)
        self.state.rollouts += 1
        self.counted.setdefault(group_index, [0, 0])[0] += 1
        if self.last_failure:  # this process saw a failure (a resumed run's counters alone do not stop it)
            self._check_failure_rate()
        self.rollout_tokens += sum(s.num_action_tokens for s in segments)
        self.step_rollouts += segments[:1]  # a rollout's segments share its reward and info
        return Sampled(segments)

    def _keep(self, group: list[Trajectory]) -> bool:
        """Whether no group filter drops `group`; filters read `reward`, or `score` with rollout.filter_on score."""
        on_score = self.cfg.rollout.filter_on == "score"
        signal = [t.score if on_score and t.score is not None else t.reward for t in group]
        group_ids, rollout_ids = torch.tensor([t.group_id for t in group]), torch.tensor([t.rollout_id for t in group])
        scores = torch.tensor(signal, dtype=torch.float32)
        params = algo.FilterParams(self.cfg.rollout.score_range)
        keep, metrics = algo.filter_groups(scores, group_ids, rollout_ids, filters=self.filters, params=params)
        if bool(keep.all()):
            self.dropped_in_a_row.clear()
            return True
        reason = next((k.removesuffix("_frac") for k, v in metrics.items() if float(v) > 0), "filter_filter")
        self._drop(reason, len(group))  # `filter_<name>`: `algo.filter_groups` names its metrics `filter_<name>_frac`
        self._check_progress(reason)
        return False

    def _drop(self, reason: str, num_samples: int) -> None:
        """Count a dropped group's samples; its slot in the schedule is refilled by a new prompt."""
        self.state.drops[reason] += num_samples
        self.group_drops[reason] += 1
        self.step_dropped_groups += 1
        self.scheduled -= 1

    # ---- train + sync ----------------------------------------------------------------------------
    async def _next_batch(self) -> list[Trajectory]:
        """`prompts_per_step` groups from the buffer, none older than max_staleness."""
        batch: list[Trajectory] = []
        num_groups = 0
        while num_groups < self.groups_per_step:
            group = await self.buffer.get()
            if self.trainer.version - min(t.min_version() for t in group) > self.cfg.rollout.max_staleness:
                self._drop("stale", len(group))
                await self._notify()
                continue
            batch += group
            num_groups += 1
        return batch

    async def sync(self) -> None:
        """Push the trainer's weights to the engine under the new version."""
        t0 = time.perf_counter()
        weights = await asyncio.to_thread(self.trainer.weights)  # may gather from remote ranks; no frozen routers
        await self.engine.update_weights(weights, self.trainer.version, mode=self.cfg.rollout.sync_mode)
        self.sync_s = time.perf_counter() - t0
        await self._notify()

    async def train(self, on_step) -> None:
        """Optimizer steps until `train.max_steps`, with eval and checkpoints on schedule."""
        while self.state.step < self.cfg.train.max_steps:
            t0 = time.perf_counter()
            batch = await self._next_batch()
            if self.dump_dir is not None:  # exactly what this step trains on, before it trains
                await asyncio.to_thread(write_shard, self.dump_dir, self.state.step + 1, self.trainer.version, batch)
            metrics = await self._compute(self.trainer.step, batch)
            self.state.step += 1
            self.scheduled -= self.groups_per_step
            await self.sync()
            if not math.isfinite(metrics.get("train/grad_norm", 0.0)):
                why = "step %d skipped: the gradient norm is %s, so the optimizer did not step (%d skipped so far)"
                log.warning(why, self.state.step, metrics["train/grad_norm"], metrics["train/skipped_steps"])
            metrics |= self._loop_metrics(t0)
            if self._due(self.cfg.eval.every):
                metrics |= await self.evaluate()
                self.engine_stats = self._engine_snapshot()  # eval is not a step's work
            metrics |= self._rollout_metrics()  # after the eval: rollouts finished during it are this step's, in all
            self.history.append(metrics)
            on_step(metrics)
            if self._due(self.cfg.log.every) and (line := self.drop_line()):  # since the last such line, and why
                log.warning("step %d: %s", self.state.step, line)

    async def _compute(self, fn, *args):
        """Model compute off the event loop, where the engine wants it (`Engine.run_on_engine_thread`)."""
        return await self.engine.run_on_engine_thread(fn, *args)

    def _due(self, every: int) -> bool:
        return every > 0 and (self.state.step % every == 0 or self.state.step == self.cfg.train.max_steps)

    def _loop_metrics(self, t0: float) -> dict[str, Any]:
        """The step's timing and engine work (an eval after it is not the step's)."""
        return self._engine_metrics() | {
            "step": self.state.step,
            "version": self.trainer.version,
            "time/step_s": time.perf_counter() - t0,
            "time/elapsed_s": time.perf_counter() - self.run_t0,  # the loop's wall clock, over resumes too
            "time/sync_s": self.sync_s,
        }

    def _rollout_metrics(self) -> dict[str, Any]:
        """The rollouts' counters and rewards up to now: running totals, the groups dropped since the last step,
        and `_reward_metrics`."""
        counts = {f"drop/{k}": v for k, v in self.state.drops.items()} | self._reward_metrics()
        dropped, self.step_dropped_groups = self.step_dropped_groups, 0
        return counts | {
            "rollout/tokens_per_s": self.rollout_tokens / max(time.perf_counter() - self.rollout_t0, 1e-9),
            "rollout/rollouts": self.state.rollouts,
            "rollout/failures": self.state.failures,
            "rollout/buffer_groups": self.buffer.qsize(),
            "rollout/dropped_groups": dropped,
        }

    def _reward_metrics(self) -> dict[str, float]:
        """Over the rollouts sampled since the last step, before the group filters pick what trains
        (`train/reward_mean` is the trained samples'): the mean reward, each named reward (`named_reward_means`),
        and the mean of each other finite number (or bool) the agent put in `Result.info`, as `rollout/info/<key>`
        (over the rollouts that have it)."""
        firsts, self.step_rollouts = self.step_rollouts, []
        values: dict[str, list[float]] = {"rollout/reward_mean": [t.reward for t in firsts]}
        infos = [_numbers(t.info) for t in firsts]
        for info in infos:
            for key, value in info.items():
                if not key.startswith("reward/"):
                    values.setdefault(f"rollout/info/{key}", []).append(value)
        return {key: sum(v) / len(v) for key, v in values.items() if v} | named_reward_means(infos)

    def _engine_metrics(self) -> dict[str, float]:
        """Engine work since the last step (`work_since`), for engines that count it in this process; Ray
        replicas report theirs under `engine/i/`."""
        stats = self._engine_snapshot()
        if "busy_s" not in stats:
            return {}
        work, self.engine_stats = work_since(stats, self.engine_stats), stats
        return {
            "time/engine_s": work["busy_s"],
            "time/engine_decode_s": work["decode_s"],
            "rollout/decode_batch_mean": work["decode_batch_mean"],
        }

    def _engine_snapshot(self) -> dict[str, float]:
        return dict(self.engine.stats)

    async def evaluate(self) -> dict[str, float]:
        ev = self.cfg.eval
        sampling = rollout_sampling(self.cfg, self.tokenizer, ev.temperature)  # 0 = greedy
        rows = self.eval_rows[: ev.num_prompts]
        if not rows:
            if not self.said_no_eval:
                self.said_no_eval = True
                data = self.cfg.data
                why = (f"a data file keeps data.num_eval rows, at most 10%, for eval: none of {len(self.train_rows)}"
                       if data.path else f"data.num_eval is {data.num_eval}")  # fmt: skip
                log.warning("eval skipped: no held-out rows (%s); pass --data.eval_path, or --eval.every 0 to silence "
                            "this", why)  # fmt: skip
            return {}
        metrics = await evaluate(self.tokenizer, self._rollout, rows=rows, sampling=sampling, limits=self.limits,
                                 n=ev.n_samples, seed=ev.seed, failure_log=self.failure_log)  # fmt: skip
        if metrics["eval/failures"]:
            log.warning("step %d: eval: %d of %d samples failed (tracebacks in %s)", self.state.step,
                        metrics["eval/failures"], len(rows) * ev.n_samples, self.failure_log)  # fmt: skip
        return metrics

    async def run(self, on_step=lambda m: None) -> list[dict[str, Any]]:
        """Run rollout and train concurrently until the last step; returns per-step metrics."""
        for group in self.state.buffer:
            await self.buffer.put([Trajectory.from_dict(t) for t in group])
        self.state.buffer = []
        self.run_t0 = time.perf_counter() - self.state.elapsed_s
        self.rollout_tokens, self.rollout_t0 = 0, time.perf_counter()  # after the eval before, as time/elapsed_s
        self.engine_stats = self._engine_snapshot()  # the eval before does not count
        producer = asyncio.create_task(self.rollout(), name="rollout")
        trainer = asyncio.create_task(self.train(on_step), name="train")
        done: set[asyncio.Task] = set()
        try:
            done, _ = await asyncio.wait({producer, trainer}, return_when=asyncio.FIRST_COMPLETED)
        finally:  # also when the run itself is cancelled (Ctrl-C): no rollout outlives the loop's engine
            for task in (producer, trainer, *self.group_tasks):  # in-flight groups will not run; restarted on resume
                task.cancel()
            ended, stuck = await asyncio.wait({producer, trainer, *self.group_tasks}, timeout=CANCEL_GRACE_S)
            for task in ended - done:
                task.cancelled() or task.exception()  # retrieved: the cancellation's, not the run's failure
            if stuck:  # a Ctrl-C (or the end of the run) must not wait on them forever
                log.warning("%d task(s) of the loop ignored their cancellation and are left running: %s", len(stuck),
                            SWALLOWED)  # fmt: skip
        for task in done:
            task.result()  # re-raise a failure of either coroutine
        return self.history

    async def close(self) -> None:
        """Stop the chat server and the agent workers, if they started."""
        await self.chat.close()
        if self.workers is not None:
            await self.workers.close()

    def _check_same_rows(self) -> None:
        """A resume walks the same training rows with its cursor; other rows would put other prompts (held-out ones
        among them) where the checkpoint's cursor points, silently. (A replay reads no rows.)"""
        if not self.train_rows:
            return
        now = rows_digest(self.train_rows)
        check_same_rows(self.state.data, now, self.cfg.data)
        self.state.data = now

    def snapshot(self) -> LoopState:
        """Loop state for a checkpoint: buffered groups are kept; in-flight ones restart on resume (their episodes
        counted so far are taken out of the counters, as they run again)."""
        buffered = list(self.buffer._queue)  # noqa: SLF001 - asyncio.Queue has no public peek
        again = [sum(c) for c in zip(*self.counted.values(), strict=True)] if self.counted else [0, 0]
        return dataclasses.replace(
            self.state,
            rollouts=self.state.rollouts - again[0],
            failures=self.state.failures - again[1],
            restart_groups=sorted(self.running) + list(self.state.restart_groups),
            drops=dict(self.state.drops),
            buffer=[[t.to_dict() for t in g] for g in buffered],
            elapsed_s=time.perf_counter() - self.run_t0,
            unlogged=[[t.reward, _numbers(t.info)] for t in self.step_rollouts if t.group_id not in self.running],
        )


def _numbers(info: dict) -> dict[str, float]:
    """The finite numbers (and bools, as 0/1) of an agent's `Result.info`."""
    out = {}
    for key, value in info.items():
        with contextlib.suppress(TypeError, ValueError, OverflowError):
            out[key] = real_number(value, key)
    return out


def row_index(group_index: int, num_rows: int, seed: int) -> int:
    """The data row of prompt group `group_index`: the rows in order (shuffled when read), then each later pass over
    them in its own seeded order (a pass repeating the last one's order would repeat its batches), a function of
    the index alone, so a resume goes on exactly."""
    epoch, i = divmod(group_index, num_rows)
    return i if epoch == 0 else _epoch_order(num_rows, seed, epoch)[i]


@functools.lru_cache(maxsize=2)
def _epoch_order(num_rows: int, seed: int, epoch: int) -> list[int]:
    order = list(range(num_rows))
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return order
