"""The configuration's error (`ConfigError`, naming the offending key) and `check`, which every group raises it by."""

from __future__ import annotations

from molt.errors import UserError


class ConfigError(UserError):
    """A configuration value or combination that cannot run; the message names the key."""

    kind = "config error"


def check(ok: bool, key: str, message: str) -> None:
    """Raise ConfigError naming `key` unless `ok`."""
    if not ok:
        raise ConfigError(f"{key}: {message}")
