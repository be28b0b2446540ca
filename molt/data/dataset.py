"""A `DataConfig` -> (train rows, held-out rows): a dataset file or folder, or a built-in task.

Files and folders (`formats.py`) are mapped and checked row by row (`rows.py`) when the run starts, before any model is
built. Held-out rows come from `data.eval_path`, a `DatasetDict`'s test or validation split other than `data.split`, or
a seeded shuffled split of `data.path` (`data.num_eval` rows, at most 10%); a task's training rows leave out any
prompt it holds out."""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import random

from molt.data.formats import DataError, dataset_splits, read_located
from molt.data.rows import Row, parse_columns, prompt_rows
from molt.data.tasks import get_task

EVAL_SPLITS = ("test", "validation", "valid", "eval")


def file_rows(path: str, data, split: str = "") -> list[Row]:
    """Prompt rows of one dataset file or folder under `data`'s column mapping (checked by `DataConfig`) and
    system prompt."""
    with no_gc():  # millions of new dicts: the cyclic collector would scan them again and again (2x the time)
        located = read_located(path, split or data.split)
        return prompt_rows(located, parse_columns(data.columns), data.system_prompt, source=path)


@contextlib.contextmanager
def no_gc():
    """The cyclic garbage collector paused (rows hold no reference cycles: reference counting frees them)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _eval_split(path: str, train_split: str = "") -> str:
    """The held-out split of a DatasetDict folder other than `train_split` ("" if it has none, or `path` is not one)."""
    return next((s for s in EVAL_SPLITS if s in dataset_splits(path) and s != train_split), "")


def _eval_file_rows(data) -> list[Row]:
    return file_rows(data.eval_path, data, _eval_split(data.eval_path))  # file_rows: no split is data.split


def dataset_rows(data) -> tuple[list[Row], list[Row]]:
    """(train, held-out) rows for a `DataConfig` (see the module docstring)."""
    if not data.path:  # a task's generator repeats prompts (arithmetic has 900 sums): none held out trains
        rows = get_task(data.task).rows(data.num_train + data.num_eval, data.seed)
        held_out = _eval_file_rows(data) if data.eval_path else rows[: data.num_eval]
        prompts = {_prompt(r) for r in held_out}
        train = [r for r in rows[data.num_eval :] if _prompt(r) not in prompts]
        if not train:
            raise DataError(
                f"data.num_train: every one of the {data.num_train} generated rows of task {data.task!r} "
                "asks a prompt held out for eval: raise --data.num_train or lower --data.num_eval"
            )
        return train, held_out
    train = file_rows(data.path, data)
    if data.shuffle:
        random.Random(data.seed).shuffle(train)
    if data.eval_path:
        return train, _eval_file_rows(data)
    if split := _eval_split(data.path, data.split):
        return train, file_rows(data.path, data, split)
    num_eval = min(data.num_eval, len(train) // 10)
    return train[num_eval:], train[:num_eval]


def _prompt(row: Row) -> str:
    return json.dumps(row["messages"], sort_keys=True, default=repr)


def rows_digest(rows: list[dict]) -> list:
    """[count, digest of the first, middle and last rows]: rows appended, removed or edited move them (the rows are
    shuffled over the whole list when read)."""
    picks = [rows[i] for i in sorted({0, len(rows) // 2, len(rows) - 1})] if rows else []
    text = json.dumps(picks, sort_keys=True, default=lambda o: type(o).__name__)  # images: by kind only
    return [len(rows), hashlib.sha256(text.encode()).hexdigest()[:16]]


def has_demonstrations(rows: list[Row]) -> bool:
    """Whether every row's messages hold an assistant turn (something SFT can train on)."""
    return bool(rows) and all(any(m.get("role") == "assistant" for m in r["messages"]) for r in rows)
