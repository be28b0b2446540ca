"""`Registry`: the one name -> variant table of Molt (estimators, losses, tasks, engines, runtimes, ...).

Every named variant a config flag or a file picks (`--algo.estimator grpo`, `--runtime.engine vllm`, a data
format, a tool-call parser) is registered under its name in a `Registry` and looked up by it; an unknown or
duplicate name (but a new version from the same file: an edited plugin imported again), or a variant registered
without the info its family requires (or, for a family with a call form, one that cannot be called so), is a
ValueError. Each variant's origin (its file and line) is kept, so a failure of a variant registered outside Molt
(`variant_failure`) is told from a bug in Molt's own. Imports nothing, so every stage may use it."""

from __future__ import annotations

import functools
import inspect
import os
import sys
import traceback
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, Generic, TypeVar

F = TypeVar("F")
MOLT_DIR = str(Path(__file__).resolve().parent) + os.sep  # where Molt's own variants are defined (not molt_x/)


class VariantError(ValueError):
    """A registered variant returned what its family does not take (NaN, a wrong shape or dtype): names it."""

    def __init__(self, message: str, kind: str, name: str):
        super().__init__(message)
        self.kind, self.name = kind, name


class Registry(Generic[F]):
    """A named family of interchangeable variants (functions or classes), each with optional static info."""

    def __init__(
        self,
        kind: str,
        required: tuple[str, ...] = (),
        check: Callable[[str, dict[str, Any]], str | None] | None = None,
        flag: str = "",
        call: tuple[tuple[str, ...], tuple[str, ...]] | None = None,
    ) -> None:
        self.kind, self.required = kind, required  # `required`: the info keys every variant must give
        self.flag = flag  # the config key that picks a variant (`algo.policy_loss`), for messages
        self.check = check  # (name, info) -> what is wrong with them, or None
        self.call = call  # (positional, keyword) argument names every variant is called with; None = unchecked
        self._fns: dict[str, F] = {}
        self._info: dict[str, dict[str, Any]] = {}
        self._origin: dict[str, tuple[str, int]] = {}  # name -> (file, line) where the variant is defined
        self._namespace: dict[str, dict | None] = {}  # name -> the globals of the module run that defined it
        self._user: dict[str, bool] = {}  # name -> defined outside Molt

    def register(self, name: str, **info: Any) -> Callable[[F], F]:
        """Decorator: register `fn` under `name`; `info` is static metadata read by callers."""
        return functools.partial(self.add, name, **info)

    def add(self, name: str, variant: F, **info: Any) -> F:
        """Register `variant` under `name` (the decorator's work, for values that are not defined by a `def`)."""
        if name in self._fns and not self._rerun(name, variant):
            owner = getattr(self._fns[name], "__name__", repr(self._fns[name]))
            raise ValueError(f"{self.kind} {name!r} is already registered (by {owner} at {self.origin(name)})")
        if missing := [key for key in self.required if key not in info]:
            given = ", ".join(f"{key}=..." for key in missing)
            raise ValueError(f"{self.kind} {name!r}: register it with {given} (every {self.kind} states them)")
        if self.check is not None and (problem := self.check(name, info)):
            raise ValueError(f"{self.kind} {name!r}: {problem}")
        if self.call is not None and (problem := _call_problem(variant, *self.call)):
            raise ValueError(f"{self.kind} {name!r}: {problem}")
        self._fns[name] = variant
        self._info[name] = info
        self._origin[name], self._namespace[name] = _origin(variant), _namespace(variant)
        self._user[name] = not _in_molt(self._origin[name][0])  # asked per micro-batch: resolved once
        return variant

    def remove(self, name: str) -> None:
        """Forget variant `name` (a notebook's or a test's own; registering it again then starts afresh)."""
        for table in (self._fns, self._info, self._origin, self._namespace, self._user):
            table.pop(name, None)

    def _rerun(self, name: str, variant: F) -> bool:
        """Whether `variant` is a new version of `name`'s variant, so it may replace it: defined in the same file
        outside Molt by a new run of it (an edited plugin imported again: its module's namespace is new), or both in
        `__main__` from another file or the same line (a notebook cell run again, edited or not: a kernel names a
        cell's code by its text; not a second definition in one script)."""
        old_file, new_file = self._origin[name][0], _origin(variant)[0]
        same_file = os.path.realpath(old_file) == os.path.realpath(new_file) and self.from_user(name)
        namespace, main = _namespace(variant), getattr(sys.modules.get("__main__"), "__dict__", None)
        rerun = not same_file or self._origin[name] == _origin(variant)  # another cell, or this one run again
        notebook = namespace is not None and namespace is main and self._namespace[name] is main and rerun
        return notebook or (same_file and namespace is not None and namespace is not self._namespace[name])

    def origin(self, name: str) -> str:
        """`file:line` where variant `name` is defined (or was registered)."""
        self.get(name)
        return "{}:{}".format(*self._origin[name])

    def from_user(self, name: str) -> bool:
        """Whether variant `name` is defined outside Molt (a plugin, your script): its failures are yours."""
        return self._user.get(name, False)

    def get(self, name: str) -> F:
        """The variant registered as `name`; ValueError naming the choices otherwise."""
        if name not in self._fns:
            raise ValueError(f"unknown {self.kind} {name!r}; choose one of: {', '.join(self.names())}")
        return self._fns[name]

    __getitem__ = get

    def info(self, name: str) -> dict[str, Any]:
        """Static metadata given at registration (a copy)."""
        self.get(name)
        return dict(self._info[name])

    def problem(self, name: str, text: str) -> VariantError:
        """The error `KIND 'NAME' TEXT (--FLAG NAME)` about what variant `name` returned."""
        picked = f" (--{self.flag} {name})" if self.flag else ""
        return VariantError(f"{self.kind} {name!r} {text}{picked}", self.kind, name)

    def names(self) -> list[str]:
        return sorted(self._fns)

    def __contains__(self, name: object) -> bool:
        return name in self._fns

    def __iter__(self) -> Iterator[str]:
        return iter(self._fns)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {self.names()})"


