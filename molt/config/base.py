"""The configuration's error (`ConfigError`, naming the offending key) and the helpers every group checks by."""

from __future__ import annotations

import operator
import os

from molt.errors import UserError


class ConfigError(UserError):
    """A configuration value or combination that cannot run; the message names the key."""

    kind = "config error"


def check(ok: bool, key: str, message: str) -> None:
    """Raise ConfigError naming `key` unless `ok`."""
    if not ok:
        raise ConfigError(f"{key}: {message}")


def expand_user(group: object, *keys: str) -> None:
    """`~` at the start of these path fields is the home folder, in a file or a Python dict too (a shell expands it
    only in flags: a config file's `~/runs/x` was written to `./~/runs/x`)."""
    for key in keys:
        setattr(group, key, os.path.expanduser(getattr(group, key)))


def changed(group: object, *keys: str) -> list[str]:
    """The fields among `keys` of config dataclass `group` set away from their declared defaults."""
    fields = type(group).__dataclass_fields__
    return [k for k in keys if getattr(group, k) != fields[k].default]


def check_bounds(group: object, **bounds: str) -> None:
    """`check` each field of config dataclass `group` against its bound in turn: `every=">= 0 (0 = never)"` raises
    `eval.every: must be >= 0 (0 = never)` for an EvalConfig whose `every` is below 0."""
    prefix = type(group).__name__.removesuffix("Config").lower()
    for key, bound in bounds.items():
        op, limit = bound.split()[:2]
        check(_BOUNDS[op](getattr(group, key), float(limit)), f"{prefix}.{key}", f"must be {bound}")


_BOUNDS = {">": operator.gt, ">=": operator.ge}  # `check_bounds`' comparisons (another is a KeyError)
