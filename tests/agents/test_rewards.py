"""Reward functions: the built-in math extraction (hand cases), loading errors, sync/async/dict/weights,
and a reward-function episode through the ordinary token-exact runner (scripted engine)."""

import asyncio
import logging

import pytest
from chat_support import SAMPLING, TOK, ScriptedEngine  # noqa: I001

from molt.agents.reward_env import RewardEnv, ScoredEnv
from molt.agents.reward_fn import load_reward
from molt.agents.rewards import extract_answer, math_reward, reference_answer
from molt.agents.runner import EpisodeLimits, run_episode
from molt.data.tasks import get_task


@pytest.mark.parametrize(
    "completion, answer, expected",
    [
        ("The answer is \\boxed{42}.", "42", 1.0),
        ("so \\boxed{\\frac{3}{4}}", "0.75", 1.0),  # nested braces, fraction vs decimal
        ("\\boxed{1} then \\boxed{7}", "7", 1.0),  # the last box
        ("\\boxed{12} but really 13", "12", 1.0),  # a box wins over a later number
        ("It costs $1,234.50 in total", "1234.5", 1.0),  # last number, thousands comma, dollar sign
        ("first 3 then 5", "3", 0.0),  # last number only
        ("-7 degrees", "-7", 1.0),
        ("half: 1/2", "0.5", 1.0),
        ("no digits here", "4", 0.0),
        ("\\boxed{x+1}", "x + 1", 0.0),  # text answers compare as normalised text (spaces kept)
        ("\\boxed{Paris}", "paris", 1.0),
        ("So 18.", "Janet sells 16 - 3 - 4 = 9 eggs, 9 * 2 = 18 dollars.\n#### 18", 1.0),  # GSM8K reference
        ("answer: \\boxed{50\\%}", "50", 1.0),  # a percent matches the bare number
        ("\\boxed{2, 3}", "23", 0.0),  # a comma outside thousands groups is no number
        ("pages 10-12", "12", 1.0),  # a hyphen after a digit is no minus sign
        ("\\boxed{1 1/2}", "5.5", 0.0),  # nor a space outside a fraction
        ("\\boxed{\\$18.90}", "18.90", 1.0),  # a LaTeX dollar sign
    ],
)
def test_math_reward_hand_cases(completion, answer, expected):
    assert math_reward(completion, {"answer": answer}) == expected


def test_extraction_helpers():
    assert extract_answer("a \\boxed{\\text{A}} b") == "\\text{A}"
    assert extract_answer("1, 2 and 3,000") == "3,000"
    assert extract_answer("\\boxed{unclosed 5") == "5"
    assert reference_answer({"label": "\\boxed{9}"}) == "9"
    assert reference_answer({"answer": None, "label": "9"}) == "9"  # a null answer column: the label
    for completion in ("1", "no number"):  # a row without an answer fails, whatever the completion
        with pytest.raises(KeyError, match="no 'answer'"):
            math_reward(completion, {"prompt": "x"})


REWARD_FILE = """
import asyncio

def plain(completion, row):
    return float(completion.strip() == row["answer"])

async def later(completion, row):
    await asyncio.sleep(0)
    return 0.5

def parts(completion, row):
    return {"exact": float(completion.strip() == row["answer"]), "short": float(len(completion) < 3)}

def broken(completion, row):
    raise RuntimeError("reward bug")

def reward(completion, row):
    return True
"""


def _score(spec, completion="7", weights=""):
    reward = load_reward(spec, weights)
    try:
        return asyncio.run(reward.score(completion, {"answer": "7"}))
    finally:
        reward.close()


