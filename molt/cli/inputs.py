"""What a run reads before any model is built: data rows, the reward function and the agent factory; and the
agent worker processes (`rollout.agent_workers`) that build the same agent factory and reward function.

Also the start-up checks of config values that name user code (`rollout.agent`, `rollout.reward`,
`chat.tool_parser`): `molt.config` sits below the agents and cannot import them, so the commands run
these checks before anything is built. Each problem is one ConfigError line."""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from molt.agents.chat.agent import ChatAgent, load_agent_class
from molt.agents.chat.tool_parser import PARSERS
from molt.agents.env import prompt_messages
from molt.agents.reward_env import agent_factory
from molt.agents.reward_fn import RewardFunction, load_reward
from molt.agents.rewards import BUILTIN_REWARDS
from molt.agents.workers import AgentWorkers, WorkerKit
from molt.config import Config, ConfigError, DataConfig, check
from molt.data.dataset import dataset_rows
from molt.data.formats import DataError
from molt.data.rows import row_location
from molt.engine.interface import Engine
from molt.loop.evaluate import chat_options
from molt.models.tokenizer import IMAGE_PLACEHOLDER
from molt.models.vision import ImageError, load_image, message_images


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


def check_user_code(cfg: Config, flags: Iterable[str] = ()) -> None:
    """The agent class, reward function and tool-call parser the config names exist and load. A `chat.*` key among
    `flags` (the keys flags of `molt train` / `molt eval` set) is refused unless the agent is a ChatAgent, as other
    unused settings are: only flags (a config file shared with `molt serve` may set chat settings)."""
    known = cfg.chat.tool_parser == "auto" or cfg.chat.tool_parser in PARSERS
    check(known, "chat.tool_parser", f"unknown parser; use auto or one of {sorted(PARSERS)}")
    if cfg.rollout.replay:  # the dump holds what they made: neither runs (nor need be on this machine)
        return
    # imports and checks the class once: errors now, not after a warm start
    agent = load_agent_class(cfg.rollout.agent) if cfg.rollout.agent else None
    if not (agent and issubclass(agent, ChatAgent)) and (chat := sorted(k for k in flags if k.startswith("chat."))):
        what = f"the agent {agent.__name__} is an Env" if agent else "no --rollout.agent ChatAgent runs"
        raise ConfigError(f"{chat[0]}: has no effect here: {what}, so no chat server runs; drop the flag")
    reward = reward_function(cfg)
    if reward is not None:
        reward.close()


def load_inputs(cfg: Config) -> RunInputs:
    """Data, reward and agent of a run; a bad row, file or function is an error here, before any model. (`molt sft`
    reads data without a reward, so the check that a dataset has one is here rather than in `check_user_code`.)"""
    check_user_code(cfg)
    ro, chosen = cfg.rollout, cfg.data.task != DataConfig.task  # a task's Env grades rows shaped as the task's
    check(not cfg.data.path or bool(ro.reward or ro.agent) or chosen, "data.path", "a dataset needs "
          "--rollout.reward (e.g. math) or --rollout.agent (or --data.task naming the built-in task whose Env grades "
          "its rows)")  # fmt: skip
    train_rows, eval_rows = dataset_rows(cfg.data)
    if cfg.data.path or cfg.data.eval_path:  # a built-in task's own rows are checked by Config (one drawn row)
        vision = cfg.model.architecture().vision is not None
        check_rows(train_rows + eval_rows, vision, cfg.data.path or f"task {cfg.data.task}", not ro.agent)
        check_answers(train_rows + eval_rows, ro.reward, cfg.data.path or cfg.data.eval_path)
    reward = reward_function(cfg)
    return RunInputs(
        train_rows, eval_rows, reward, agent_factory(ro.agent, reward, cfg.data.task, ro.max_turns, _task_rows(cfg))
    )


