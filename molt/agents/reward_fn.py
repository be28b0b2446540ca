"""Reward functions: `fn(completion: str, row: dict) -> float | dict[str, float]`, sync or async.

`--rollout.reward` names one or more, comma-separated: a built-in (`math`, `format`, ...; see `rewards.py`),
`file.py:fn` or `pkg.module:fn` (`file.py` alone means its function `reward`). Each returns a float, named after the
function (a partial or callable object: as given), or a dict of named rewards. The episode's reward is the weighted
sum of all named rewards (`--rollout.reward_weights name=w,...`, default 1); each is logged (`reward/<name>` per
step, `eval/reward/<name>`). User functions that are not `async` run each call on a thread of its own, so a slow one
cannot stall the loop, its timeout (`rollout.step_timeout_s`) fires, and one that hangs holds only its own (daemon)
thread; one stuck computing still takes CPU time, and is warned about. Loading is checked when the config is built:
a missing file or function is one line naming it. A value that is not a finite number fails its rollout."""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import math
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from molt.agents.rewards import BUILTIN_REWARDS
from molt.agents.runner import REWARD_LIMIT, real_number
from molt.threads import in_daemon_thread
from molt.user_code import import_failure, import_user_module

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RewardPart:
    """One reward function of a `--rollout.reward` list."""

    name: str
    fn: Callable[..., Any]
    inline: bool  # built-ins are cheap and run on the event loop; user sync functions on threads


def parse_weights(spec: str) -> dict[str, float]:
    """`"math=1,format=0.2"` -> {"math": 1.0, "format": 0.2}."""
    weights: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, sep, value = (s.strip() for s in item.partition("="))
        try:
            weights[name] = float(value) if sep and name else float("nan")
        except ValueError:
            weights[name] = float("nan")
        if not math.isfinite(weights[name]):
            raise ValueError(f"rollout.reward_weights: {item!r} is not NAME=NUMBER (e.g. math=1,format=0.2)")
    return weights


@functools.cache
def _file_function(spec: str, mtime: float) -> Callable[..., Any]:
    """The function of file `spec`, imported once per file version."""
    return _user_function(spec)


def _user_function(spec: str) -> Callable[..., Any]:
    """The function `spec` names, checked."""
    target, _, name = spec.partition(":")
    name = name or "reward"
    try:
        module = import_user_module(target)
    except ModuleNotFoundError as e:
        if not target.endswith(".py") and e.name and target.startswith(e.name):
            raise ValueError(f"rollout.reward: cannot import {target!r}: {e}") from None
        site = [f for f in traceback.extract_tb(e.__traceback__) if not f.filename.startswith("<")][-1]
        raise ValueError(
            f"rollout.reward: {target!r} imports a missing module {e.name!r} ({site.filename}:{site.lineno})"
        ) from None
    except Exception as e:  # noqa: BLE001 - the user's module failed while importing
        raise ValueError(f"rollout.reward: {import_failure(target, e)}") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ValueError(f"rollout.reward: {target!r} defines no function {name!r} (give it as {target}:NAME)")
    try:
        inspect.signature(fn).bind("completion", {})
    except TypeError:
        raise ValueError(f"rollout.reward: {target}:{name} must take (completion: str, row: dict)") from None
    except ValueError:  # builtins without a signature: trust them
        pass
    return fn


def load_part(spec: str) -> RewardPart:
    """A built-in name, `file.py[:fn]` or `pkg.module:fn` as a named reward part."""
    if ":" not in spec and not spec.endswith(".py"):
        if spec not in BUILTIN_REWARDS:
            raise ValueError(
                f"rollout.reward: unknown reward {spec!r}; built-ins: {sorted(BUILTIN_REWARDS)}, "
                "or FILE.py:FUNCTION / package.module:FUNCTION"
            )
        return RewardPart(spec, BUILTIN_REWARDS[spec], inline=True)
    path = Path(spec.partition(":")[0])
    if path.suffix == ".py" and not path.exists():
        raise ValueError(f"rollout.reward: reward file {str(path)!r} does not exist")
    # a file: imported once per version; a module's attribute (`__main__:fn` in a notebook): looked up each time, so
    # a cell that redefines it is the one the next run uses
    fn = _file_function(spec, path.stat().st_mtime) if path.suffix == ".py" else _user_function(spec)
    return RewardPart(getattr(fn, "__name__", None) or spec.partition(":")[2] or "reward", fn, inline=False)


