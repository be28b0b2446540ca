"""Env episodes: exact token accumulation, masks, budgets and agent failures (scripted engine)."""

import asyncio
import contextlib
import copy
import inspect
import json
import logging
import math
import os
import sys
import time

import httpx
import numpy as np
import pytest
import torch
from chat_support import SAMPLING, TOK, ScriptedEngine  # noqa: I001

from molt.agents.builtin import env_for_task
from molt.agents.chat.agent import local_rollout
from molt.agents.env import Env, Result, load_agent
from molt.agents.runner import EpisodeLimits, TemplateRewriteError, observation_ids, run_episode
from molt.agents.watchdog import LoopBlockedError
from molt.data.tasks import get_task
from molt.errors import AgentExit, describe_error
from molt.models.tokenizer import apply_chat_template, build_builtin_tokenizer


def _run(engine, env, row, limits=None):
    limits = limits or EpisodeLimits()
    return asyncio.run(run_episode(engine, TOK, env, row, SAMPLING, limits, rollout_id=3, group_id=1))


def test_calculator_episode_is_token_exact():
    row = get_task("calculator").rows(1, seed=5)[0]
    engine = ScriptedEngine([f"<tool_call>{row['a']}*{row['b']}</tool_call>", row["label"]])
    traj = _run(engine, env_for_task("calculator"), row)
    assert traj.reward == 1.0 and traj.num_turns == 2 and not traj.truncated
    assert traj.info == {"tool_calls": 1}  # the count, kept by the graded turn too (a plain answer: 0)
    assert _run(ScriptedEngine([row["label"]]), env_for_task("calculator"), row).info == {"tool_calls": 0}
    # the masked-in tokens are exactly the engine's emitted ids, in order, and nothing else
    masked = [t for t, m in zip(traj.tokens, traj.loss_mask, strict=True) if m]
    assert masked == engine.emitted[0] + engine.emitted[1]
    # each generate call saw exactly the accumulated ids
    assert traj.tokens[: len(engine.prompts[1])] == engine.prompts[1]
    assert engine.prompts[1][: len(engine.prompts[0]) + len(engine.emitted[0])] == engine.prompts[0] + engine.emitted[0]
    # the whole sequence equals the template rendering of the conversation (independent check)
    conversation = row["messages"] + [
        {"role": "assistant", "content": f"<tool_call>{row['a']}*{row['b']}</tool_call>"},
        {"role": "tool", "content": row["label"]},
        {"role": "assistant", "content": row["label"]},
    ]
    assert traj.tokens == apply_chat_template(TOK, conversation)[: len(traj.tokens)]
    assert traj.versions == [engine.version if m else -1 for m in traj.loss_mask]
    assert traj.rollout_id == 3 and traj.group_id == 1


def test_a_template_rendering_the_last_assistant_turn_its_own_way_still_extends_an_episode():
    # Like Qwen3: the last assistant turn gets an empty <think> block, earlier ones do not
    head = "{{- '<|im_start|>assistant\\n' + "
    think = TOK.chat_template.replace(head, head + "('<think>\\n\\n</think>\\n\\n' if loop.last else '') + ")
    row = get_task("calculator").rows(1, seed=5)[0]
    engine = ScriptedEngine([f"<tool_call>{row['a']}*{row['b']}</tool_call>", row["label"]])
    original, TOK.chat_template = TOK.chat_template, think
    try:
        assert think != original
        traj = _run(engine, env_for_task("calculator"), row)
        with pytest.raises(TemplateRewriteError):  # a chat session's check: its next request starts a new segment
            observation_ids(TOK, row["messages"], [{"role": "tool", "content": "1"}], "")
    finally:
        TOK.chat_template = original
    assert traj.reward == 1.0 and traj.num_turns == 2
    assert [t for t, m in zip(traj.tokens, traj.loss_mask, strict=True) if m] == engine.emitted[0] + engine.emitted[1]
    assert TOK.decode(traj.tokens[len(engine.prompts[0]) + len(engine.emitted[0]) :]).startswith("\n<|im_start|>user")


def test_max_turns_truncates():
    row = get_task("calculator").rows(1, seed=6)[0]
    engine = ScriptedEngine(["<tool_call>1+1</tool_call>"] * 5)
    traj = _run(engine, env_for_task("calculator"), row, EpisodeLimits(max_turns=2))
    assert traj.num_turns == 2 and traj.truncated and traj.reward == 0.0


