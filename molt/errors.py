"""The error types every stage may raise (this module imports nothing): user mistakes, and the two kinds of
rollout error the loop treats specially (a dropped rollout, an error fatal to the run).

A `UserError` is something the user can fix (config, data row, agent or reward file, checkpoint, device, port);
the CLI prints it as one line naming the file and line or config key (see `molt/cli/main.py`). It is deliberately
not a `ValueError`: tyro would catch that while building the config from flags and draw its own box instead.
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
