"""Built-in environments for the built-in tasks (`molt/data/tasks.py`), registered by name."""

from __future__ import annotations

import re

from molt.agents.env import Env, Result
from molt.data.tasks import calculate, get_task
from molt.registry import Registry

ENVS: Registry[type[Env]] = Registry("env")


class TaskEnv(Env):
    """An Env bound to a built-in task (for its grader)."""

    def __init__(self, task: str):
        self.task = get_task(task)


@ENVS.register("single_turn")
class SingleTurnEnv(TaskEnv):
    """One answer, graded by the task."""

    async def step(self, action: str) -> Result:
        score = self.task.grade(self.row, action)
        return Result(reward=score, terminated=True, score=score)


TOOL_CALL_RE = re.compile(r"\s*<tool_call>(.*?)</tool_call>\s*", re.S)


@ENVS.register("calculator")
class CalculatorEnv(TaskEnv):
    """A turn that is exactly one `<tool_call>expr</tool_call>` runs the calculator; any other ends it."""

    async def step(self, action: str) -> Result:
        call = TOOL_CALL_RE.fullmatch(action)
        if call:
            value = calculate(call[1])
            return Result(reward=0.0, observation=[{"role": "tool", "content": value}], info={"tool_calls": 1})
        score = self.task.grade(self.row, action)
        return Result(reward=score, terminated=True, score=score)


def env_for_task(task: str) -> Env:
    """A fresh Env instance running built-in task `task`."""
    return ENVS[get_task(task).env](task)
