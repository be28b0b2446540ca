"""ChatRunner: a ChatAgent's rollout on the loop's own event loop -> segments; the real engine; `molt serve`."""

import asyncio
from pathlib import Path

import httpx
import pytest
import torch
from anthropic import AsyncAnthropic
from chat_support import SAMPLING, TOK, ScriptedEngine, masked_ids
from openai import AsyncOpenAI, NotFoundError

from molt.agents.chat import ChatAgent, ChatRunner, ChatServer, Result, load_agent_class
from molt.agents.chat.loopback import _scope
from molt.agents.runner import ContextBudgetDrop, EpisodeLimits
from molt.engine import SamplingParams, TorchEngine
from molt.models import Transformer, preset

ROW = {"messages": [{"role": "user", "content": "12*345="}], "label": "4140"}
EXAMPLES = Path(__file__).parents[2] / "examples"


class CompactingAgent(ChatAgent):
    """Two turns, then rewrites its history into a summary (context compaction) for a third."""

    async def run(self, ctx):
        self.ctx = ctx
        async with AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0) as client:
            messages = list(ctx.messages)
            for _ in range(2):
                reply = await client.chat.completions.create(model=ctx.model, messages=messages)
                messages += [{"role": "assistant", "content": reply.choices[0].message.content}]
                messages += [{"role": "user", "content": "and?"}]
            summary = [{"role": "user", "content": "Summary of earlier work: two answers. Finish."}]
            final = await client.chat.completions.create(model=ctx.model, messages=summary)
        return Result(reward=0.75, info={"answer": final.choices[0].message.content})


LIMITS = EpisodeLimits(max_turns=4, max_len=512)


def _run(runner, agent, limits=LIMITS, after=None, row=ROW):
    async def main():
        try:
            segments = await runner.run(agent, row, SAMPLING, limits, rollout_id=9, group_id=2)
            if after is not None:
                await after()
            return segments
        finally:
            await runner.close()

    return asyncio.run(main())


def test_compaction_yields_two_segments_with_one_shared_reward():
    engine = ScriptedEngine(["one", "two", "three"])
    agent = CompactingAgent()

    async def late_request():  # the rollout is over: its session is gone
        async with AsyncOpenAI(base_url=agent.ctx.base_url, api_key=agent.ctx.api_key, max_retries=0) as client:
            with pytest.raises(NotFoundError):
                await client.chat.completions.create(model="molt", messages=ROW["messages"])

    segments = _run(ChatRunner(engine, TOK), agent, after=late_request)
    assert [s.segment for s in segments] == [0, 1] and {s.num_segments for s in segments} == {2}
    assert {(s.reward, s.score, s.rollout_id, s.group_id) for s in segments} == {(0.75, 0.75, 9, 2)}
    assert masked_ids(segments[0]) == engine.emitted[0] + engine.emitted[1]
    assert masked_ids(segments[1]) == engine.emitted[2]
    assert len(engine.emitted) == 3


class Silent(ChatAgent):
    async def run(self, ctx):
        return Result(reward=1.0)


class NotAResult(ChatAgent):
    async def run(self, ctx):
        async with AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key) as client:
            await client.chat.completions.create(model=ctx.model, messages=ctx.messages)
        return 1.0


class Graded(ChatAgent):
    """One request, then `self.result`."""

    def __init__(self, result=None):
        self.result = result

    async def run(self, ctx):
        await ctx.openai().chat.completions.create(model=ctx.model, messages=ctx.messages)
        return self.result


class LabelIs(ChatAgent):
    async def run(self, ctx):
        await ctx.openai().chat.completions.create(model=ctx.model, messages=ctx.messages)
        return Result(reward=float(ctx.label == "4140"))


def test_agent_failures_are_clear_errors():
    with pytest.raises(RuntimeError, match="made no completion request"):
        _run(ChatRunner(ScriptedEngine(), TOK), Silent())
    with pytest.raises(TypeError, match="NotAResult.run returned float"):
        _run(ChatRunner(ScriptedEngine(), TOK), NotAResult())
    with pytest.raises(TypeError, match=r"Graded.run returned Result.score='good' \(str\); expected a number"):
        _run(ChatRunner(ScriptedEngine(), TOK), Graded(Result(reward=1.0, score="good")))
    with pytest.raises(TypeError, match=r"Graded.run returned Result.reward='high' \(str\); expected a number"):
        _run(ChatRunner(ScriptedEngine(), TOK), Graded(Result(reward="high")))
    segments = _run(ChatRunner(ScriptedEngine(), TOK), Graded(Result(reward=torch.tensor(1), score=True)))
    assert (type(segments[0].reward), segments[0].reward, segments[0].score) == (float, 1.0, 1.0)
    labelled = _run(ChatRunner(ScriptedEngine(), TOK), LabelIs(), row={"messages": ROW["messages"], "answer": "4140"})
    assert labelled[0].reward == 1.0  # ctx.label: the row's answer (the README's {"prompt", "answer"} rows)
    with pytest.raises(ContextBudgetDrop, match="no request fit the context budget") as over:  # a prompt over max_len
        _run(ChatRunner(ScriptedEngine(), TOK), Graded(Result(reward=1.0)), EpisodeLimits(max_turns=4, max_len=8))
    assert over.value.drop_reason == "prompt_over_context"  # dropped and counted, as with the built-in Env


