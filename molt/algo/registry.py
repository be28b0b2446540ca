"""Name -> function registries for algorithm variants (estimators, losses, aggregations, ...).

Every variant in `molt.algo` is a plain function registered under the name a config flag uses
(`--algo.estimator grpo`). Lookup is by name; an unknown or duplicate name is a ValueError that
lists the known names. Knows nothing about any particular family.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


class Registry(Generic[F]):
    """A named family of interchangeable functions, each with optional static info (a dict)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._fns: dict[str, F] = {}
        self._info: dict[str, dict[str, Any]] = {}

    def register(self, name: str, **info: Any) -> Callable[[F], F]:
        """Decorator: register `fn` under `name`; `info` is static metadata read by callers."""

        def add(fn: F) -> F:
            if name in self._fns:
                owner = self._fns[name].__name__
                raise ValueError(f"{self.kind} {name!r} is already registered (by {owner})")
            self._fns[name] = fn
            self._info[name] = dict(info)
            return fn

        return add

    def get(self, name: str) -> F:
        """The function registered as `name`; ValueError naming the choices otherwise."""
        if name not in self._fns:
            raise ValueError(f"unknown {self.kind} {name!r}; choose one of: {', '.join(self.names())}")
        return self._fns[name]

    def info(self, name: str) -> dict[str, Any]:
        """Static metadata given at registration (a copy)."""
        self.get(name)
        return dict(self._info[name])

    def names(self) -> list[str]:
        return sorted(self._fns)

    def __contains__(self, name: object) -> bool:
        return name in self._fns

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {self.names()})"
