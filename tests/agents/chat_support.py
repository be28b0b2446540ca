"""Shared helpers of the chat tests: a scripted engine and a chat server running in a background thread."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field

from conftest import IdleEngine  # noqa: I001 - tests/conftest.py

from molt.agents.chat.server import ChatServer
from molt.engine.interface import Completion, SamplingParams
from molt.models.tokenizer import build_builtin_tokenizer

TOK = build_builtin_tokenizer()
SAMPLING = SamplingParams(temperature=1.0, max_tokens=64, stop_token_ids=(TOK.eos_token_id,), seed=0)
CALC_TOOL = {
    "type": "function",
    "function": {
        "name": "calculate",
        "description": "Evaluate a product of two integers.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}


@dataclass
class ScriptedEngine(IdleEngine):
    """Replies with fixed texts (+ eos) in turn; records every prompt and the ids it emitted."""

    replies: list[str] = field(default_factory=lambda: ["ok"])
    prompts: list[list[int]] = field(default_factory=list)
    emitted: list[list[int]] = field(default_factory=list)
    fail_next: int = 0
    version: int = 3

    async def generate_group(self, prompt_token_ids, sampling=None, *, request_id=None, session_id=None):
        if self.fail_next:
            self.fail_next -= 1
            raise RuntimeError("engine hiccup")
        sampling = sampling or SamplingParams()
        text = self.replies[len(self.emitted) % len(self.replies)]
        ids = (TOK.encode(text, add_special_tokens=False) + [TOK.eos_token_id])[: sampling.max_tokens]
        self.prompts.append(list(prompt_token_ids))
        self.emitted.append(ids)
        finish = "stop" if ids[-1] == TOK.eos_token_id else "length"
        n = len(ids)
        return [Completion("r", ids, [-0.25] * n, [self.version] * n, finish, len(prompt_token_ids))]


class ServerThread:
    """A ChatServer on its own event loop in a daemon thread, so tests can use the sync SDK clients."""

    def __init__(self, engine, tokenizer=TOK, **options):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = ChatServer(engine, tokenizer, **options)
        self.call(self.server.start())

    def call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=60)

    def open(self, sampling: SamplingParams = SAMPLING, max_len: int = 1024, **options):
        return self.server.open_session(sampling, max_len=max_len, **options)

    def session_url(self, session) -> str:
        return f"{self.server.url}/s/{session.id}"

    def stop(self) -> None:
        self.call(self.server.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


def masked_ids(traj) -> list[int]:
    return [t for t, m in zip(traj.tokens, traj.loss_mask, strict=True) if m]


def in_process_and_in_a_worker(engine, tokenizer, agent, kit, row: dict, sampling, limits) -> tuple[list, list]:
    """The segments of one rollout of `agent` in process, then of the same rollout in an agent worker built by
    `kit`, both on `engine` (closed afterwards)."""
    from molt.agents.chat import ChatRunner
    from molt.agents.workers import AgentWorkers

    async def main():
        runner, pool = ChatRunner(engine, tokenizer), await AgentWorkers(kit, engine, 1).start()
        try:
            local = await runner.run(agent, row, sampling, limits, rollout_id=0)
            return local, await pool.run(row, sampling, limits, rollout_id=0)
        finally:
            await pool.close()
            await runner.close()
            await engine.close()

    return asyncio.run(main())
