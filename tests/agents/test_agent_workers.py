"""Agent workers (`rollout.agent_workers`): rollouts in spawned processes against the main process's engine give
what they give in process; failures, drops and a dying worker reach the loop as they would in process."""

import asyncio
import dataclasses

import pytest
from chat_support import SAMPLING, TOK, ScriptedEngine, in_process_and_in_a_worker
from conftest import small_model  # noqa: I001 - tests/conftest.py
from worker_agents import Scripted, broken_kit, kit, scored_kit, slow_kit

from molt.agents.chat import ChatRunner
from molt.agents.reward_env import ScoredChatAgent
from molt.agents.reward_fn import load_reward
from molt.agents.runner import EpisodeLimits
from molt.agents.watchdog import LoopBlockedError
from molt.agents.workers import AgentWorkers, WorkerDrop
from molt.cli.main import parse_config
from molt.config import ConfigError
from molt.errors import RemoteRolloutError, RunFatalError, describe_error
from molt.loop.evaluate import named_reward_means

LIMITS = EpisodeLimits(max_turns=2, max_len=512)


def _row(do: str) -> dict:
    return {"messages": [{"role": "user", "content": "12*345="}], "label": "4140", "do": do}


def _strip(segments) -> list[dict]:
    """Each segment's fields (ids, log-probs, versions, masks, reward, ids) and answer."""
    return [
        {k: v for k, v in dataclasses.asdict(s).items() if k != "info"} | {"text": s.info["text"]} for s in segments
    ]


def test_rollouts_in_workers_match_in_process_and_report_failures_drops_and_exits(capfd):
    async def main():
        engine = ScriptedEngine(["4140"])
        pool = await AgentWorkers(kit, engine, 2).start()
        try:
            ok = [await pool.run(_row(do), SAMPLING, LIMITS, rollout_id=i, group_id=1) for i, do in
                  enumerate(["answer", "stream"])]  # fmt: skip
            failed = await asyncio.gather(*(pool.run(_row(do), SAMPLING, LIMITS) for do in ("fail", "drop", "die",
                                          "interrupt")), return_exceptions=True)  # fmt: skip
            before = {w.process.pid for w in pool.workers}  # the dead one has left
            while len(pool.workers) < 2:  # until its replacement joins
                await asyncio.wait_for(pool.joined.wait(), 60)
            after = await asyncio.gather(*(pool.run(_row("answer"), SAMPLING, LIMITS) for _ in range(4)))
            pids = (before, {w.process.pid for w in pool.workers})
        finally:
            await pool.close()
        runner = ChatRunner(ScriptedEngine(["4140"]), TOK)
        try:
            local = [await runner.run(Scripted(), _row(do), SAMPLING, LIMITS, rollout_id=i, group_id=1) for i, do in
                     enumerate(["answer", "stream"])]  # fmt: skip
        finally:
            await runner.close()
        return ok, failed, after, pids, local, engine

    ok, (fail, drop, died, interrupted), after, pids, local, engine = asyncio.run(main())
    assert [_strip(s) for s in ok] == [_strip(s) for s in local]  # same ids, log-probs, versions, reward, masks
    assert ok[0][0].reward == 1.0 and ok[1][0].info["text"] == "4140"
    assert len(engine.prompts) == 2 + 4  # the engine of the main process served every request
    assert isinstance(fail, RemoteRolloutError)
    assert describe_error(fail).startswith("ValueError: tool backend down [") and "worker_agents.py" in str(fail)
    assert "Traceback" in fail.traceback_text and "raise ValueError" in fail.traceback_text
    assert isinstance(drop, WorkerDrop) and drop.drop_reason == "image_over_context"
    assert isinstance(died, RemoteRolloutError) and "exited (code -11) during this rollout, one of" in str(died)
    assert "Segmentation fault" in capfd.readouterr().err  # its Python stack, for the user to find the culprit
    assert isinstance(interrupted, RemoteRolloutError)  # its rollout failed; its worker lives on
    assert describe_error(interrupted).startswith("AgentExit: agent code raised KeyboardInterrupt, which is not an Exc")
    assert len(pids[0]) == 1 and len(pids[1]) == 2 and pids[0] < pids[1]  # the dead worker was replaced
    assert all(s[0].reward == 1.0 for s in after)