def test_reward_function_kinds_and_weights(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(REWARD_FILE)
    assert _score(f"{path}:plain") == (1.0, {"plain": 1.0})
    assert _score(f"{path}:later") == (0.5, {"later": 0.5})
    assert _score(str(path)) == (1.0, {"reward": 1.0})  # `file.py` alone: its `reward`; True scores 1
    assert _score(f"{path}:parts", weights="short=0.25") == (1.25, {"exact": 1.0, "short": 1.0})
    total, named = _score(f"math,format,{path}:later", "\\boxed{7}", "format=0.1")
    assert total == pytest.approx(1.6) and named == {"math": 1.0, "format": 1.0, "later": 0.5}
    with pytest.raises(RuntimeError, match="reward bug"):
        _score(f"{path}:broken")
    (tmp_path / "helper_xyz.py").write_text("ACC = 1.0\n")  # a module beside the reward file: importable
    (tmp_path / "beside.py").write_text("from helper_xyz import ACC\n\ndef reward(c, row):\n    return ACC\n")
    assert _score(str(tmp_path / "beside.py")) == (1.0, {"reward": 1.0})
    other = tmp_path / "other"  # its own helper_xyz.py: the process already has the first folder's
    other.mkdir()
    (other / "helper_xyz.py").write_text("ACC = 0.5\n")
    (other / "beside2.py").write_text("from helper_xyz import ACC\n\ndef reward(c, row):\n    return ACC\n")
    with pytest.raises(ValueError, match=r"beside2.py imports 'helper_xyz', which this process already took from"):
        _score(str(other / "beside2.py"))


def test_reward_loading_errors_are_one_line_naming_the_file(tmp_path):
    (tmp_path / "syntax.py").write_text("def reward(c, row):\n  return (\n")
    (tmp_path / "args.py").write_text("def reward(c):\n  return 1.0\n")
    (tmp_path / "raises.py").write_text("X = 1\nY = 1 / 0\n\ndef reward(c, row):\n  return 1.0\n")
    cases = [
        (str(tmp_path / "missing.py"), "reward file '.*missing.py' does not exist"),
        (f"{tmp_path / 'syntax.py'}:reward", r"importing '.*syntax.py' failed at .*syntax.py:2: SyntaxError: '\('"),
        (str(tmp_path / "raises.py"), "importing '.*raises.py' failed at .*raises.py:2: ZeroDivisionError"),
        (str(tmp_path / "args.py"), "args.py:reward must take \\(completion: str, row: dict\\)"),
        (f"{tmp_path / 'args.py'}:nope", "defines no function 'nope'"),
        ("no_such_pkg.mod:fn", "cannot import 'no_such_pkg.mod'"),
        ("mathh", "unknown reward 'mathh'; built-ins"),
    ]
    for spec, message in cases:
        with pytest.raises(ValueError, match=message) as e:
            load_reward(spec)
        assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="reward_weights: \\['fmt'\\] name no reward"):
        load_reward("math", "fmt=1")
    for name in ("one.py", "two.py"):
        (tmp_path / name).write_text("def reward(c, row):\n  return 1.0\n")
    with pytest.raises(ValueError, match=r"\['.*one.py', '.*two.py'\] are all named 'reward'"):
        load_reward(f"{tmp_path / 'one.py'}, {tmp_path / 'two.py'}")  # each would be logged as reward/reward


def test_reward_env_runs_the_ordinary_token_exact_episode():
    row = {**get_task("arithmetic").rows(1, seed=3)[0], "answer": "x"}
    row["answer"] = row["label"]
    reward = load_reward("math,format", "format=0.5")
    engine = ScriptedEngine([f"\\boxed{{{row['answer']}}}"])
    traj = asyncio.run(run_episode(engine, TOK, RewardEnv(reward), row, SAMPLING, EpisodeLimits(), rollout_id=1))
    assert traj.reward == 1.5 and traj.score == 1.5 and traj.num_turns == 1
    assert traj.info == {"reward/math": 1.0, "reward/format": 1.0}
    masked = [t for t, m in zip(traj.tokens, traj.loss_mask, strict=True) if m]
    assert masked == engine.emitted[0]


def test_scored_env_replaces_the_agent_reward_with_the_final_answer_score():
    from molt.agents.builtin import env_for_task

    row = get_task("calculator").rows(1, seed=5)[0]
    engine = ScriptedEngine([f"<tool_call>{row['a']}*{row['b']}</tool_call>", f"\\boxed{{{row['label']}}}"])
    env = ScoredEnv(env_for_task("calculator"), load_reward("math"), max_turns=4)
    traj = asyncio.run(run_episode(engine, TOK, env, row, SAMPLING, EpisodeLimits(), rollout_id=1))
    # the calculator's own grader wants the bare number (0 here); the math reward reads the box
    assert traj.num_turns == 2 and traj.reward == 1.0 and traj.info["reward/agent"] == 0.0


BAD_RETURNS = """
import math, threading
import numpy as np
import torch

release = threading.Event()

def stuck(completion, row):
    if completion == "hang":
        release.wait()
    return 1.0

def nan(completion, row):
    return math.nan

def inf_part(completion, row):
    return {"acc": 1.0, "len": math.inf}

def empty(completion, row):
    return {}

def huge(completion, row):
    return 1e300

def scalars(completion, row):
    return {"np32": np.float32(0.5), "np64": np.int64(2), "tensor": torch.tensor(0.25), "flag": np.bool_(True)}

def parts(completion, row):
    return {"acc": 1.0, "len": 0.5}
"""


def test_numpy_and_tensor_scalars_count_and_bad_values_fail_the_rollout(tmp_path, caplog):
    path = tmp_path / "bad.py"
    path.write_text(BAD_RETURNS)
    assert _score(f"{path}:scalars")[1] == {"np32": 0.5, "np64": 2.0, "tensor": 0.25, "flag": 1.0}
    for spec, message in [
        (f"{path}:nan", r"reward 'nan' returned nan=nan \(float\); expected a finite number"),
        (f"{path}:inf_part", "reward 'inf_part' returned len=inf"),
        (f"{path}:empty", "reward 'empty' returned an empty dict"),
        (f"{path}:huge", r"reward 'huge' returned huge=1e\+300; expected a magnitude below 3.4e\+38 \(rewards train"),
    ]:
        with pytest.raises(ValueError, match=message):
            _score(spec)
    assert _score(f"{path}:parts", weights="len=2") == (2.0, {"acc": 1.0, "len": 0.5})
    with caplog.at_level(logging.WARNING):  # a typo, or a bonus some rows get: 0 where absent, and a warning
        assert _score(f"{path}:parts", weights="lenn=5") == (1.5, {"acc": 1.0, "len": 0.5})
    assert "['lenn'] named no reward returned so far (rewards returned: ['acc', 'len'])" in caplog.text
    with pytest.raises(ValueError, match=r"rollout.reward: \['math'\] named twice"):
        load_reward("math, format,math")
    (tmp_path / "imports.py").write_text("\nimport not_installed_xyz\n")
    with pytest.raises(
        ValueError, match=r"'.*imports.py' imports a missing module 'not_installed_xyz' \(.*imports.py:2\)"
    ):
        load_reward(str(tmp_path / "imports.py"))


