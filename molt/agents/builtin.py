"""Built-in environments for the built-in tasks (`molt/data/tasks.py`), registered by name."""

from __future__ import annotations

import dataclasses
import re

from molt.agents.env import Env, Result
from molt.data.tasks import calculate, get_task
from molt.registry import Registry

ENVS: Registry[type[Env]] = Registry("env")


@ENVS.register("single_turn")
class SingleTurnEnv(Env):
    """One answer, graded by the built-in task."""

    def __init__(self, task: str):
        self.task = get_task(task)

    async def step(self, action: str) -> Result:
        score = self.task.grade(self.row, action)
        return Result(reward=score, terminated=True, score=score)


TOOL_CALL_RE = re.compile(r"\s*<tool_call>(.*?)</tool_call>\s*", re.S)


@ENVS.register("calculator")
class CalculatorEnv(SingleTurnEnv):
    """A turn that is exactly one `<tool_call>expr</tool_call>` runs the calculator; any other is graded, ending it.
    `info["tool_calls"]`: the calls so far (an episode's info keeps each key's last value)."""

    tool_calls = 0

    async def step(self, action: str) -> Result:
        if call := TOOL_CALL_RE.fullmatch(action):
            self.tool_calls += 1
            return Result(reward=0.0, observation=[{"role": "tool", "content": calculate(call[1])}], info=self._info())
        return dataclasses.replace(await super().step(action), info=self._info())

    def _info(self) -> dict[str, int]:
        return {"tool_calls": self.tool_calls}


def env_for_task(task: str) -> Env:
    """A fresh Env instance running built-in task `task`."""
    return ENVS[get_task(task).env](task)