def test_named_rewards_and_info_come_back_from_a_worker_as_in_process():
    async def main():
        local_reward, runner = load_reward("exact"), ChatRunner(ScriptedEngine(["4140"]), TOK)
        pool = await AgentWorkers(scored_kit, ScriptedEngine(["4140"]), 1).start()
        try:
            rows = [_row("answer"), _row("unpicklable")]
            local = [await runner.run(ScoredChatAgent(Scripted(), local_reward), r, SAMPLING, LIMITS) for r in rows]
            remote = [await pool.run(r, SAMPLING, LIMITS) for r in rows]
        finally:
            await pool.close()
            await runner.close()
        return local, remote

    local, remote = asyncio.run(main())
    local_metrics, remote_metrics = (named_reward_means([s[0].info for s in r]) for r in (local, remote))
    assert local_metrics == remote_metrics and local_metrics["reward/exact"] == local_metrics["reward/agent"] == 1.0
    assert [s[0].reward for s in remote] == [s[0].reward for s in local] == [1.0, 1.0]
    assert callable(local[1][0].info["callback"]) and remote[1][0].info["callback"].startswith("<function")


def test_agent_code_blocking_a_workers_event_loop_stops_the_run():
    async def main():
        pool = await AgentWorkers(kit, ScriptedEngine(["4140"]), 1).start()
        try:
            return await pool.run(_row("block"), SAMPLING, dataclasses.replace(LIMITS, step_timeout_s=0.5))
        finally:
            await pool.close()

    with pytest.raises(LoopBlockedError, match=r"Scripted.run \(.*worker_agents.py:\d+\) has not returned for 1s"):
        asyncio.run(main())


def test_agent_workers_need_a_free_chat_port():
    with pytest.raises((ConfigError, SystemExit)):
        parse_config(["--rollout.agent_workers", "2", "--chat.port", "8123"])
    assert parse_config(["--rollout.agent_workers", "2"]).rollout.agent_workers == 2


def test_a_worker_that_cannot_start_stops_the_run_with_its_exit_code(capfd):
    async def main():
        await AgentWorkers(broken_kit, ScriptedEngine(), 1).start()

    with pytest.raises(RunFatalError, match="exited \\(code 1\\) before it was ready"):
        asyncio.run(main())
    assert "ImportError: no module named 'my_tools'" in capfd.readouterr().err  # the worker's own traceback


def test_a_moe_policys_routing_comes_back_from_a_worker():
    """The engine's MoE routing record of a worker's rollout reaches the segment as it does in process."""
    from molt.engine import SamplingParams, TorchEngine

    sampling = SamplingParams(temperature=1.0, max_tokens=6, seed=5)

    engine = TorchEngine(
        small_model(kind="moe", vocab_size=len(TOK)).eval(), tokenizer=TOK, num_slots=4, max_seq_len=256
    )
    (local,), (remote,) = in_process_and_in_a_worker(engine, TOK, Scripted(), kit, _row("answer"), sampling, LIMITS)
    assert remote.tokens == local.tokens  # the second run reuses the first's prompt KV: log-probs within fp32 noise
    assert remote.rollout_logprobs == pytest.approx(local.rollout_logprobs, abs=1e-5)
    assert remote.routing is not None and remote.routing.equal(local.routing)


def test_a_stream_a_worker_hangs_up_on_is_aborted_in_the_main_process_and_not_recorded():
    """The disconnect reaches the run's engine across the socket: the request stops early, nothing leaks, and the
    rollout's segment holds only the request that completed."""
    from molt.engine import SamplingParams, TorchEngine

    sampling = SamplingParams(temperature=1.0, max_tokens=200, seed=1)  # random weights: no early eos
    limits = EpisodeLimits(max_turns=2, max_len=320)

    async def main():
        engine = TorchEngine(small_model(vocab_size=len(TOK)).eval(), tokenizer=TOK, num_slots=4, max_seq_len=320)
        pool = await AgentWorkers(kit, engine, 1).start()
        try:
            segments = await pool.run(_row("hang_up"), sampling, limits)
            await asyncio.sleep(0.1)
            return segments, engine.num_pending(), dict(engine.stats)
        finally:
            await pool.close()
            await engine.close()

    (segment,), pending, stats = asyncio.run(main())
    assert pending == 0 and segment.num_turns == 1  # one recorded request: the stream left nothing behind
    abandoned = stats["decode_tokens"] - segment.num_action_tokens  # measured: 6 of its 200
    assert abandoned < 100, abandoned  # the abandoned stream stopped well before its 200 tokens


def test_a_run_stopped_while_its_workers_start_leaves_none_behind(monkeypatch):
    """Cancelled while a worker ran its setup (a Ctrl-C at start-up), the worker process outlived the run."""
    import subprocess

    started, popen = [], subprocess.Popen
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **kw: started.append(popen(*a, **kw)) or started[-1])

    async def main():
        task = asyncio.create_task(AgentWorkers(slow_kit, ScriptedEngine(["4140"]), 1).start())
        await asyncio.sleep(2)  # the worker is importing or in its setup
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert len(started) == 1 and started[0].poll() is not None  # killed and reaped, not left running
