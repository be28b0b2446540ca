"""The built-in calculator task behind a remote tool: each tool call waits `MOLT_TOOL_LATENCY_S` seconds.

Stands for a tool served over the network or run in a sandbox, whose round trip is wall time the
policy's hardware does not spend. Used by `benchmarks/async_vs_sync.py --tool-latency`.
"""

from __future__ import annotations

import asyncio
import os

from molt.agents.builtin import CalculatorEnv
from molt.agents.env import Result


class RemoteCalculator(CalculatorEnv):
    def __init__(self) -> None:
        super().__init__("calculator")

    async def step(self, action: str) -> Result:
        result = await super().step(action)
        if result.observation is not None:  # a tool call: the round trip to the tool service
            await asyncio.sleep(float(os.environ.get("MOLT_TOOL_LATENCY_S", "0.25")))
        return result