class SlowEngine(ScriptedEngine):
    async def generate_group(self, *args, **kwargs):
        await asyncio.sleep(1.0)  # the engine busy with a trainer step and other rollouts
        return await super().generate_group(*args, **kwargs)


class Dawdling(CompactingAgent):
    async def run(self, ctx):
        await asyncio.sleep(2.5)  # its own time
        return await super().run(ctx)


def test_the_agents_time_budget_leaves_out_its_model_calls():
    """A ChatAgent's budget (step_timeout_s x max_turns = 2 s here) counts its own time, not the 3 s its three model
    calls wait for a busy engine; its own 2.5 s exceed it."""
    limits = EpisodeLimits(max_turns=4, max_len=512, step_timeout_s=0.5)
    segments = _run(ChatRunner(SlowEngine(["one", "two", "three"]), TOK), CompactingAgent(), limits)
    assert len(segments) == 2
    with pytest.raises(TimeoutError, match=r"Dawdling.run did not finish within 2s \(rollout.step_timeout_s x max"):
        _run(ChatRunner(SlowEngine(["one", "two", "three"]), TOK), Dawdling(), limits)


class AnthropicAgent(ChatAgent):
    async def run(self, ctx):
        async with AsyncAnthropic(base_url=ctx.session_url, api_key=ctx.api_key, max_retries=0) as client:
            reply = await client.messages.create(model=ctx.model, max_tokens=12, messages=ctx.messages)
        return Result(reward=float(reply.usage.output_tokens))


def _tiny_engine():
    arch = preset("tiny", vocab_size=len(TOK), eos_token_id=TOK.eos_token_id, pad_token_id=TOK.pad_token_id)
    model = Transformer(arch).init_weights(0.02, torch.Generator().manual_seed(0)).eval()
    return TorchEngine(model, tokenizer=TOK, num_slots=4, max_seq_len=256, version=5)


def test_real_engine_ids_logprobs_and_versions_are_recorded():
    engine = _tiny_engine()
    (segment,) = _run(ChatRunner(engine, TOK), AnthropicAgent(), EpisodeLimits(max_turns=1, max_len=256))
    num_generated = int(segment.reward)
    assert 1 <= num_generated <= 12 and segment.num_action_tokens == num_generated
    assert all(v == 5 for v, m in zip(segment.versions, segment.loss_mask, strict=True) if m)
    assert all(lp < 0 for lp, m in zip(segment.rollout_logprobs, segment.loss_mask, strict=True) if m)
    asyncio.run(engine.close())


def test_serve_mode_answers_without_sessions():
    async def main():
        engine = _tiny_engine()
        sampling = SamplingParams(max_tokens=8, stop_token_ids=(TOK.eos_token_id,))
        server = await ChatServer(engine, TOK, serve_sampling=sampling, serve_max_len=256).start()
        try:
            async with httpx.AsyncClient(base_url=server.url) as http:
                body = {"model": "molt", "messages": [{"role": "user", "content": "hi"}], "temperature": 0}
                first = (await http.post("/v1/chat/completions", json=body)).json()
                second = (await http.post("/v1/chat/completions", json=body)).json()
                anthropic_reply = await http.post("/v1/messages", json=body | {"max_tokens": 4})
                missing = await http.post("/s/none/v1/chat/completions", json=body)
        finally:
            await server.stop()
            await engine.close()
        assert first["choices"][0]["message"] == second["choices"][0]["message"]  # greedy, honoured in serve mode
        assert first["usage"]["completion_tokens"] <= 8 and anthropic_reply.status_code == 200
        assert missing.status_code == 404 and len(server.sessions) == 0

    asyncio.run(main())


def test_examples_load_as_chat_agents():
    for name in ("openai_agent.py", "anthropic_agent.py", "tool_agent.py"):
        assert issubclass(load_agent_class(str(EXAMPLES / name)), ChatAgent)


def test_in_process_requests_are_asgi_scopes_with_the_path_decoded_once():
    scope = _scope(httpx.Request("POST", "http://127.0.0.1:9/s/a%2520b/v1/messages?beta=true"))
    assert scope["path"] == "/s/a%20b/v1/messages" and scope["raw_path"] == b"/s/a%2520b/v1/messages"
    assert scope["query_string"] == b"beta=true"
