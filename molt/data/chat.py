"""Chat messages: the shape every prompt row ends up in, validated with the row's file and line.

A malformed row is an error naming the file and line (or row); nothing is skipped silently."""

from __future__ import annotations

from typing import Any

from molt.data.formats import DataError

ROLES = {"system", "user", "assistant", "tool"}
PART_TYPES = ("text", "image", "image_url", "input_image")  # content parts the chat templates render


def check_messages(messages: Any, where: str, key: str = "messages") -> list[dict[str, Any]]:
    """`messages` if it is a non-empty list of chat messages with known roles, each with content (or tool calls), no
    user turn empty (as an empty `prompt` string is not a prompt); else a DataError naming `where`."""
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: field {key!r} must be a non-empty list")
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or msg.get("role") not in ROLES:
            raise DataError(f"{where}: {key}[{i}] needs a 'role' in {sorted(ROLES)}")
        content = msg.get("content")
        if not isinstance(content, str | list) and "tool_calls" not in msg:
            raise DataError(f"{where}: {key}[{i}] needs a 'content': a string or a list of parts")
        if msg["role"] == "user" and not (content.strip() if isinstance(content, str) else content):
            raise DataError(f"{where}: {key}[{i}].content is empty: a user turn needs text (or parts)")
        for j, part in enumerate(content if isinstance(content, list) else []):
            _check_part(part, f"{where}: {key}[{i}].content[{j}]")
        if "weight" in msg and (msg["role"] != "assistant" or msg["weight"] not in (0, 1)):
            raise DataError(f"{where}: {key}[{i}].weight: 0 (not trained) or 1, on assistant turns only")
    return messages


def _check_part(part: Any, where: str) -> None:
    """A content part the template renders, else a DataError (an unknown part would render as nothing)."""
    kind = part.get("type") if isinstance(part, dict) else None
    if kind not in PART_TYPES:
        raise DataError(f'{where}: a content part is a dict with "type" in {list(PART_TYPES)}, got {part!r:.80}')
    if kind == "text" and not isinstance(part.get("text"), str):
        raise DataError(f'{where}: a text part needs a "text" string')
