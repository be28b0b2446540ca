"""Agents around a reward function: single-turn `RewardEnv`, and wrappers that score an agent's final answer.

`RewardEnv` turns any prompt dataset into single-turn RL without an Env class: the policy answers the row's prompt once
and the reward function scores the decoded answer. The episode runs through the ordinary `run_episode`, so capture is
the same token-exact path as any Env's, and an exception or a timeout in the reward function fails the rollout like an
Env's would.

With `--rollout.agent` as well, or on a built-in task's rows (whose Env then runs, e.g. the calculator's tool), the
reward function replaces the agent's own reward: `ScoredEnv` scores the action of
the turn that ends the episode (terminated, truncated, no observation, or the last of `max_turns`; earlier steps get 0,
the agent's own total is logged as `reward/agent`), and a `ScoredChatAgent` scores the text of the last completion of
the rollout. An episode cut by the context budget before its final turn scores 0."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from molt.agents.builtin import env_for_task
from molt.agents.chat.agent import ChatAgent, ChatContext, load_agent_class
from molt.agents.env import Env, Messages, Result
from molt.agents.reward_fn import RewardFunction
from molt.agents.runner import check_result


def _info(named: dict[str, float]) -> dict[str, float]:
    return {f"reward/{k}": v for k, v in named.items()}


async def _rescored(reward: RewardFunction, result: Result, answer: str, row: dict, agent_reward: float) -> Result:
    """`result` with the reward function's score of `answer`; the agent's own reward logged as `reward/agent`."""
    total, named = await reward.score(answer, row, agent_reward)
    info = result.info | _info(named) | {"reward/agent": agent_reward}
    return dataclasses.replace(result, reward=total, score=total, info=info)


class RewardEnv(Env):
    """One policy turn, scored by the reward function."""

    def __init__(self, reward: RewardFunction):
        self.reward = reward

    async def step(self, action: str) -> Result:
        total, named = await self.reward.score(action, self.row)
        return Result(reward=total, terminated=True, score=total, info=_info(named))


class ScoredEnv(Env):
    """A user Env whose final answer the reward function scores (see the module docstring)."""

    def __init__(self, inner: Env, reward: RewardFunction, max_turns: int):
        self.inner, self.reward, self.max_turns = inner, reward, max_turns
        self.turns, self.agent_reward = 0, 0.0

    async def reset(self, row: dict[str, Any]) -> Messages:
        self.row = row
        return await self.inner.reset(row)

    async def step(self, action: str) -> Result:
        result = check_result(await self.inner.step(action), f"{type(self.inner).__name__}.step")
        self.turns += 1
        self.agent_reward += result.reward
        if not (result.terminated or result.truncated or result.observation is None or self.turns >= self.max_turns):
            return dataclasses.replace(result, reward=0.0, score=None)
        return await _rescored(self.reward, result, action, self.row, self.agent_reward)


class ScoredChatAgent(ChatAgent):
    """A ChatAgent whose rollout the reward function scores on its last completion's text."""

    def __init__(self, inner: ChatAgent, reward: RewardFunction):
        self.inner, self.reward = inner, reward

    async def run(self, ctx: ChatContext) -> Result:
        return check_result(await self.inner.run(ctx), f"{type(self.inner).__name__}.run")

    async def rescore(self, result: Result, answer: str, row: dict[str, Any]) -> Result:
        """`result` with the reward function's score of `answer` (called by `ChatRunner` after the run)."""
        return await _rescored(self.reward, result, answer, row, result.reward)


def agent_factory(
    agent: str, reward: RewardFunction | None, task: str, max_turns: int, task_rows: bool = True
) -> Callable[[], Any]:
    """`make_env()` for a run: the agent class, else the built-in `task`'s Env, either scored by `reward` if given:
    a `RewardEnv` instead where the rows are the user's own (not `task_rows`)."""
    if agent:
        cls = load_agent_class(agent)  # an Env or a ChatAgent subclass
        if reward is None:
            return cls
        if issubclass(cls, ChatAgent):
            return lambda: ScoredChatAgent(cls(), reward)
        return lambda: ScoredEnv(cls(), reward, max_turns)
    if reward is not None:
        return (lambda: ScoredEnv(env_for_task(task), reward, max_turns)) if task_rows else lambda: RewardEnv(reward)
    env_for_task(task)  # an unknown task is an error now, not in the first rollout
    return lambda: env_for_task(task)