def _task_rows(cfg: Config) -> bool:
    """Whether the task's Env may run every episode, a reward scoring its answer: the rows are the task's (no data
    file), or a chosen `--data.task` grades the files' rows shaped as its own."""
    return cfg.data.task != DataConfig.task or not (cfg.data.path or cfg.data.eval_path)


def check_rows(rows: list[dict], vision: bool, source: str, needs_prompt: bool) -> None:
    """Every row's RL prompt (its messages before the trailing assistant turns) is not empty where the built-in Env
    renders it (`needs_prompt`), its text is valid Unicode, every image in it opens and verifies (no pixels decoded:
    cheap, yet it reads each file once), and none is given to a text-only model: else a DataError naming the row
    (file:line)."""
    for i, row in enumerate(rows):
        prompt = prompt_messages(row["messages"])
        where = row_location(row, f"{source} row {i}")
        if needs_prompt and not prompt:
            raise DataError(f"{where}: no prompt: the row's messages are all assistant turns, which are an SFT "
                            "demonstration, not part of the RL prompt; add the user turn before them")  # fmt: skip
        images = message_images(prompt)
        if images and not vision:
            raise DataError(f"{where}: the row has {len(images)} image(s) but the model has no vision tower")
        contents = [m.get("content") for m in prompt]  # the text alone: no image is serialised to look for it
        texts = [c for c in contents if isinstance(c, str)]
        texts += [p.get("text") or "" for c in contents if isinstance(c, list) for p in c if isinstance(p, dict)]
        for text in texts:
            try:
                text.encode()
            except UnicodeEncodeError as e:  # a JSON escape of half an emoji: the tokenizer failed at rollout time
                raise DataError(f"{where}: the text holds {text[e.start]!r} (character {e.start}), half of a UTF-16 "
                                "surrogate pair, which no tokenizer encodes: mend its escape") from None  # fmt: skip
        if vision and any(IMAGE_PLACEHOLDER in text for text in texts):  # it would render as one more image
            raise DataError(f"{where}: the text holds {IMAGE_PLACEHOLDER} literally, the token that stands for an "
                            "image part: remove it from the text (images go in image parts)")  # fmt: skip
        for k, image in enumerate(images):
            try:
                load_image(image, f"{where}: image {k}", verify="scan")  # once per run: a cut-short JPEG too
            except ImageError as e:
                raise DataError(str(e)) from None


def check_answers(rows: list[dict], reward: str, source: str) -> None:
    """Every row has the `answer` (or `label`) a built-in reward of `reward` grades against (`math`, `exact`): a row
    without one failed its rollouts only once the loop reached it; else a DataError naming the row."""
    names = [part.strip() for part in reward.split(",")] if reward else []
    graders = [n for n in names if n in BUILTIN_REWARDS and BUILTIN_REWARDS.info(n).get("needs_answer")]
    for i, row in enumerate(rows if graders else ()):
        if row.get("answer") is None and row.get("label") is None:
            raise DataError(f"{row_location(row, f'{source} row {i}')}: no 'answer' (or 'label') column, which "
                            f"--rollout.reward {graders[0]} grades the completions against")  # fmt: skip


def worker_kit(cfg: Config, tokenizer) -> WorkerKit:
    """What an agent worker process builds: the run's agent factory and reward function, tokenizer, chat settings."""
    reward, ro = reward_function(cfg), cfg.rollout
    make_env = agent_factory(ro.agent, reward, cfg.data.task, ro.max_turns, _task_rows(cfg))
    return WorkerKit(tokenizer, make_env, chat_options(cfg), close=reward.close if reward else lambda: None)


async def agent_workers(cfg: Config, engine: Engine, tokenizer) -> AgentWorkers | None:
    """The run's `rollout.agent_workers` processes over `engine`, started (None when rollouts run in process)."""
    if not cfg.rollout.agent_workers:
        return None
    setup = functools.partial(worker_kit, cfg, tokenizer)
    return await AgentWorkers(setup, engine, cfg.rollout.agent_workers).start()
