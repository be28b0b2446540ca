"""Chat datasets on disk: JSON lines with a `messages` list per row, validated line by line.

A malformed line is an error naming the file and line; nothing is skipped silently.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

ROLES = {"system", "user", "assistant", "tool"}


def _check_row(row: Any, where: str) -> dict[str, Any]:
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
    messages = row.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: field 'messages' must be a non-empty list")
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or msg.get("role") not in ROLES:
            raise ValueError(f"{where}: messages[{i}] needs a 'role' in {sorted(ROLES)}")
        if not isinstance(msg.get("content", ""), str | list) and "tool_calls" not in msg:
            raise ValueError(f"{where}: messages[{i}].content must be a string or a list of parts")
    return row


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a .jsonl chat file; blank lines are allowed, malformed ones are errors with file:line."""
    path = Path(path)
    rows = []
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: invalid JSON ({e.msg} at column {e.colno})") from None
            rows.append(_check_row(row, f"{path}:{lineno}"))
    if not rows:
        raise ValueError(f"{path}: no rows")
    return rows
