"""The agent the agent-worker tests run in worker processes (imported there by module name): what it does is the
row's `do`."""

from __future__ import annotations

import ctypes

from openai import AsyncOpenAI, OpenAI

from molt.agents.chat import ChatAgent, Result
from molt.agents.reward_env import ScoredChatAgent
from molt.agents.reward_fn import load_reward
from molt.agents.workers import WorkerKit
from molt.errors import RolloutDrop
from molt.models.tokenizer import build_builtin_tokenizer


class ImageTooLarge(RolloutDrop):
    drop_reason = "image_over_context"


class Scripted(ChatAgent):
    """answer / stream: one OpenAI-SDK completion (streamed or not), reward 1 when it equals the label; hang_up: a
    stream closed after its first content chunk, then an answer; fail: raises; drop: a dropped rollout; die: the worker
    process crashes (a segfault); interrupt: raises KeyboardInterrupt; block: the sync SDK client, which blocks the
    worker's event loop (and so its server); unpicklable: an answer with a lambda in its info."""

    async def run(self, ctx) -> Result:
        do = ctx.row["do"]
        if do == "fail":
            raise ValueError("tool backend down")
        if do == "drop":
            raise ImageTooLarge("the image needs 600 tokens of a 512-token budget")
        if do == "die":  # a crash in a C extension
            ctypes.string_at(0)
        if do == "interrupt":  # the agent's own KeyboardInterrupt: the worker ignores SIGINT, so it is no Ctrl-C
            raise KeyboardInterrupt
        if do == "block":
            OpenAI(base_url=ctx.base_url, api_key=ctx.api_key).chat.completions.create(model=ctx.model, messages=[])
        client = AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
        if do == "hang_up":  # a stream dropped after its first content chunk, then a plain request
            stream = await client.chat.completions.create(model=ctx.model, messages=ctx.messages, stream=True)
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    break
            await stream.close()
            do = "answer"
        if do == "stream":
            chunks = await client.chat.completions.create(model=ctx.model, messages=ctx.messages, stream=True)
            text = "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])
        else:
            reply = await client.chat.completions.create(model=ctx.model, messages=ctx.messages)
            text = reply.choices[0].message.content
        await client.close()
        info = {"text": text, "reward/own": 0.5} | ({"callback": lambda: 1} if do == "unpicklable" else {})
        return Result(reward=float(text == ctx.label), info=info)


def kit() -> WorkerKit:
    return WorkerKit(build_builtin_tokenizer(), Scripted)


def scored_kit() -> WorkerKit:
    """Scripted, scored by the built-in `exact` reward function."""
    reward = load_reward("exact")
    return WorkerKit(build_builtin_tokenizer(), lambda: ScoredChatAgent(Scripted(), reward))


def broken_kit() -> WorkerKit:
    raise ImportError("no module named 'my_tools'")


def slow_kit() -> WorkerKit:
    """A setup that takes its time (loading a large tool index)."""
    import time

    time.sleep(60)
    return kit()
