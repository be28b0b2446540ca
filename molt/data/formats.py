"""Dataset files on disk -> raw rows, each with where it came from (`file:line` or `file row i`).

Registered readers by format: JSON lines (`.jsonl`, or a `.json` that is not one array), a JSON
array (`.json`), Parquet (`.parquet`) and a `datasets` folder written by `save_to_disk` (Arrow
stream files listed in `state.json`; a `DatasetDict` folder gives its splits). A folder of `.jsonl`
/ `.parquet` files reads them all in name order. Parquet and Arrow are read with pyarrow, which is
also what the `datasets` library stores; nothing here interprets the rows (see `rows.py`)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from molt.errors import UserError
from molt.registry import Registry

Row = dict[str, Any]
Located = list[tuple[str, Any]]  # (where, raw row) pairs; `where` names the file and its 1-based line or row index

_SPACE = re.compile(r"[ \t\r\n]*")  # JSON's whitespace
READERS: Registry[Callable[[Path], Located]] = Registry("data format")  # fn(path) -> [(where, row)]


class DataError(UserError):
    """A dataset that cannot be used; the message names the file and line (or row) and the field."""

    kind = "data error"


def detect_format(path: str | Path) -> str:
    """The reader for `path` from its suffix or folder layout; an unknown kind is an error naming it."""
    path = Path(path)
    if path.is_dir():
        if (path / "dataset_dict.json").exists() or (path / "state.json").exists():
            return "datasets"
        if any(p.suffix.lower() in SHARDS for p in path.iterdir()):
            return "folder"
        raise DataError(f"{path}: a folder that is neither a `datasets` save_to_disk folder nor holds "
                        ".jsonl/.json/.parquet files")  # fmt: skip
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json", ".parquet"):
        return suffix[1:]
    raise DataError(f"{path}: unknown dataset format {suffix!r}; use .jsonl, .json, .parquet or a `datasets` folder")


def read_located(path: str | Path, split: str = "train") -> Located:
    """(where, row) for every row of a dataset file or folder; `split` picks a DatasetDict's split."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"{path}: no such file or folder")
    kind = detect_format(path)
    return READERS[kind](path, split) if kind in ("datasets", "folder") else READERS[kind](path)  # they hold splits


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8-sig")  # a byte-order mark, as some editors write, is dropped
    except UnicodeDecodeError as e:
        line = e.object[: e.start].count(b"\n") + 1
        raise DataError(f"{path}:{line}: not UTF-8 text ({e.reason} at byte {e.start}); is it a binary file?") from None


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object's dict; a key given twice is an error (json's default keeps the last, silently)."""
    out = dict(pairs)
    if len(out) < len(pairs):
        twice = next(k for i, (k, _) in enumerate(pairs) if any(k == other for other, _ in pairs[:i]))
        raise json.JSONDecodeError(f"key {twice!r} appears twice in one object", "", 0)
    return out


_DECODER = json.JSONDecoder(object_pairs_hook=_unique_keys)


def _what(error: json.JSONDecodeError) -> str:
    """The decoder's message with its column ("Unterminated string starting at" ends in its own "at")."""
    return f"{error.msg.removesuffix(' at')} at column {error.colno}" if error.doc else error.msg  # repeated key


@READERS.register("jsonl")
def read_json_lines(path: Path) -> Located:
    """One JSON value per non-blank line; a bad line is an error naming the file's own 1-based line."""
    out = []
    for lineno, line in enumerate(_read_text(path).split("\n"), 1):
        if not line.strip():
            continue
        try:
            out.append((f"{path}:{lineno}", _DECODER.decode(line)))
        except json.JSONDecodeError as e:
            hint = "; one JSON array is a .json file" if not out and line.lstrip().startswith("[") else ""
            raise DataError(f"{path}:{lineno}: invalid JSON ({_what(e)}){hint}") from None
    return out


@READERS.register("json")
def read_json(path: Path) -> Located:
    """A JSON array of rows (each located at the line where it starts), else JSON lines (as `to_json` writes)."""
    text = _read_text(path)
    start = len(text) - len(text.lstrip())
    if not text[start:].startswith("["):
        try:
            return read_json_lines(path)
        except DataError:
            if isinstance(whole := _json_or_none(text), dict):  # e.g. {"data": [...]}, pretty-printed
                keys = ", ".join(map(repr, list(whole)[:5]))
                raise DataError(f"{path}: one JSON object (keys {keys}), not rows: a .json dataset is an array "
                                "of rows or one row per line (JSON lines)") from None  # fmt: skip
            raise
    out, pos, line, counted = [], start + 1, 1, 0

    def line_at(at: int) -> int:  # counted on from the last row's start: linear in the file, not quadratic
        nonlocal line, counted
        line, counted = line + text.count("\n", counted, at), at
        return line

    while True:
        pos = _SPACE.match(text, pos).end()
        if pos < len(text) and text[pos] == "]":
            return out
        try:
            row, end = _DECODER.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{e.lineno if e.doc else line_at(pos)}: invalid JSON ({_what(e)})") from None
        out.append((f"{path}:{line_at(pos)}", row))
        pos = _SPACE.match(text, end).end()
        if pos < len(text) and text[pos] == ",":
            pos += 1
        elif pos >= len(text) or text[pos] != "]":
            raise DataError(f"{path}:{line_at(pos)}: invalid JSON (expected ',' or ']' after a row)")


