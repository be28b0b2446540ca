"""The configuration's error (`ConfigError`, naming the offending key) and the two helpers every group checks by."""

from __future__ import annotations

from molt.errors import UserError


class ConfigError(UserError):
    """A configuration value or combination that cannot run; the message names the key."""

    kind = "config error"


def check(ok: bool, key: str, message: str) -> None:
    """Raise ConfigError naming `key` unless `ok`."""
    if not ok:
        raise ConfigError(f"{key}: {message}")


def changed(group: object, *keys: str) -> list[str]:
    """The fields among `keys` of config dataclass `group` set away from their declared defaults."""
    fields = type(group).__dataclass_fields__
    return [k for k in keys if getattr(group, k) != fields[k].default]