def test_an_episode_is_truncated_only_when_cut():
    row = get_task("arithmetic").rows(1, seed=6)[0]
    for result, limits, truncated in [
        (Result(reward=1.0), EpisodeLimits(), False),  # no observation: the Env ended it
        (Result(reward=1.0, truncated=True), EpisodeLimits(), True),
        (Result(reward=1.0, observation="more"), EpisodeLimits(max_turns=1), True),  # cut by max_turns
        (Result(reward=1.0, observation="more", terminated=True), EpisodeLimits(max_turns=1), False),
    ]:
        assert _run(ScriptedEngine(["1"]), Returns(result), row, limits).truncated is truncated, result


def test_context_budget_clips_max_tokens():
    row = get_task("arithmetic").rows(1, seed=7)[0]
    prompt_len = len(apply_chat_template(TOK, row["messages"], add_generation_prompt=True))
    engine = ScriptedEngine(["1234567890"])
    traj = _run(engine, env_for_task("arithmetic"), row, EpisodeLimits(max_len=prompt_len + 4))
    assert len(traj.tokens) == prompt_len + 4 and traj.finish_reason == "length"


def test_an_observation_leaving_no_room_to_act_ends_the_episode_within_the_budget():
    """The closing observation is not appended past rollout.max_len (nothing would act on it): the trajectory stays
    within the budget and ends on the policy's last action, truncated."""
    row = get_task("arithmetic").rows(1, seed=7)[0]
    prompt_len = len(apply_chat_template(TOK, row["messages"], add_generation_prompt=True))
    long = Returns(Result(reward=1.0, observation="x " * 40))
    traj = _run(ScriptedEngine(["12", "34"]), long, row, EpisodeLimits(max_len=prompt_len + 30))
    assert traj.truncated and traj.num_turns == 1 and len(traj.tokens) <= prompt_len + 30
    assert traj.loss_mask[-1] == 1  # the action is the last token


class NotAResult(Env):
    async def step(self, action):
        return 1.0


def test_agent_returning_non_result_is_a_clear_error():
    row = get_task("arithmetic").rows(1, seed=8)[0]
    with pytest.raises(TypeError, match="NotAResult.step returned float, expected molt.agents.Result"):
        _run(ScriptedEngine(["1"]), NotAResult(), row)


class Slow(Env):
    async def step(self, action):
        await asyncio.sleep(10)
        return Result(reward=1.0)


class Returns(Env):
    """Returns `result` from its first step; `first` from reset, if given."""

    def __init__(self, result=None, first=None):
        self.result, self.first = result, first

    async def reset(self, row):
        return self.first if self.first is not None else row["messages"]

    async def step(self, action):
        return self.result


def test_result_numbers_and_observations_are_checked_where_they_enter_the_trajectory():
    row = get_task("arithmetic").rows(1, seed=8)[0]
    for value in (True, np.float32(0.5), torch.tensor(2.0), 3):
        traj = _run(ScriptedEngine(["1"]), Returns(Result(reward=value, score=value, terminated=True)), row)
        assert type(traj.reward) is float and type(traj.score) is float and traj.reward == float(value)
    bad = [
        (Result(reward="high"), TypeError, r"Returns.step returned Result.reward='high' \(str\); expected a number"),
        (Result(reward=1.0, score="good"), TypeError, r"Result.score='good' \(str\); expected a number"),
        (Result(reward=math.nan), ValueError, r"Result.reward=nan \(float\); expected a finite number"),
        (Result(reward=-1e300), ValueError, r"Result.reward=-1e\+300; expected a magnitude below 3.4e\+38"),
        (Result(reward=10**400), ValueError, r"Result.reward=1000.*0 \(int\); expected a finite number"),  # no float
        (Result(reward=torch.ones(2)), TypeError, r"Result.reward=.*\(Tensor\); expected a number"),
        (
            Result(reward=1.0, observation=12345),
            TypeError,
            "Returns.step returned Result.observation of type int; expected str or a list of messages",
        ),  # fmt: skip
        (Result(reward=1.0, observation=["hi"]), TypeError, "Result.observation of type list holding str"),
        (
            Result(reward=1.0, observation=[{"role": "tool", "content": 12345}]),
            TypeError,
            r"Returns.step returned Result.observation\[0\].content int; expected a string or a list of parts",
        ),  # fmt: skip
        (Result(reward=1.0, observation=[{"role": "user"}]), TypeError, r"observation\[0\].content missing"),
        (Result(reward=1.0, observation=[{"content": "x"}]), TypeError, r"observation\[0\].role=None; expected one"),
        (Result(reward=1.0, info=None), TypeError, "Returns.step returned Result.info of type NoneType; expected a"),
        (Result(reward=1.0, info=[("a", 1)]), TypeError, "Result.info of type list"),
    ]
    for result, error, message in bad:
        with pytest.raises(error, match=message):
            _run(ScriptedEngine(["1"]), Returns(result), row)
    with pytest.raises(TypeError, match="Returns.reset returned a first observation of type int"):
        _run(ScriptedEngine(["1"]), Returns(first=7), row)


