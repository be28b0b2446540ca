"""Agents: the Env/Result contract, episode runners, built-in environments.

`from molt.agents import Env, Result` is all a step environment needs; `ChatAgent` and `ChatContext`
(the SDK-driven agents) import the chat server on first use, so importing `Env` stays cheap."""

from __future__ import annotations

from typing import Any

from molt.agents.env import Env, Messages, Result

__all__ = ["ChatAgent", "ChatContext", "Env", "Messages", "Result"]


def __getattr__(name: str) -> Any:
    """`ChatAgent` / `ChatContext` on first access (they pull in the HTTP server)."""
    if name in ("ChatAgent", "ChatContext"):
        from molt.agents.chat import agent

        return getattr(agent, name)
    raise AttributeError(f"module 'molt.agents' has no attribute {name!r}")
