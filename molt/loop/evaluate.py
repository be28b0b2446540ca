"""Held-out evaluation: mean reward, named rewards and unbiased pass@k over n samples per prompt.

Training's eval and `molt eval` share it, so both score a checkpoint the same way: the same episodes, sampling,
seeds (`eval.seed * 1000003 + row * n + k`: seeds 1, 2, 3 share no samples) and rewards. A failed sample scores 0 in
every metric; its error goes, with the traceback of the first of each kind, to the run's `rollout_failures.log`."""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections import defaultdict
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from molt.agents.chat.agent import CHAT_SERVER_OPTIONS, ChatRunner, last_completion_text
from molt.agents.runner import EpisodeLimits
from molt.config import Config
from molt.data.rows import row_location
from molt.data.trajectory import Trajectory
from molt.engine.interface import Engine, SamplingParams
from molt.errors import RunFatalError, describe_error
from molt.loop.accounting import log_failure


def rollout_sampling(cfg: Config, tokenizer, temperature: float) -> SamplingParams:
    """The rollout's SamplingParams at `temperature` (training's rollouts and every eval; 0 = greedy). With top-p or
    top-k the engine records the log-probs of the truncated distribution it sampled from (`processed`), so the IS
    correction and `train/logprob_diff` see the truncation."""
    ro, stop = cfg.rollout, tuple(t for t in {tokenizer.eos_token_id} if t is not None)
    mode = "processed" if ro.top_p < 1 or ro.top_k > 0 else "scaled"
    return SamplingParams(temperature=temperature, top_p=ro.top_p, top_k=ro.top_k, max_tokens=ro.max_tokens,
                          stop_token_ids=stop, seed=0, logprob_mode=mode)  # fmt: skip


def episode_limits(cfg: Config) -> EpisodeLimits:
    """Per-episode budgets of the rollout settings."""
    return EpisodeLimits(cfg.rollout.max_turns, cfg.rollout.max_len, cfg.rollout.step_timeout_s)


def chat_options(cfg: Config) -> dict[str, Any]:
    """`ChatRunner`'s keyword arguments from the chat settings."""
    return {"api_key": cfg.chat.api_key} | {k: getattr(cfg.chat, k) for k in CHAT_SERVER_OPTIONS}


def chat_runner(cfg: Config, engine: Engine, tokenizer) -> ChatRunner:
    """The ChatAgent runner of a run (its chat server starts on first use)."""
    return ChatRunner(engine, tokenizer, **chat_options(cfg))


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one prompt with c correct of n samples: 1 - C(n-c, k) / C(n, k)."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples, got {n}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def named_reward_means(infos: list[dict[str, Any]], prefix: str = "") -> dict[str, float]:
    """`<prefix>reward/<name>`: the mean over all rollouts (one `info` each) of their `info["reward/<name>"]`, the
    reward function's named parts (and an agent's own `reward/` numbers). A rollout without a name counts 0 for it:
    one cut before its reward, a failed one (an empty info), one whose dict left the name out, as in its weighted
    total, so with weights 1 the named means add up to the mean reward."""
    sums: dict[str, float] = defaultdict(float)
    for info in infos:
        for key, value in info.items():
            if key.startswith("reward/"):
                sums[key] += value if isinstance(value, int | float) else 0.0
    return {f"{prefix}{k}": v / len(infos) for k, v in sums.items()}


def is_correct(traj: Trajectory | None) -> bool:
    """A sample is correct when its score is 1 or more, up to float rounding (weights 0.6, 0.3, 0.1 of parts that
    all scored 1 sum to 0.9999999999999999); a failed one (None) is not."""
    return traj is not None and traj.score >= 1.0 - 1e-9


def _sample_record(tokenizer, traj, error: BaseException | None) -> dict[str, Any]:
    """One sample of `molt eval`'s per-row results."""
    if traj is None:
        return {"text": None, "reward": 0.0, "score": 0.0, "correct": False, "error": describe_error(error)}
    named = {k[len("reward/") :]: v for k, v in traj.info.items() if k.startswith("reward/")}
    info = {k: v for k, v in traj.info.items() if not k.startswith("reward/")}  # the rest of the agent's Result.info
    record = {"text": last_completion_text(tokenizer, traj), "reward": traj.reward, "score": traj.score}
    truncated = traj.truncated or traj.finish_reason == "length"  # the episode, or its last completion, was cut
    record |= {"correct": is_correct(traj), "turns": traj.num_turns, "truncated": truncated}
    return record | ({"rewards": named} if named else {}) | ({"info": info} if info else {})


async def evaluate(
    tokenizer,
    rollout: Callable[..., Awaitable[list[Trajectory]]],
    *,
    rows: list[dict],
    sampling: SamplingParams,
    limits: EpisodeLimits,
    n: int,
    seed: int,
    ks: list[int] | None = None,
    results: list[dict] | None = None,
    failure_log: Path | None = None,
) -> dict[str, float]:
    """Run `n` episodes per row; a sample is correct when its score is >= 1 (exact answer). `rollout(row, sampling,
    limits, rollout_id=, group_id=)`: one rollout's segments (`local_rollout`, or agent workers); `ks`: the pass@k
    reported (default 1 and n); `results`, if given, receives one record per row; failed samples go to
    `failure_log`, if given."""
    if not rows:
        return {}

    async def one(i: int, row: dict, k: int):
        s = dataclasses.replace(sampling, seed=seed * 1_000_003 + i * n + k)  # as training rollouts'
        try:
            segments = await rollout(row, s, limits, rollout_id=i * n + k, group_id=i)
            return segments[-1], None  # segments share reward and score
        except RunFatalError:  # e.g. agent code blocking the event loop: the run cannot go on
            raise
        except Exception as e:  # noqa: BLE001 - an agent failure scores 0 in eval
            return None, e

    outcomes = await asyncio.gather(*(one(i, row, k) for i, row in enumerate(rows) for k in range(n)))
    trajs, kinds = [t for t, _ in outcomes], set()
    for j, (_, error) in enumerate(outcomes):  # one line per failed sample, the first of each kind with its traceback
        if failure_log is not None and error is not None:
            where = row_location(rows[j // n], f"row {j // n}")  # its file:line where it was read from one
            line = f"eval sample {j % n} of {where} failed: {describe_error(error)}"
            log_failure(failure_log, line, error, kinds)
    rewards = [t.reward if t is not None else 0.0 for t in trajs]
    correct = [[is_correct(t) for t in trajs[i * n : (i + 1) * n]] for i in range(len(rows))]
    metrics = {"eval/reward_mean": sum(rewards) / len(rewards), "eval/failures": sum(t is None for t in trajs)}
    for k in sorted(set(ks or {1, n})):
        metrics[f"eval/pass@{k}"] = sum(pass_at_k(n, sum(c), k) for c in correct) / len(rows)
    metrics |= named_reward_means([t.info if t is not None else {} for t in trajs], prefix="eval/")
    if results is not None:
        for i in range(len(rows)):
            samples = [_sample_record(tokenizer, *outcomes[i * n + k]) for k in range(n)]
            results.append({"index": i, "samples": samples, "num_correct": sum(correct[i])})
    return metrics
