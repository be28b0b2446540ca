"""Runs one `Env` episode token-in/token-out and returns its Trajectory.

The framework owns the LLM loop: the first observation is rendered with the chat template once; every later context is
the exact accumulated ids (prompt, engine-generated ids, observation deltas). Observations are rendered as the
template's *delta* after the previous turns, so earlier actions are never re-tokenized. Knows the engine interface
(`generate`), not the trainer. `check_result` and `as_messages` admit what agent code returns (ChatAgent runs too)."""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import reprlib
import weakref
from dataclasses import dataclass
from typing import Any

from molt.agents.env import Env, Messages, Result
from molt.agents.images import expand_images, message_images, pixels_arg, with_images
from molt.agents.watchdog import within
from molt.data.chat import ROLES
from molt.data.trajectory import Trajectory
from molt.errors import RolloutDrop
from molt.models.tokenizer import apply_chat_template, render_chat

PROBE = "\x00molt-action\x00"  # stands for the real action text when rendering observation deltas
_FIRST_PROMPTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> {rendered key: ids}


class TemplateRewriteError(ValueError):
    """The chat template re-renders earlier turns, so an observation cannot be appended as a delta."""


@dataclass
class EpisodeLimits:
    """Framework budgets for one episode."""

    max_turns: int = 4
    max_len: int = 512
    step_timeout_s: float = 30.0


def observation_ids(
    tokenizer, history: Messages, observation: Messages, emitted: str, tools=None, *, strict: bool = True
) -> list[int]:
    """Token ids to append after an action: the template's closing markup of that turn + the new turns, less the
    part of it the action already ends with (`emitted`, from `emitted_markup`).

    `history` ends with the user/tool turn the action answered. The action itself is replaced by a
    probe string, so the delta never depends on how the action's text would re-tokenize. `strict`: the render
    with the new turns must extend the render without them (else TemplateRewriteError: a chat session then starts
    a new segment); not strict (the Env runner, which keeps its exact ids as the context): only the text after the
    action must, so a template that renders earlier turns differently once one follows (Qwen3's empty `<think>`
    block on the last assistant turn) still extends the episode."""
    with_action = history + [{"role": "assistant", "content": PROBE}]
    base = render_chat(tokenizer, with_action, tools=tools)
    full = render_chat(tokenizer, with_action + observation, tools=tools, add_generation_prompt=True)
    closing, after = (text[text.rindex(PROBE) + len(PROBE) :] for text in (base, full))
    if not (full.startswith(base) if strict else after.startswith(closing)):
        raise TemplateRewriteError("the chat template re-renders earlier turns when a new one is added")
    return tokenizer(after.removeprefix(emitted), add_special_tokens=False)["input_ids"]


def emitted_markup(tokenizer, action_ids: list[int]) -> str:
    """The text of the special token an action ends with (the end of turn the engine stopped on: `<|im_end|>`, or
    Llama 3's `<|eot_id|>` though its tokenizer's eos is `<|end_of_text|>`), else ''."""
    last = list(action_ids[-1:])
    return tokenizer.decode(last) if last and not tokenizer.decode(last, skip_special_tokens=True) else ""


def as_messages(observation: Any, what: str) -> Messages:
    """An observation (`what`, e.g. `MyEnv.step returned Result.observation`) as chat messages: a str is one user
    message; a list of message dicts is taken as is; anything else is a TypeError naming `what`."""
    if isinstance(observation, str):
        return [{"role": "user", "content": observation}]
    if isinstance(observation, list | tuple) and all(isinstance(m, dict) for m in observation):
        for i, message in enumerate(observation):  # checked as data rows are: the template would drop or trip on it
            if message.get("role") not in ROLES:
                raise TypeError(f"{what}[{i}].role={message.get('role')!r}; expected one of {sorted(ROLES)}")
            content = message.get("content")
            if not isinstance(content, str | list) and "tool_calls" not in message:
                kind = type(content).__name__ if "content" in message else "missing"
                raise TypeError(f"{what}[{i}].content {kind}; expected a string or a list of parts")
        return list(observation)
    kind = type(observation).__name__
    if isinstance(observation, list | tuple):
        kind += " holding " + ", ".join(sorted({type(m).__name__ for m in observation if not isinstance(m, dict)}))
    raise TypeError(f"{what} of type {kind}; expected str or a list of messages (dicts with role and content)")


REWARD_LIMIT = 3.4e38  # rewards and scores train in float32, whose largest finite value is ~3.40282e38


def real_number(value: Any, what: str, limit: float = math.inf) -> float:
    """`value` as a float if a finite real number (bool, numpy scalar, 0-d tensor) of magnitude below `limit`, else an
    error naming `what`."""
    number = value.item() if getattr(value, "ndim", None) == 0 and hasattr(value, "item") else value
    if not isinstance(number, numbers.Real):
        raise TypeError(f"{what}={reprlib.repr(value)} ({type(value).__name__}); expected a number")
    if not math.isfinite(number if isinstance(number, float) or abs(number) < 2**1000 else math.inf):  # 10**400
        raise ValueError(f"{what}={reprlib.repr(number)} ({type(value).__name__}); expected a finite number")
    if abs(number) >= limit:
        raise ValueError(f"{what}={number}; expected a magnitude below {limit:g} (rewards train in float32)")
    return float(number)


