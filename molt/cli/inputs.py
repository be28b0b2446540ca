"""What a run reads before any model is built: data rows, the reward function and the agent factory.

Also the start-up checks of config values that name user code (`rollout.agent`, `rollout.reward`,
`chat.tool_parser`): `molt.config` sits below the agents and cannot import them, so the commands run
these checks before anything is built. Each problem is one ConfigError line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from molt.agents.chat.agent import load_agent_class
from molt.agents.chat.tool_parser import PARSERS
from molt.agents.reward_env import agent_factory
from molt.agents.reward_fn import RewardFunction, load_reward
from molt.config import Config, ConfigError, check
from molt.data.dataset import dataset_rows


@dataclass
class RunInputs:
    train_rows: list[dict]
    eval_rows: list[dict]
    reward: RewardFunction | None
    make_env: Any


def reward_function(cfg: Config) -> RewardFunction | None:
    """The `rollout.reward` function (its file imported once), or None; a ConfigError naming the problem."""
    ro = cfg.rollout
    try:
        return load_reward(ro.reward, ro.reward_weights) if ro.reward else None
    except ValueError as e:
        raise ConfigError(str(e)) from None


def check_user_code(cfg: Config) -> None:
    """The agent class, reward function and tool-call parser the config names exist and load."""
    known = cfg.chat.tool_parser == "auto" or cfg.chat.tool_parser in PARSERS
    check(known, "chat.tool_parser", f"unknown parser; use auto or one of {sorted(PARSERS)}")
    if cfg.rollout.agent:
        load_agent_class(cfg.rollout.agent)  # imports and checks the class once: errors now, not after a warm start
    reward = reward_function(cfg)
    if reward is not None:
        reward.close()


def load_inputs(cfg: Config) -> RunInputs:
    """Data, reward and agent of a run; a bad row, file or function is an error here, before any model."""
    check_user_code(cfg)
    train_rows, eval_rows = dataset_rows(cfg.data)
    ro, reward = cfg.rollout, reward_function(cfg)
    return RunInputs(train_rows, eval_rows, reward, agent_factory(ro.agent, reward, cfg.data.task, ro.max_turns))