def _in_molt(filename: str) -> bool:
    """Whether `filename` is one of Molt's own files."""
    return os.path.realpath(filename).startswith(MOLT_DIR)


def _origin(variant: object) -> tuple[str, int]:
    """(file, line) of `variant`'s definition: a function's code, a class's source, else the registering call."""
    code = getattr(variant, "__code__", None)
    if code is not None:
        return code.co_filename, code.co_firstlineno
    try:
        return inspect.getsourcefile(variant) or "?", inspect.getsourcelines(variant)[1]
    except (TypeError, OSError):
        frame = sys._getframe(1)  # noqa: SLF001 - the caller outside this module and functools
        while frame.f_back is not None and frame.f_code.co_filename in (__file__, functools.__file__):
            frame = frame.f_back
        return frame.f_code.co_filename, frame.f_lineno


def _namespace(variant: object) -> dict | None:
    """The globals of the module run that defined `variant` (a function's, or its module's now), or None."""
    namespace = getattr(variant, "__globals__", None)
    if namespace is None and (module := sys.modules.get(getattr(variant, "__module__", None) or "")) is not None:
        namespace = vars(module)
    return namespace


def _call_problem(variant: object, positional: tuple[str, ...], keywords: tuple[str, ...]) -> str | None:
    """Why `variant` cannot be called with the arguments `positional` and keywords `keywords`, or None."""
    try:
        signature = inspect.signature(variant)
    except (TypeError, ValueError):  # a builtin without a signature: not checked
        return None
    try:
        signature.bind(*positional, **dict.fromkeys(keywords))
    except TypeError as e:
        form = ", ".join([*positional, *(f"{k}=..." for k in keywords)])
        name = getattr(variant, "__name__", type(variant).__name__)
        return f"{name}{signature} cannot be called as fn({form}), as Molt calls it: {e}"
    return None


def variant_failure(error: BaseException, registries: Iterable[Registry]) -> str | None:
    """What went wrong, naming the variant, its flag and where it is defined, when `error` is the failure of a variant
    registered outside Molt (its bad output, `VariantError`, or an exception raised in its code); else None (a
    failure in Molt's own variants or code is Molt's)."""
    registries = list(registries)
    if isinstance(error, VariantError):
        for r in registries:
            if r.kind == error.kind and r.from_user(error.name):
                return f"{error}; it is defined at {r.origin(error.name)}"
        return None
    codes = {getattr(r.get(n), "__code__", None): (r, n) for r in registries for n in r if r.from_user(n)}
    for frame, _ in reversed(list(traceback.walk_tb(error.__traceback__))):
        if (found := codes.get(frame.f_code)) is not None:
            r, name = found
            flag = f"--{r.flag} {name}, " if r.flag else ""
            user = [f for f in traceback.extract_tb(error.__traceback__) if not _in_molt(f.filename)]
            at = f" at {user[-1].filename}:{user[-1].lineno}" if user else ""
            return f"{r.kind} {name!r} ({flag}defined at {r.origin(name)}) raised {type(error).__name__}{at}: {error}"
    return None


def bool_info(*keys: str) -> Callable[[str, dict[str, Any]], str | None]:
    """A `Registry` check: each of `keys` given is True or False (a truthy string would read as True)."""
    return lambda name, info: next(
        (f"{k}={info[k]!r} must be True or False" for k in keys if k in info and not isinstance(info[k], bool)), None
    )