def check_result(result: Any, where: str) -> Result:
    """What agent method `where` (e.g. `MyEnv.step`) returned, checked: a `Result` whose reward (and score unless
    None) is a finite real number (see `real_number`) and whose info is a dict; returned with both as floats."""
    if not isinstance(result, Result):
        raise TypeError(f"{where} returned {type(result).__name__}, expected molt.agents.Result")
    if not isinstance(result.info, dict):
        raise TypeError(f"{where} returned Result.info of type {type(result.info).__name__}; expected a dict")
    reward = real_number(result.reward, f"{where} returned Result.reward", REWARD_LIMIT)
    score = None if result.score is None else real_number(result.score, f"{where} returned Result.score", REWARD_LIMIT)
    return dataclasses.replace(result, reward=reward, score=score)


class ContextBudgetDrop(RolloutDrop, RuntimeError):
    """The prompt alone fills `rollout.max_len`: the rollout is dropped (counted), not failed."""

    drop_reason = "prompt_over_context"


def first_prompt_ids(tokenizer, messages: Messages, tools=None) -> list[int]:
    """The first observation rendered with the generation prompt. A group's n episodes render the same
    one, so the last few per tokenizer are kept (text-only messages; a copy is returned)."""
    try:
        key = json.dumps([messages, tools], sort_keys=True)
        cache = _FIRST_PROMPTS.setdefault(tokenizer, {})
    except TypeError:  # images or other non-JSON content, or a tokenizer without weakref/hash: render every time
        return apply_chat_template(tokenizer, messages, tools=tools, add_generation_prompt=True)
    if key not in cache:
        if len(cache) >= 256:
            cache.pop(next(iter(cache)))
        cache[key] = apply_chat_template(tokenizer, messages, tools=tools, add_generation_prompt=True)
    return list(cache[key])


def _extend_prompt(traj: Trajectory, engine, ids: list[int], images: list, max_len: int, leave_room=False) -> bool:
    """Append prompt/observation ids, expanding image placeholders and recording the images' pixels (an image past
    `max_len` raises). `leave_room`: append nothing and return False when the expanded ids leave no room to generate."""
    ids, records = expand_images(engine, ids, images, len(traj.tokens), None if leave_room else max_len)
    if leave_room and len(traj.tokens) + len(ids) >= max_len:
        return False
    traj.extend_prompt(ids)
    if records:
        traj.images = (traj.images or []) + records
    return True


def record_completion(traj: Trajectory, completion, keep_ids: bool) -> None:
    """Append an engine completion to `traj` as an action: ids, log-probs, versions, routing, finish reason."""
    traj.extend_action(list(completion.token_ids), list(completion.logprobs), list(completion.versions), keep_ids)
    traj.add_routing(getattr(completion, "routing", None))  # duck-typed engines may lack it
    traj.finish_reason = completion.finish_reason


async def run_episode(
    engine, tokenizer, env: Env, row: dict, sampling, limits: EpisodeLimits, keep_ids: bool = False, **ids: int
) -> Trajectory:
    """One multi-turn episode; `ids` (group_id, rollout_id) go into the Trajectory.

    The reward is the sum of the steps' rewards. The episode ends on terminated/truncated, on a step that returns
    no observation, or (then `truncated`) after `max_turns` actions or when the context budget `max_len` is used up."""
    name = type(env).__name__
    reset = await within(limits.step_timeout_s, env.reset(row), f"{name}.reset")
    messages = as_messages(reset, f"{name}.reset returned a first observation")  # a str: one user message
    if not messages:  # the template would render nothing to answer (transformers' error, from its own file)
        raise ValueError(f"{name}.reset returned no messages; expected the prompt (a str or a list of messages)")
    tools = row.get("tools")
    traj = Trajectory(**ids)
    prompt = first_prompt_ids(tokenizer, messages, tools)
    _extend_prompt(traj, engine, prompt, message_images(messages), limits.max_len)  # images past max_len: raises
    if len(traj.tokens) >= limits.max_len:
        raise ContextBudgetDrop(
            f"the prompt is {len(traj.tokens)} tokens, rollout.max_len is {limits.max_len}: no room to generate"
        )
    result = None
    for turn in range(limits.max_turns):
        room = limits.max_len - len(traj.tokens)
        if room <= 0:
            traj.truncated = True
            break
        turn_seed = None if sampling.seed is None else sampling.seed * 64 + turn  # distinct, reproducible
        turn_sampling = dataclasses.replace(sampling, max_tokens=min(sampling.max_tokens, room), seed=turn_seed)
        completion = await engine.generate(traj.tokens, turn_sampling, **pixels_arg(traj.images))
        record_completion(traj, completion, keep_ids)
        action = tokenizer.decode(completion.token_ids, skip_special_tokens=True)
        result = await within(limits.step_timeout_s, env.step(action), f"{name}.step")  # no extra task per call
        result = check_result(result, f"{name}.step")
        traj.reward += result.reward
        traj.info.update(result.info)
        if result.terminated or result.truncated or result.observation is None or turn + 1 == limits.max_turns:
            traj.truncated |= result.truncated or (result.observation is not None and not result.terminated)  # cut
            break
        observation = as_messages(result.observation, f"{name}.step returned Result.observation")
        observation = with_images(observation, result.images)
        emitted = emitted_markup(tokenizer, completion.token_ids)
        delta = observation_ids(tokenizer, messages, observation, emitted, tools, strict=False)
        if not _extend_prompt(traj, engine, delta, message_images(observation), limits.max_len, leave_room=True):
            traj.truncated = True  # no room to act after it (its images expanded): the budget ends the episode
            break
        messages = messages + [{"role": "assistant", "content": action}] + observation
    traj.score = result.score if result is not None and result.score is not None else traj.reward
    traj.check()
    return traj