def test_a_reset_returning_text_is_one_user_message():
    engine = ScriptedEngine(["1"])
    with pytest.raises(ValueError, match="Returns.reset returned no messages"):  # was transformers' own error
        _run(ScriptedEngine(["1"]), Returns(Result(reward=1.0, terminated=True), first=[]), {"messages": []})
    traj = _run(engine, Returns(Result(reward=1.0, terminated=True), first="just a string"), {"messages": []})
    assert engine.prompts[0] == apply_chat_template(TOK, [{"role": "user", "content": "just a string"}],
                                                    add_generation_prompt=True)  # fmt: skip
    assert traj.reward == 1.0


class Sleepy(Env):
    """Blocks the event loop (as a sync SDK call does) in its step."""

    async def step(self, action):
        time.sleep(60)  # interrupted by the watchdog
        return Result(reward=1.0)


def test_agent_code_blocking_the_event_loop_stops_the_run_with_its_line():
    row = get_task("arithmetic").rows(1, seed=8)[0]

    async def main():
        rollout = local_rollout(None, ScriptedEngine(["1"]), TOK, lambda: Returns(Result(reward=1.0, terminated=True)))
        limits = EpisodeLimits(step_timeout_s=0.2)
        await rollout(row, SAMPLING, limits)  # starts the watchdog
        time.sleep(1.3)  # blocking outside agent code (e.g. a checkpoint save) is not the agent's
        await asyncio.sleep(0)
        return await local_rollout(None, ScriptedEngine(["1"]), TOK, Sleepy)(row, SAMPLING, limits)

    with pytest.raises(LoopBlockedError, match=r"Sleepy.step \(.*test_runner.py:\d+\) has not returned for 1s"):
        asyncio.run(main())


class Dozy(Env):
    async def step(self, action):
        time.sleep(4)  # over the second run's 1 s, under the first run's 30 s
        return Result(reward=1.0)


def test_each_run_on_a_notebooks_loop_gets_its_own_watchdog_limit_and_a_fresh_start():
    """The first run on a loop fixed its watchdog's limit for every later run there (a notebook's), and a run
    stopped by blocking agent code stopped every later one at once."""
    row = get_task("arithmetic").rows(1, seed=8)[0]

    async def main():
        returns = lambda: Returns(Result(reward=1.0, terminated=True))  # noqa: E731
        await local_rollout(None, ScriptedEngine(["1"]), TOK, returns)(row, SAMPLING, EpisodeLimits(step_timeout_s=30))
        with pytest.raises(LoopBlockedError, match=r"Dozy.step \(.*\) has not returned for 1s"):
            await local_rollout(None, ScriptedEngine(["1"]), TOK, Dozy)(row, SAMPLING, EpisodeLimits(step_timeout_s=1))
        return await local_rollout(None, ScriptedEngine(["1"]), TOK, returns)(row, SAMPLING, EpisodeLimits())

    assert asyncio.run(main())[0].reward == 1.0


class SleepyInit(Env):
    """Blocks the event loop in its constructor (a sync connection to a sandbox): the run hung with no message."""

    def __init__(self):
        time.sleep(60)  # interrupted by the watchdog


def test_an_agent_constructor_blocking_the_event_loop_stops_the_run_with_its_line():
    row = get_task("arithmetic").rows(1, seed=8)[0]

    async def main():
        rollout = local_rollout(None, ScriptedEngine(["1"]), TOK, SleepyInit)
        return await rollout(row, SAMPLING, EpisodeLimits(step_timeout_s=0.2))

    with pytest.raises(LoopBlockedError, match=r"SleepyInit.__init__ \(.*test_runner.py:\d+\) has not returned"):
        asyncio.run(main())