def test_a_hung_sync_reward_fails_only_its_own_rollouts(tmp_path):
    path = tmp_path / "hang.py"
    path.write_text(BAD_RETURNS)
    reward = load_reward(f"{path}:stuck")

    async def main():
        for _ in range(6):  # more stuck calls than any fixed pool would have threads
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(reward.score("hang", {}), 0.01)
        return await asyncio.wait_for(reward.score("ok", {}), 30)  # starts now: no queue behind the stuck calls

    try:
        assert asyncio.run(main()) == (1.0, {"stuck": 1.0})
    finally:
        reward.parts[0].fn.__globals__["release"].set()


def test_named_means_count_a_name_a_rollout_did_not_return_as_zero():
    """With a bonus some rows get, the named means add up to the mean reward, in training's log and in eval; an
    episode cut before its reward (no names: score 0) counted in neither (reward/a 1.0 beside a mean reward 0.22)."""
    from molt.loop.evaluate import named_reward_means

    infos = [{"reward/base": 1.0, "reward/bonus": 1.0}, {"reward/base": 1.0, "tool_calls": 2}, {}]
    assert named_reward_means(infos) == pytest.approx({"reward/base": 2 / 3, "reward/bonus": 1 / 3})
    assert named_reward_means(infos[:2], "eval/") == {"eval/reward/base": 1.0, "eval/reward/bonus": 0.5}


def test_a_sync_reward_left_running_by_a_timeout_is_warned_about_once(tmp_path, caplog):
    (tmp_path / "stuck.py").write_text("import time\n\ndef reward(c, row):\n    time.sleep(0.5)\n    return 1.0\n")
    reward = load_reward(str(tmp_path / "stuck.py"))

    async def twice():
        for _ in range(2):
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(reward.score("7", {}), 0.05)

    with caplog.at_level(logging.WARNING):
        asyncio.run(twice())
    assert caplog.text.count("reward 'reward' still runs on its thread after its rollout was cancelled") == 1


def test_a_user_file_runs_once_per_version(tmp_path):
    """A reward (or agent) file imported again is the same module (a plugin that is also the reward file registers
    its variants once), but one edited since runs anew: a notebook user who fixes their reward reruns with the fix."""
    import os

    from molt.user_code import import_user_module

    path = tmp_path / "graded.py"
    path.write_text("calls = []\n\ndef reward(completion, row):\n    return 1.0\n")
    first = import_user_module(str(path))
    first.calls.append(1)
    assert import_user_module(str(path)) is first
    path.write_text("calls = []\n\ndef reward(completion, row):\n    return 0.5\n")
    os.utime(path, (path.stat().st_atime, path.stat().st_mtime + 10))  # a later version, whatever the clock
    edited = import_user_module(str(path))
    assert edited is not first and edited.reward("", {}) == 0.5 and edited.calls == []


def test_a_reward_file_importing_the_agent_file_gets_the_same_module(tmp_path):
    """The agent file ran as `molt_agent_shared_env`; the reward's `import shared_env` ran it a second time, with its
    own module state (an Env storing ground truth for the reward: never seen)."""
    from molt.user_code import import_user_module

    (tmp_path / "shared_env.py").write_text("STATE = {}\n")
    (tmp_path / "r_shared.py").write_text("import shared_env\n\ndef reward(c, row):\n  return len(shared_env.STATE)\n")
    agent = import_user_module(str(tmp_path / "shared_env.py"))
    agent.STATE["k"] = 1
    assert import_user_module(str(tmp_path / "r_shared.py")).reward("", {}) == 1
    for folder in ("a", "b"):  # an agent a/env.py, and a reward b/rew.py importing the env.py beside it: its own
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "env.py").write_text(f"WHERE = {folder!r}\n")
    (tmp_path / "b" / "rew.py").write_text("import env\n\ndef reward(c, row):\n  return 0.0\n")
    import_user_module(str(tmp_path / "a" / "env.py"))
    assert import_user_module(str(tmp_path / "b" / "rew.py")).env.WHERE == "b"
    (tmp_path / "helpers.py").write_text("import shared_env\n")  # through a helper module: the same one too
    (tmp_path / "r_helped.py").write_text("import helpers\n\ndef reward(c, row):\n  return 0.0\n")
    assert import_user_module(str(tmp_path / "r_helped.py")).helpers.shared_env is agent
