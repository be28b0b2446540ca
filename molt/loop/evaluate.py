"""Held-out evaluation: mean reward, named rewards and unbiased pass@k over n samples per prompt.

Used by training's eval and by `molt eval` (`molt/loop/eval_cmd.py`), so both score a checkpoint the
same way: the same episodes, sampling seeds (`seed + row * n + k`) and rewards. Episodes run with the
reward functions' `EVALUATING` flag set, so training's per-step reward metrics leave them out.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from molt.agents.chat.agent import last_completion_text
from molt.agents.reward_fn import EVALUATING
from molt.agents.runner import EpisodeLimits, run_episode

EVAL_SEED = 12345  # base sampling seed of every evaluation (training's eval uses the same)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one prompt with c correct of n samples: 1 - C(n-c, k) / C(n, k)."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples, got {n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def _named_rewards(trajs: list) -> dict[str, float]:
    """`eval/reward/<name>` means over the episodes that report named rewards (`info["reward/<name>"]`)."""
    sums, counts = defaultdict(float), defaultdict(int)
    for traj in trajs:
        for key, value in traj.info.items() if traj is not None else ():
            if key.startswith("reward/") and isinstance(value, int | float):
                sums[key] += value
                counts[key] += 1
    return {f"eval/{k}": sums[k] / counts[k] for k in sums}


def _sample_record(tokenizer, traj, error: BaseException | None) -> dict[str, Any]:
    """One sample of `molt eval`'s per-row results."""
    if traj is None:
        failed = f"{type(error).__name__}: {error}"
        return {"text": None, "reward": 0.0, "score": 0.0, "correct": False, "error": failed}
    named = {k[len("reward/") :]: v for k, v in traj.info.items() if k.startswith("reward/")}
    record = {"text": last_completion_text(tokenizer, traj), "reward": traj.reward, "score": traj.score}
    return (
        record
        | {"correct": traj.score >= 1.0, "turns": traj.num_turns, "truncated": traj.truncated}
        | ({"rewards": named} if named else {})
    )


async def evaluate(
    engine,
    tokenizer,
    make_env: Callable,
    rows: list[dict],
    sampling,
    limits: EpisodeLimits,
    n: int,
    seed: int,
    episode: Callable = run_episode,
    ks: list[int] | None = None,
    results: list[dict] | None = None,
) -> dict[str, float]:
    """Run `n` episodes per row; a sample is correct when its score is >= 1 (exact answer).

    `episode` has `run_episode`'s signature (the loop passes one that also runs ChatAgents); `ks`
    are the pass@k reported (default 1 and n); `results`, if given, receives one record per row.
    """
    if not rows:
        return {}

    async def one(i: int, row: dict, k: int):
        s = dataclasses.replace(sampling, seed=seed + i * n + k)
        try:
            return await episode(engine, tokenizer, make_env(), row, s, limits, rollout_id=i * n + k, group_id=i), None
        except Exception as e:  # noqa: BLE001 - an agent failure scores 0 in eval
            return None, e

    token = EVALUATING.set(True)  # copied into the episode tasks gather creates
    try:
        outcomes = await asyncio.gather(*(one(i, row, k) for i, row in enumerate(rows) for k in range(n)))
    finally:
        EVALUATING.reset(token)
    trajs = [t for t, _ in outcomes]
    rewards = [t.reward if t is not None else 0.0 for t in trajs]
    correct = [[(t is not None and t.score >= 1.0) for t in trajs[i * n : (i + 1) * n]] for i in range(len(rows))]
    metrics = {"eval/reward_mean": sum(rewards) / len(rewards), "eval/failures": sum(t is None for t in trajs)}
    for k in sorted(set(ks or {1, n})):
        metrics[f"eval/pass@{k}"] = sum(pass_at_k(n, sum(c), k) for c in correct) / len(rows)
    metrics |= _named_rewards(trajs)
    if results is not None:
        for i in range(len(rows)):
            samples = [_sample_record(tokenizer, *outcomes[i * n + k]) for k in range(n)]
            results.append({"index": i, "samples": samples, "num_correct": sum(correct[i])})
    return metrics
