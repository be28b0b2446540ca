"""Raw dataset rows -> prompt rows: column mapping, `messages` or a `prompt` string, system prompt.

Every row leaves with a validated chat `messages` list (the prompt the agent is reset with); all its
other columns stay in the row for the reward function or agent (`answer`, `label`, tests, images).
A `prompt` string becomes one user turn (with the row's `images`/`image` column as image parts
before the text); with `messages`, the column fills their empty `{"type": "image"}` parts (TRL's vision format);
`data.system_prompt` is put first in any prompt without a system message."""

from __future__ import annotations

from typing import Any

from molt.data.chat import check_messages
from molt.data.formats import DataError, Located, Row


class LocatedRow(dict):
    """A row that remembers where it came from (`file:line` or `file row i`), for errors found later (too long)."""

    where: str = ""


def row_location(row: Row, fallback: str) -> str:
    """Where `row` came from, or `fallback` (e.g. `task calculator row 3`) for rows that were not read from a file."""
    return getattr(row, "where", "") or fallback


def parse_columns(spec: str) -> dict[str, str]:
    """`"prompt=question,answer=solution"` -> {"prompt": "question", "answer": "solution"} (target=source)."""
    mapping: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        target, sep, source = (s.strip() for s in item.partition("="))
        if not sep or not target or not source:
            raise ValueError(f"data.columns: {item!r} is not TARGET=SOURCE (e.g. prompt=question,answer=solution)")
        if target in mapping:
            raise ValueError(f"data.columns: {target!r} is mapped twice")
        mapping[target] = source
    return mapping


def _images(row: Row) -> list[Any]:
    """The row's `images` (or `image`) column: a list is its images; anything else (a path, bytes, an HF
    `{"bytes"/"path"}` dict, a PIL image) is one image, checked with the others at start-up."""
    images = row.get("images") if row.get("images") is not None else row.get("image")
    return [] if images is None else list(images) if isinstance(images, (list, tuple)) else [images]


def _prompt_messages(row: Row, where: str) -> list[dict[str, Any]]:
    if row.get("messages") is not None:
        return _place_images(check_messages(row["messages"], where), _images(row), where)
    prompt = row.get("prompt")
    if isinstance(prompt, list):  # conversational prompts (as TRL writes them)
        messages = _place_images(check_messages(prompt, where, key="prompt"), _images(row), where)
        return messages + _completion(row, where)
    if isinstance(prompt, str) and prompt.strip():
        images = _images(row)
        parts = [{"type": "image", "image": image} for image in images] + [{"type": "text", "text": prompt}]
        return [{"role": "user", "content": parts if images else prompt}, *_completion(row, where)]
    if "prompt" in row:
        raise DataError(f"{where}: field 'prompt' must be a non-empty string or a list of chat messages")
    raise DataError(
        f"{where}: no prompt: a row needs a 'messages' list or a 'prompt' string (columns: {sorted(row)}; "
        "map another column with --data.columns prompt=COLUMN)"
    )


def _completion(row: Row, where: str) -> list[dict[str, Any]]:
    """TRL's prompt-completion format: the `completion` column (text, or assistant messages) as the answer turns,
    which `molt sft` trains and an RL prompt leaves out."""
    completion = row.get("completion")
    if completion is None:
        return []
    if isinstance(completion, str):
        return [{"role": "assistant", "content": completion}]
    if not isinstance(completion, list):
        raise DataError(f"{where}: field 'completion' must be a string or a list of chat messages")
    return check_messages(completion, where, key="completion")


def _place_images(messages: list[dict[str, Any]], images: list[Any], where: str) -> list[dict[str, Any]]:
    """TRL's vision format: the `{"type": "image"}` parts that hold no image take the `images` column's, in order
    (copies; a DataError when the counts differ, so no image is dropped)."""
    messages = [m | {"content": [dict(p) for p in m["content"]]} if isinstance(m.get("content"), list) else m
                for m in messages]  # fmt: skip
    parts = [p for m in messages if isinstance(m.get("content"), list) for p in m["content"] if isinstance(p, dict)]
    empty = [p for p in parts if p.get("type") == "image" and p.get("image") is None]
    if len(empty) != len(images):
        raise DataError(f"{where}: the images column holds {len(images)} image(s) for the {len(empty)} image part(s) "
                        'without one ({"type": "image"}) in the messages: each needs its own')  # fmt: skip
    for part, image in zip(empty, images, strict=True):
        part["image"] = image
    return messages


def prompt_row(raw: Any, where: str, columns: dict[str, str], system_prompt: str = "") -> Row:
    """One raw row -> a row with `messages`; a bad row is a DataError naming `where` and the field."""
    if not isinstance(raw, dict):
        raise DataError(f"{where}: expected an object (a row of named columns), got {type(raw).__name__}")
    row = dict(raw)
    for target, source in columns.items():
        if source not in raw:
            raise DataError(f"{where}: no column {source!r} (data.columns {target}={source}); columns: {sorted(raw)}")
        row[target] = raw[source]
    if "prompt" in columns and "messages" not in columns:  # an explicit prompt mapping wins over a messages column
        row["messages"] = None
    messages = _prompt_messages(row, where)
    if system_prompt and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": system_prompt}, *messages]
    row["messages"] = messages
    located = LocatedRow(row)
    located.where = where
    return located


def prompt_rows(located: Located, columns: dict[str, str], system_prompt: str = "", source: str = "") -> list[Row]:
    """`prompt_row` over located raw rows; an empty dataset is an error naming `source`."""
    rows = [prompt_row(raw, where, columns, system_prompt) for where, raw in located]
    if not rows:
        raise DataError(f"{source}: no rows")
    return rows