def test_a_failure_raised_inside_a_library_names_the_agents_line():
    line = inspect.currentframe().f_lineno + 1
    for call in (lambda: json.loads("{"), lambda: httpx.URL(1)):  # the stdlib's frames, an installed package's
        with pytest.raises(Exception) as error:
            call()
        assert describe_error(error.value).endswith(f"test_runner.py:{line}]")


def test_agent_timeout():
    row = get_task("arithmetic").rows(1, seed=9)[0]
    with pytest.raises(asyncio.TimeoutError):
        _run(ScriptedEngine(["1"]), Slow(), row, EpisodeLimits(step_timeout_s=0.05))


def test_load_agent_from_file_and_errors(tmp_path):
    path = tmp_path / "my_agent.py"
    path.write_text(
        "from molt.agents.env import Env, Result\n\nclass Echo(Env):\n"
        "    async def step(self, action):\n        return Result(reward=float(action == 'hi'))\n"
    )
    assert load_agent(str(path)).__name__ == "Echo"
    assert load_agent(f"{path}:Echo").__name__ == "Echo"
    with pytest.raises(FileNotFoundError, match="agent file .*missing.py.* does not exist"):
        load_agent(str(tmp_path / "missing.py"))
    with pytest.raises(ModuleNotFoundError, match="cannot import agent module"):
        load_agent("no_such_pkg.agents")


