"""The error types every stage may raise (this module imports nothing of Molt): user mistakes, the two kinds of
rollout error the loop treats specially (a dropped rollout, an error fatal to the run), and a rollout error raised
in another process (an agent worker), with the words the loop logs for any of them.

A `UserError` is something the user can fix (config, data row, agent or reward file, checkpoint, device, port);
the CLI prints it as one line naming the file and line or config key (see `molt/cli/main.py`). It is deliberately
not a `ValueError`: tyro would catch that while building the config from flags and draw its own box instead."""

from __future__ import annotations

import site
import sysconfig
import traceback
from pathlib import Path

MOLT_DIR = str(Path(__file__).resolve().parent)
# the stdlib and installed packages (an SDK raising for the agent's call): not where the user's code failed
LIBRARY_DIRS = tuple(
    {sysconfig.get_path(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")} | {site.getusersitepackages()}
)


class UserError(Exception):
    """A mistake the user can fix; `kind` is the word the CLI prints before the message."""

    kind = "error"


class VariantFailure(UserError):
    """A variant of your own (`--algo.plugins`) failed at run time: its message names it, its flag and its file."""

    kind = "error in your variant"


class RolloutDrop(Exception):
    """A rollout that cannot run as asked (its prompt or an image does not fit the context): the loop drops its
    group, counted under `drop_reason`, instead of counting a failed rollout."""

    drop_reason = "dropped"


class RunFatalError(Exception):
    """Raised inside a rollout but fatal to the run (an engine replica that is gone for good): the loop stops
    instead of counting a failed rollout."""

    fatal_to_run = True


class AgentExit(RuntimeError):
    """Agent code raised what would end more than its rollout (`SystemExit`, an `asyncio.CancelledError` its task was
    not sent): its rollout fails with this instead, at the agent's line."""


class RemoteRolloutError(Exception):
    """A rollout that failed in an agent worker process: the worker's `describe_error` text, its traceback, and the
    (type, place) that names this kind of failure."""

    def __init__(self, what: str, traceback_text: str, kind: tuple[str, str]):
        super().__init__(what)
        self.traceback_text, self.kind = traceback_text, kind


MAX_MESSAGE = 2000  # characters of an error message in a failure line


def describe_error(error: BaseException) -> str:
    """`Type: message` (the type alone when the message is empty), plus where in user code it was raised: the
    innermost frame outside Molt, the stdlib and installed packages (else outside Molt only)."""
    if isinstance(error, RemoteRolloutError):
        return str(error)
    message = error_message(error)
    text = f"{type(error).__name__}: {message}" if message else type(error).__name__
    frames = traceback.extract_tb(error.__traceback__)
    frames = [f for f in frames if not f.filename.startswith((MOLT_DIR, "<")) and "/asyncio/" not in f.filename]
    frames = [f for f in frames if not f.filename.startswith(LIBRARY_DIRS)] or frames
    return text + (f" [{frames[-1].filename}:{frames[-1].lineno}]" if frames else "")


def error_message(error: BaseException) -> str:
    """`str(error)`, cut at MAX_MESSAGE characters (each failure is a log line), or a note when its `__str__` fails."""
    try:
        message = str(error)
    except Exception as e:  # noqa: BLE001 - agent code's exception class: describe it anyway
        return f"<its __str__ raised {type(e).__name__}>"
    return message if len(message) <= MAX_MESSAGE else f"{message[:MAX_MESSAGE]}... ({len(message)} characters)"


def error_kind(error: BaseException) -> tuple[str, str]:
    """(type name, `file:line` of the innermost frame): one kind of failure, logged with its traceback once."""
    if isinstance(error, RemoteRolloutError):
        return error.kind
    frames = traceback.extract_tb(error.__traceback__)
    return type(error).__name__, f"{frames[-1].filename}:{frames[-1].lineno}" if frames else ""


def error_traceback(error: BaseException) -> str:
    """The traceback to log for `error` (the worker's own for a `RemoteRolloutError`)."""
    if isinstance(error, RemoteRolloutError):
        return error.traceback_text
    return "".join(traceback.format_exception(error, chain=False))
