"""`Registry`: the one name -> variant table of Molt (estimators, losses, tasks, engines, runtimes, ...).

Every named variant a config flag or a file picks (`--algo.estimator grpo`, `--runtime.engine vllm`, a data
format, a tool-call parser) is registered under its name in a `Registry` and looked up by it; an unknown or
duplicate name, or a variant registered without the info its family requires, is a ValueError. Imports
nothing, so every stage may use it."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

F = TypeVar("F")


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
    ) -> None:
        self.kind, self.required = kind, required  # `required`: the info keys every variant must give
        self.flag = flag  # the config key that picks a variant (`algo.policy_loss`), for messages
        self.check = check  # (name, info) -> what is wrong with them, or None
        self._fns: dict[str, F] = {}
        self._info: dict[str, dict[str, Any]] = {}

    def register(self, name: str, **info: Any) -> Callable[[F], F]:
        """Decorator: register `fn` under `name`; `info` is static metadata read by callers."""
        return functools.partial(self.add, name, **info)

    def add(self, name: str, variant: F, **info: Any) -> F:
        """Register `variant` under `name` (the decorator's work, for values that are not defined by a `def`)."""
        if name in self._fns:
            owner = getattr(self._fns[name], "__name__", repr(self._fns[name]))
            raise ValueError(f"{self.kind} {name!r} is already registered (by {owner})")
        if missing := [key for key in self.required if key not in info]:
            given = ", ".join(f"{key}=..." for key in missing)
            raise ValueError(f"{self.kind} {name!r}: register it with {given} (every {self.kind} states them)")
        if self.check is not None and (problem := self.check(name, info)):
            raise ValueError(f"{self.kind} {name!r}: {problem}")
        self._fns[name] = variant
        self._info[name] = info
        return variant

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


def bool_info(*keys: str) -> Callable[[str, dict[str, Any]], str | None]:
    """A `Registry` check: each of `keys` given is True or False (a truthy string would read as True)."""
    return lambda name, info: next(
        (f"{k}={info[k]!r} must be True or False" for k in keys if k in info and not isinstance(info[k], bool)), None
    )
