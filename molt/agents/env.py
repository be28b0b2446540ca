"""The agent contract: `Env` (the framework owns the LLM loop) and the `Result` every agent returns.

An `Env` is reset with a dataset row and stepped with the decoded text of each action; its
`Result.observation` (text or chat messages) is appended to the context with loss mask 0. Agent
classes are loaded from a file path or a dotted name. Nothing here knows engines or trainers."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import os
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

Messages = list[dict[str, Any]]


@dataclass
class Result:
    """What one agent step (or a whole ChatAgent run) returns."""

    reward: float
    observation: str | Messages | None = None
    terminated: bool = False
    truncated: bool = False
    info: dict[str, Any] = field(default_factory=dict)
    score: float | None = None
    images: list[Any] | None = None


def prompt_messages(messages: Messages) -> Messages:
    """A conversation's RL prompt: its messages up to (not including) its trailing assistant turns."""
    end = len(messages)
    while end and messages[end - 1].get("role") == "assistant":
        end -= 1
    return list(messages[:end])


class Env:
    """Base class of step environments. Override `step`; `reset` is optional.

    `reset(row)` returns the first observation as chat messages, or text (one user message) (default: the row's
    `messages` up to their trailing assistant turns, which are a demonstration for SFT, not part of the RL prompt).
    `step(action)` gets the decoded text of the policy's turn and returns a `Result`; the episode ends when it is
    `terminated` or `truncated` or has no observation (or the framework's turn/context budget runs out: truncated)."""

    async def reset(self, row: dict[str, Any]) -> Messages:
        self.row = row
        return prompt_messages(row["messages"])

    async def step(self, action: str) -> Result:
        raise NotImplementedError


_FOLDERS: set[Path] = set()  # the folders of the user files imported so far


def import_failure(spec: str, error: Exception) -> str:
    """`importing SPEC failed at FILE:LINE: Type: message`: where in the user's file its import raised (a syntax
    error's own line), else the spec's file."""
    where, text = spec.split(":")[0], str(error)
    file = Path(where).resolve()
    if isinstance(error, SyntaxError) and error.filename and error.lineno:
        where, text = f"{error.filename}:{error.lineno}", error.msg
    elif frames := [f for f in traceback.extract_tb(error.__traceback__) if Path(f.filename).resolve() == file]:
        where = f"{frames[-1].filename}:{frames[-1].lineno}"
    return f"importing {spec!r} failed at {where}: {type(error).__name__}: {text}"


def import_user_module(target: str):
    """The module of `file.py`, its folder first on sys.path (as `python file.py` has it: it imports the modules
    beside it), or of a dotted name, found in the current folder too (as `python -m` has it). An ImportError when
    the file uses a module that another user file's folder gave first, while its own folder holds one of that name:
    a process imports a name once, so it would silently get the other one."""
    if target.endswith(".py"):
        path = Path(target)
        if (folder := path.resolve().parent) not in _FOLDERS:
            _FOLDERS.add(folder)
            sys.path.insert(0, str(folder))
        _check_siblings(path, folder)
        module_spec = importlib.util.spec_from_file_location(f"molt_agent_{path.stem}", path)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[module_spec.name] = module
        module_spec.loader.exec_module(module)
        return module
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())  # last: an installed package of the same name still wins
    return importlib.import_module(target)


def _check_siblings(path: Path, folder: Path) -> None:
    """An ImportError when user file `path` imports a module name that an earlier user file's folder gave the
    process, while `folder` holds its own of that name."""
    tree = ast.parse(path.read_bytes(), str(path))
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module and not n.level}
    for name in sorted({n.partition(".")[0] for n in names} & set(sys.modules)):
        there = Path(getattr(sys.modules[name], "__file__", None) or "").resolve()
        other = there.parent.parent if there.name == "__init__.py" else there.parent
        mine = folder / f"{name}.py" if (folder / f"{name}.py").exists() else folder / name / "__init__.py"
        if other in _FOLDERS - {folder} and mine.exists():
            raise ImportError(f"{path} imports {name!r}, which this process already took from {there} for an earlier "
                              f"user file, not {mine} beside it: rename one of the two modules")  # fmt: skip


def load_agent(spec: str, bases: tuple[type, ...] = (Env,)) -> type:
    """Agent class from `file.py`, `file.py:Name`, `pkg.module` or `pkg.module:Name`.

    Without `:Name` the module must define exactly one subclass of `bases` (or a class named `Agent`)."""
    target, colon, name = spec.partition(":")
    if target.endswith(".py") and not Path(target).exists():
        raise FileNotFoundError(f"--rollout.agent: agent file {target!r} does not exist")
    try:
        module = import_user_module(target)
    except ModuleNotFoundError as e:
        if target.endswith(".py"):  # the file imports a missing module: its own error
            raise
        raise ModuleNotFoundError(f"--rollout.agent: cannot import agent module {spec!r}: {e}") from None
    if colon:
        if not hasattr(module, name):
            raise AttributeError(f"--rollout.agent: {spec!r} has no attribute {name!r}")
        return getattr(module, name)
    if hasattr(module, "Agent"):
        return module.Agent
    own = [
        c
        for _, c in inspect.getmembers(module, inspect.isclass)
        if issubclass(c, bases) and c not in bases and c.__module__ == module.__name__
    ]
    if len(own) != 1:
        kinds = "/".join(b.__name__ for b in bases)
        raise ValueError(f"--rollout.agent: {spec!r} defines {len(own)} {kinds} classes; name one with {spec}:Name")
    return own[0]
