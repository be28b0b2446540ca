"""Start-up errors about a run's data and reward: a dataset needs a reward or an agent; `molt.make_config` checks
the user code a config names, as the CLI does."""

import json

import pytest

import molt
from molt.cli.inputs import load_inputs
from molt.cli.main import parse_config
from molt.config import ConfigError


def test_a_dataset_without_reward_or_agent_is_a_config_error(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(4)))
    with pytest.raises(ConfigError, match=r"data.path: a dataset needs --rollout.reward \(e.g. math\)"):
        load_inputs(parse_config(["--data.path", str(path)]))
    inputs = load_inputs(parse_config(["--data.path", str(path), "--rollout.reward", "math"]))
    assert len(inputs.train_rows) == 4 and inputs.reward is not None
    assert load_inputs(parse_config([])).reward is None  # a built-in task grades its own rows
    assert load_inputs(parse_config(["--data.path", str(path), "--data.task", "arithmetic"])).reward is None


def test_make_config_checks_the_reward_and_agent_it_names(tmp_path):
    with pytest.raises(ConfigError, match="rollout.reward: unknown reward 'mathh'"):
        molt.make_config({"rollout.reward": "mathh"})
    with pytest.raises(ConfigError, match=r"rollout.reward: \['math'\] named twice"):
        molt.make_config(molt.make_config(), rollout={"reward": "math,math"})
    with pytest.raises(ConfigError, match="agent file .*missing.py' does not exist"):
        molt.make_config(rollout={"agent": str(tmp_path / "missing.py")})
    assert molt.make_config(rollout={"reward": "math"}).rollout.reward == "math"
