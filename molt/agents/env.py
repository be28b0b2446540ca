"""The agent contract: `Env` (the framework owns the LLM loop) and the `Result` every agent returns.

An `Env` is reset with a dataset row and stepped with the decoded text of each action; its
`Result.observation` (text or chat messages) is appended to the context with loss mask 0. Agent
classes are loaded from a file path or a dotted name. Nothing here knows engines or trainers."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from molt.user_code import import_user_module

Messages = list[dict[str, Any]]


@dataclass
class Result:
    """What one agent step (or a whole ChatAgent run) returns."""

    reward: float
    observation: str | Messages | None = None
    terminated: bool = False
    truncated: bool = False
    info: dict[str, Any] = field(default_factory=dict)
    score: float | None = None
    images: list[Any] | None = None


def prompt_messages(messages: Messages) -> Messages:
    """A conversation's RL prompt: its messages up to (not including) its trailing assistant turns."""
    end = len(messages)
    while end and messages[end - 1].get("role") == "assistant":
        end -= 1
    return list(messages[:end])


class Env:
    """Base class of step environments. Override `step`; `reset` is optional.

    `reset(row)` returns the first observation as chat messages, or text (one user message) (default: the row's
    `messages` up to their trailing assistant turns, which are a demonstration for SFT, not part of the RL prompt).
    `step(action)` gets the decoded text of the policy's turn and returns a `Result`; the episode ends when it is
    `terminated` or `truncated` or has no observation (or the framework's turn/context budget runs out: truncated)."""

    async def reset(self, row: dict[str, Any]) -> Messages:
        self.row = row
        return prompt_messages(row["messages"])

    async def step(self, action: str) -> Result:
        raise NotImplementedError


def load_agent(spec: str, bases: tuple[type, ...] = (Env,)) -> type:
    """Agent class from `file.py`, `file.py:Name`, `pkg.module` or `pkg.module:Name`.

    Without `:Name` the module must define exactly one subclass of `bases` (or a class named `Agent`)."""
    target, colon, name = spec.partition(":")
    if target.endswith(".py") and not Path(target).exists():
        raise FileNotFoundError(f"--rollout.agent: agent file {target!r} does not exist")
    try:
        module = import_user_module(target)
    except ModuleNotFoundError as e:
        if target.endswith(".py"):  # the file imports a missing module: its own error
            raise
        raise ModuleNotFoundError(f"--rollout.agent: cannot import agent module {spec!r}: {e}") from None
    if colon:
        if not hasattr(module, name):
            raise AttributeError(f"--rollout.agent: {spec!r} has no attribute {name!r}")
        return getattr(module, name)
    if hasattr(module, "Agent"):
        return module.Agent
    own = [
        c
        for _, c in inspect.getmembers(module, inspect.isclass)
        if issubclass(c, bases) and c not in bases and c.__module__ == module.__name__
    ]
    if len(own) != 1:
        kinds = "/".join(b.__name__ for b in bases)
        raise ValueError(f"--rollout.agent: {spec!r} defines {len(own)} {kinds} classes; name one with {spec}:Name")
    return own[0]
