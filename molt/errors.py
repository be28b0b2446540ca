"""The error types every stage may raise (this module imports nothing): user mistakes, and the two kinds of
rollout error the loop treats specially (a dropped rollout, an error fatal to the run).

A `UserError` is something the user can fix: a config value, a data row, an agent or reward file, a
checkpoint path, a device, a port. The CLI prints its message as one line (`molt <command>: <kind>:
<message>`, exit code 2) and no traceback unless `MOLT_TRACEBACK=1`; any other exception is a bug in
Molt and is printed with its traceback. The message names the file and line (or the config key) and
says what to do. It is deliberately not a `ValueError`: tyro would catch that while building the
config from flags and draw its own box instead of the one line.
"""

from __future__ import annotations


class UserError(Exception):
    """A mistake the user can fix; `kind` is the word the CLI prints before the message."""

    kind = "error"


class RolloutDrop(Exception):
    """A rollout that cannot run as asked (its prompt or an image does not fit the context): the loop drops its
    group, counted under `drop_reason`, instead of counting a failed rollout."""

    drop_reason = "dropped"


class RunFatalError(Exception):
    """Raised inside a rollout but fatal to the run (an engine replica that is gone for good): the loop stops
    instead of counting a failed rollout."""

    fatal_to_run = True
