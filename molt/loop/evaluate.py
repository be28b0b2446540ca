"""Held-out evaluation: mean reward and unbiased pass@k over n samples per prompt."""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections.abc import Callable

from molt.agents.runner import EpisodeLimits, run_episode


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one prompt with c correct of n samples: 1 - C(n-c, k) / C(n, k)."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples, got {n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


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
) -> dict[str, float]:
    """Run `n` episodes per row; a sample is correct when its score is >= 1 (exact answer).

    `episode` has `run_episode`'s signature (the loop passes one that also runs ChatAgents).
    """

    async def one(i: int, row: dict, k: int):
        s = dataclasses.replace(sampling, seed=seed + i * n + k)
        try:
            return await episode(engine, tokenizer, make_env(), row, s, limits, rollout_id=i * n + k, group_id=i)
        except Exception:  # noqa: BLE001 - an agent failure scores 0 in eval
            return None

    trajs = await asyncio.gather(*(one(i, row, k) for i, row in enumerate(rows) for k in range(n)))
    rewards = [t.reward if t is not None else 0.0 for t in trajs]
    correct = [
        [(trajs[i * n + k] is not None and trajs[i * n + k].score >= 1.0) for k in range(n)] for i in range(len(rows))
    ]
    metrics = {"eval/reward_mean": sum(rewards) / len(rewards), "eval/failures": sum(t is None for t in trajs)}
    for k in sorted({1, n}):
        metrics[f"eval/pass@{k}"] = sum(pass_at_k(n, sum(c), k) for c in correct) / len(rows)
    return metrics
