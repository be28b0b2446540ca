"""Built-in tasks: generated prompt rows, demonstrations for SFT, and graders.

A task is a registered class with `rows(n, seed)` (dataset rows: `messages`, `label`), an SFT
`demonstration(row, rng)` (the row's messages plus assistant turns), and `grade(row, text)` in
[0, 1]. Tasks are generated from a seed, so nothing is downloaded and every machine sees the same
data. Knows nothing about models or training.
"""

from __future__ import annotations

import random
from typing import Any, Protocol

Row = dict[str, Any]


class Task(Protocol):
    name: str

    def rows(self, n: int, seed: int) -> list[Row]: ...

    def demonstration(self, row: Row, rng: random.Random) -> list[dict[str, Any]]: ...

    def grade(self, row: Row, text: str) -> float: ...


TASKS: dict[str, type] = {}


def register_task(name: str):
    """Register a task class under `name` (`--data.task name`)."""

    def wrap(cls):
        if name in TASKS:
            raise ValueError(f"task {name!r} registered twice")
        cls.name = name
        TASKS[name] = cls
        return cls

    return wrap


def get_task(name: str) -> Task:
    """Instantiate built-in task `name`; unknown names are an error listing the choices."""
    if name not in TASKS:
        raise ValueError(f"data.task: unknown task {name!r}; built-in tasks: {sorted(TASKS)}")
    return TASKS[name]()


@register_task("arithmetic")
class Arithmetic:
    """Single-turn sums and differences of two 1-2 digit numbers; the answer is the number alone."""

    def rows(self, n: int, seed: int) -> list[Row]:
        rng = random.Random(seed)
        out = []
        for _ in range(n):
            a, b, op = rng.randint(0, 99), rng.randint(0, 99), rng.choice("+-")
            value = a + b if op == "+" else a - b
            out.append({"messages": [{"role": "user", "content": f"{a}{op}{b}="}], "label": str(value)})
        return out

    def demonstration(self, row: Row, rng: random.Random) -> list[dict[str, Any]]:
        return row["messages"] + [{"role": "assistant", "content": row["label"]}]

    def grade(self, row: Row, text: str) -> float:
        return float(text.strip() == row["label"])