class RewardFunction:
    """The reward of `--rollout.reward` / `--rollout.reward_weights`: named parts and their weights; the named values
    go into the rollout's `info` as `reward/<name>` (`reward_env.py`), which the per-step and eval metrics average."""

    def __init__(self, spec: str, weights: str = ""):
        self.spec = spec
        specs = [s.strip() for s in spec.split(",") if s.strip()]
        if not specs:
            raise ValueError("rollout.reward: no reward function named")
        if twice := sorted({s for s in specs if specs.count(s) > 1}):
            raise ValueError(f"rollout.reward: {twice} named twice")
        self.parts = [load_part(s) for s in specs]
        names = {p.name for p in self.parts}
        for name in names:  # each part's float is logged and weighted under its name
            if len(same := [s for s, p in zip(specs, self.parts, strict=True) if p.name == name]) > 1:
                raise ValueError(f"rollout.reward: {same} are all named {name!r}; give each its own function name")
        self.weights = parse_weights(weights)
        unknown = sorted(set(self.weights) - names)
        if unknown and all(p.inline for p in self.parts):  # a user function may return a dict: its keys come later
            raise ValueError(f"rollout.reward_weights: {unknown} name no reward; rewards: {sorted(names)}")
        self.seen: set[str] = set()  # named rewards returned so far
        self.unseen_warned: set[str] = set()
        self.abandoned: set[str] = set()  # parts whose thread a cancelled rollout left running (warned once)

    async def _call(self, part: RewardPart, completion: str, row: dict[str, Any]) -> Any:
        if part.inline or inspect.iscoroutinefunction(part.fn):
            value = part.fn(completion, row)
        else:
            try:
                value = await in_daemon_thread(part.fn, completion, row, name="molt-reward")
            except asyncio.CancelledError:  # e.g. rollout.step_timeout_s: the thread runs on
                if part.name not in self.abandoned:
                    self.abandoned.add(part.name)
                    log.warning("reward %r still runs on its thread after its rollout was cancelled (timed out?); "
                                "Python cannot stop a thread, so one stuck in CPU-bound code slows the rest of the "
                                "run: bound its own time, or make it async", part.name)  # fmt: skip
                raise
        return await value if inspect.isawaitable(value) else value

    async def score(
        self, completion: str, row: dict[str, Any], agent_reward: float | None = None
    ) -> tuple[float, dict[str, float]]:
        """(weighted total, named rewards) of one completion; a bad return value (not a finite number, an empty
        dict, a name returned twice) is an error failing the rollout. A weighted name the functions did not return
        counts 0 (a dict may hold a bonus for some rows only); one returned by no rollout so far is warned about."""
        named: dict[str, float] = {}
        for part in self.parts:
            value = await self._call(part, completion, row)
            if isinstance(value, dict) and not value:
                raise ValueError(f"reward {part.name!r} returned an empty dict; expected a number or named numbers")
            for key, v in value.items() if isinstance(value, dict) else [(part.name, value)]:
                number = real_number(v, f"reward {part.name!r} returned {key}", REWARD_LIMIT)  # True scores 1
                if key in named:
                    raise ValueError(f"reward name {key!r} is returned twice (rollout.reward {self.spec!r})")
                named[str(key)] = number
        self.seen |= named.keys()
        if unknown := sorted(set(self.weights) - self.seen - self.unseen_warned):
            self.unseen_warned |= set(unknown)
            log.warning("rollout.reward_weights: %s named no reward returned so far (rewards returned: %s); a name "
                        "counts 0 where it is not returned, so a misspelt one never applies", unknown,
                        sorted(self.seen))  # fmt: skip
        return sum(self.weights.get(k, 1.0) * v for k, v in named.items()), named

    def close(self) -> None:
        """Nothing to release: a call still running holds a daemon thread, which ends with the process."""


load_reward = RewardFunction
