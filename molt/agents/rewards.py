"""Built-in reward functions, addressable by name (`--rollout.reward math`, `format`, `exact`, ...).

Each is `fn(completion: str, row: dict) -> float`, like a user's reward function. The reference
answer is the row's `answer` column (else `label`); a GSM8K-style `... #### 72` or a `\\boxed{72}`
reference is reduced to its final answer. Answers match numerically when both sides are numbers
(`1,234`, `-3.50`, `3/4`, `\\frac{3}{4}`, `50%` as 50), else as normalised text."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from fractions import Fraction
from typing import Any

from molt.registry import Registry

BUILTIN_REWARDS: Registry[Callable[[str, dict[str, Any]], float]] = Registry("reward")

MINUS = r"(?:(?<![\w)])-)?"  # a sign, not the hyphen of `10-12` or `x-3`
NUMBER = re.compile(rf"{MINUS}(?:\d{{1,3}}(?:,\d{{3}})+|\d+)(?:\.\d+)?(?:\s*/\s*\d+)?|{MINUS}\.\d+")
THOUSANDS = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d*)?")  # the only commas a number may hold
FRAC = re.compile(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}")
THINK = re.compile(r"\s*<think>.*?</think>\s*\S", re.S)


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (nested braces allowed), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j]
    return None


def last_number(text: str) -> str | None:
    """The last number in `text` (thousands commas, decimals and a/b fractions kept), or None."""
    found = NUMBER.findall(FRAC.sub(r"\1/\2", text))
    return found[-1] if found else None


def extract_answer(completion: str) -> str | None:
    """A completion's final answer: the last `\\boxed{}` content, else its last number."""
    boxed = last_boxed(completion)
    return boxed if boxed is not None else last_number(completion)


def row_answer(row: dict[str, Any]) -> str:
    """The row's `answer` column, else its `label`, as text; an error if it has neither."""
    value = row.get("answer")
    value = row.get("label") if value is None else value
    if value is None:
        raise KeyError("the row has no 'answer' (or 'label') column for the reward to compare with")
    return str(value)


def reference_answer(row: dict[str, Any]) -> str:
    """The row's reference answer (`answer`, else `label`), reduced to its final part."""
    text = row_answer(row)
    if "####" in text:
        return text.rsplit("####", 1)[1].strip()
    boxed = last_boxed(text)
    return boxed if boxed is not None else text.strip()


def to_number(text: str) -> float | None:
    """`text` as a number (`1,234`, `$5`, `3/4`, `\\frac{3}{4}`, `7.`; `50%` is 50, as references write it), or None
    (also for `2, 3` or `1 1/2`: a comma outside thousands groups, a space outside a fraction)."""
    t = FRAC.sub(r"\1/\2", text).replace("\\$", "$").replace("\\%", "%").replace("\\!", "").strip()
    t = re.sub(r"\s*/\s*", "/", t.strip("$").rstrip("%").strip().rstrip("."))
    if "," in t:
        if not THOUSANDS.fullmatch(t):
            return None
        t = t.replace(",", "")
    try:
        return float(Fraction(t)) if "/" in t else float(t)
    except (ValueError, ZeroDivisionError):
        return None


def _normalise(text: str) -> str:
    return re.sub(r"\s+", " ", text.strip().strip("$").rstrip(".")).lower()


def answers_match(predicted: str, reference: str) -> bool:
    """Numerically equal when both are numbers (relative tolerance 1e-6), else equal as normalised text."""
    a, b = to_number(predicted), to_number(reference)
    if a is not None and b is not None:
        return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9)
    return _normalise(predicted) == _normalise(reference)


@BUILTIN_REWARDS.register("math", needs_answer=True)
def math_reward(completion: str, row: dict[str, Any]) -> float:
    """1 if the completion's final answer (`\\boxed{}`, else its last number) matches the row's answer."""
    reference, predicted = reference_answer(row), extract_answer(completion)  # a row without an answer always fails
    return float(predicted is not None and answers_match(predicted, reference))


@BUILTIN_REWARDS.register("exact", needs_answer=True)
def exact_reward(completion: str, row: dict[str, Any]) -> float:
    """1 if the whole completion, stripped, equals the row's answer (or label), as the built-in tasks grade."""
    return float(completion.strip() == row_answer(row).strip())


@BUILTIN_REWARDS.register("format")
def format_reward(completion: str, row: dict[str, Any]) -> float:
    """1 if the completion puts its answer in `\\boxed{...}` (the form the math reward reads first)."""
    return float(last_boxed(completion) is not None)


@BUILTIN_REWARDS.register("think_format")
def think_format_reward(completion: str, row: dict[str, Any]) -> float:
    """1 if the completion is `<think>...</think>` followed by an answer."""
    return float(THINK.match(completion) is not None)