def test_an_agent_file_imports_the_modules_beside_it_and_a_dotted_name_is_found_in_the_current_folder(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", os.getcwd())])  # restored afterwards
    (tmp_path / "agents_xyz").mkdir()
    (tmp_path / "agents_xyz" / "__init__.py").write_text("")
    (tmp_path / "agents_xyz" / "tools_xyz.py").write_text("SCORE = 1.0\n")
    (tmp_path / "agents_xyz" / "agent.py").write_text(
        "from tools_xyz import SCORE\nfrom molt.agents import Env, Result\n\nclass Uses(Env):\n"
        "    async def step(self, action):\n        return Result(reward=SCORE)\n"
    )
    assert load_agent(str(tmp_path / "agents_xyz" / "agent.py")).__name__ == "Uses"  # as `python agent.py` runs
    sys.path.remove(str(tmp_path / "agents_xyz"))
    (tmp_path / "agents_xyz" / "dotted.py").write_text("from molt.agents import Env\n\nclass Dotted(Env):\n    pass\n")
    monkeypatch.chdir(tmp_path)
    assert load_agent("agents_xyz.dotted").__name__ == "Dotted"  # as `python -m` finds it


def test_first_prompt_is_rendered_once_per_tokenizer_and_handed_out_as_a_copy():
    from molt.agents.runner import _FIRST_PROMPTS, first_prompt_ids

    tok = build_builtin_tokenizer()
    messages = [{"role": "user", "content": "what is 347*29?"}]
    expected = apply_chat_template(tok, messages, add_generation_prompt=True)
    first = first_prompt_ids(tok, messages)
    first.append(-1)  # the caller's list is its own
    assert first_prompt_ids(tok, messages) == expected and len(_FIRST_PROMPTS[tok]) == 1
    other = [{"role": "user", "content": "what is 12*3?"}]
    assert first_prompt_ids(tok, other) == apply_chat_template(tok, other, add_generation_prompt=True)
    assert first_prompt_ids(build_builtin_tokenizer(), messages) == expected  # another tokenizer, its own cache


class Raises(Env):
    """Its step raises `error`, which would end more than the rollout if it got out."""

    def __init__(self, error):
        self.error = error

    async def step(self, action):
        raise self.error


class Custom(BaseException):
    pass


class Waits(Env):
    async def step(self, action):
        await asyncio.sleep(30)
        return Result(reward=1.0)


def test_agent_code_raising_cancelled_error_or_sys_exit_fails_only_its_rollout():
    row = get_task("arithmetic").rows(1, seed=0)[0]
    limits = EpisodeLimits(step_timeout_s=5)
    cases = [(asyncio.CancelledError(), "raised asyncio.CancelledError, but its rollout was not cancelled"),
             (SystemExit(3), r"called sys.exit\(3\)"),
             (Custom("x"), "raised Custom: x, which is not an Exception")]  # fmt: skip
    for error, message in cases:
        rollout = local_rollout(None, ScriptedEngine(["1"]), TOK, lambda e=error: Raises(e))
        with pytest.raises(AgentExit, match=message) as failed:
            asyncio.run(rollout(row, SAMPLING, limits))
        assert describe_error(failed.value).endswith(f"test_runner.py:{Raises.step.__code__.co_firstlineno + 1}]")

    def exits():  # the agent's own __init__ (it ended molt train's process with no output)
        sys.exit(4)

    with pytest.raises(AgentExit, match=r"called sys.exit\(4\)"):
        asyncio.run(local_rollout(None, ScriptedEngine(["1"]), TOK, exits)(row, SAMPLING, limits))
    with pytest.raises(KeyboardInterrupt):  # an interrupt (Ctrl-C; SIGTERM where SIGINT is ignored) stops the run
        asyncio.run(
            local_rollout(None, ScriptedEngine(["1"]), TOK, lambda: Raises(KeyboardInterrupt()))(row, SAMPLING, limits)
        )

    async def cancelled():  # a rollout that is itself cancelled still ends as cancelled
        task = asyncio.create_task(local_rollout(None, ScriptedEngine(["1"]), TOK, Waits)(row, SAMPLING, limits))
        await asyncio.sleep(0.05)
        task.cancel()
        await task

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(cancelled())


def test_agent_code_that_catches_its_timeouts_cancellation_is_named_not_trusted(monkeypatch, caplog):
    """A bare `except:` swallows the step timeout's CancelledError: its late result is refused (it was returned as
    if on time), and one that keeps running past the limit gets a warning saying why Molt cannot stop it."""
    from molt.agents import watchdog

    async def swallows(seconds: float) -> str:
        end = asyncio.get_running_loop().time() + seconds
        while asyncio.get_running_loop().time() < end:
            with contextlib.suppress(BaseException):  # a bare `except:` in agent code: what the test is about
                await asyncio.sleep(0.01)
        return "late"

    monkeypatch.setattr(watchdog, "IGNORED_S", 0.05)
    late = r"A.step did not finish within 0.05s .* and caught its cancellation"
    with caplog.at_level(logging.WARNING, "molt.agents"), pytest.raises(TimeoutError, match=late):
        asyncio.run(watchdog.within(0.05, swallows(0.3), "A.step"))
    assert "A.step did not finish within 0.05s (rollout.step_timeout_s) and ignored its cancellation" in caplog.text
    assert asyncio.run(watchdog.within(1.0, swallows(0.01), "A.step")) == "late"  # on time: its result


def test_a_failure_line_survives_a_broken_or_huge_exception_message():
    class BadStr(Exception):
        def __str__(self):
            raise RuntimeError("no")

    assert describe_error(BadStr()) == "BadStr: <its __str__ raised RuntimeError>"
    line = describe_error(ValueError("x" * 10_000_000))
    assert line == "ValueError: " + "x" * 2000 + "... (10000000 characters)"


def test_an_end_of_turn_other_than_the_tokenizers_eos_is_not_appended_twice():
    """Llama 3 ends a turn with `<|eot_id|>` though its tokenizer's eos is `<|end_of_text|>`: the engine stops on
    the generation config's eos ids, and the closing markup after the action must not repeat the token it ended
    with (here the engine ends with `<|im_end|>`, the episode's tokenizer's eos is `<|endoftext|>`)."""
    row = get_task("calculator").rows(1, seed=5)[0]
    engine = ScriptedEngine([f"<tool_call>{row['a']}*{row['b']}</tool_call>", row["label"]])
    tokenizer = copy.deepcopy(TOK)
    tokenizer.eos_token = "<|endoftext|>"
    traj = asyncio.run(run_episode(engine, tokenizer, env_for_task("calculator"), row, SAMPLING, EpisodeLimits()))
    conversation = row["messages"] + [
        {"role": "assistant", "content": f"<tool_call>{row['a']}*{row['b']}</tool_call>"},
        {"role": "tool", "content": row["label"]},
    ]
    assert engine.emitted[0][-1] == TOK.convert_tokens_to_ids("<|im_end|>") != tokenizer.eos_token_id
    assert engine.prompts[1] == apply_chat_template(TOK, conversation, add_generation_prompt=True)
    assert "<|im_end|><|im_end|>" not in TOK.decode(traj.tokens)