def _json_or_none(text: str) -> Any:
    try:
        return _DECODER.decode(text)
    except ValueError:
        return None


def _arrow_rows(path: Path, table) -> Located:
    """A table's rows as the JSON objects they were written from. Arrow gives the objects in a column of lists (chat
    messages, tools, a completion's turns) the fields of all rows' objects, None where one had none: those None
    fields are left out (a row's own null there too: Arrow cannot tell them apart); other columns stay as read (a
    struct column such as `extra_info` keeps a row's nulls, and every row's objects hold all rows' keys)."""
    rows = table.to_pylist()
    return [(f"{path} row {i}", {k: _without_nulls(v) if isinstance(v, list) else v for k, v in row.items()})
            for i, row in enumerate(rows)]  # fmt: skip


def _without_nulls(value: Any) -> Any:
    """`value` with None-valued keys removed from every dict inside it."""
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    return [_without_nulls(v) for v in value] if isinstance(value, list) else value


@READERS.register("parquet")
def read_parquet(path: Path) -> Located:
    """Rows of a Parquet file (located by 0-based row index)."""
    import pyarrow.parquet as pq

    try:
        return _arrow_rows(path, pq.read_table(path))
    except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid / ArrowIOError
        raise DataError(f"{path}: cannot read as Parquet: {e}") from None


@READERS.register("datasets")
def read_datasets_folder(path: Path, split: str = "train") -> Located:
    """A `Dataset.save_to_disk` folder (its Arrow files in order), or one split of a `DatasetDict` folder."""
    import pyarrow as pa

    if (path / "dataset_dict.json").exists():
        splits = dataset_splits(path)
        if split not in splits:
            raise DataError(f"{path}: DatasetDict has no split {split!r}; splits: {splits}")
        return read_datasets_folder(path / split)
    out: Located = []
    for name in _index(path / "state.json", "_data_files", "filename"):
        file = path / name
        try:
            with pa.memory_map(str(file)) as source:
                out += _arrow_rows(file, pa.ipc.open_stream(source).read_all())
        except (OSError, ValueError) as e:  # missing, truncated, not Arrow (pyarrow's errors are these)
            raise DataError(f"{file}: cannot read this `datasets` Arrow file: {e}") from None
    return out


def _index(file: Path, key: str, field: str = "") -> list:
    """The list under `key` of a `datasets` JSON index file (each entry's `field`, if given); a missing or
    damaged one is an error naming it."""
    try:
        entries = json.loads(file.read_text())[key]
        return [entry[field] for entry in entries] if field else list(entries)
    except (OSError, ValueError, KeyError, TypeError) as e:
        problem = f"no {e}" if isinstance(e, KeyError) else str(e)
        raise DataError(f"{file}: not a `datasets` index ({type(e).__name__}: {problem}); re-save the dataset with "
                        "save_to_disk") from None  # fmt: skip


def dataset_splits(path: str | Path) -> list[str]:
    """Split names of a `DatasetDict` folder, or of a folder whose files are named by split (empty for anything
    else)."""
    index = Path(path) / "dataset_dict.json"
    if index.exists():
        return _index(index, "splits")
    return sorted(set(_file_splits(_entries(Path(path))).values())) if detect_format(path) == "folder" else []


SHARDS = (".jsonl", ".json", ".parquet")  # a folder's data files (any case)
SPLITS = ("train", "test", "validation", "valid", "val", "dev", "eval")  # file name prefixes that name a split


@READERS.register("folder")
def read_folder(path: Path, split: str = "train") -> Located:
    """The data files of a folder, in name order: where files are named by split (the Hub's
    `train-00000-of-00002.parquet`, `test.jsonl`), those of `split` only (a file named by none is `train`'s);
    anything else in it (a subfolder, a `.jsonl.gz`) is an error naming it, as its rows would not be read."""
    entries = _entries(path)
    if others := [p.name for p in entries if not (p.is_file() and p.suffix.lower() in SHARDS)]:
        raise DataError(f"{path}: holds {', '.join(others[:5])}, not .jsonl/.json/.parquet files: Molt reads none "
                        "of their rows; move them out, or point --data.path at the files' own folder")  # fmt: skip
    if split_of := _file_splits(entries):
        if split not in (named := sorted(set(split_of.values()))):
            raise DataError(f"{path}: its files are named by split ({', '.join(named)}), none {split!r}: set "
                            "--data.split")  # fmt: skip
        entries = [p for p in entries if split_of[p] == split]
    return [located for file in entries for located in READERS[file.suffix.lower()[1:]](file)]


def _entries(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if not p.name.startswith((".", "README", "LICENSE")))


def _file_splits(entries: list[Path]) -> dict[Path, str]:
    """Each file's split where any file's name starts with one (a file named by none is train's), else {}."""
    named = {p: m.group(1) for p in entries if (m := re.match(rf"({'|'.join(SPLITS)})(?:[-_.]|$)", p.stem.lower()))}
    return {p: named.get(p, "train") for p in entries} if named else {}
