"""Blocking work awaited from an event loop on a daemon thread of its own (a foundation module: imports nothing of
Molt's). The loop stays free while it runs; a caller that stops waiting (a timeout, Ctrl-C) leaves the thread to
finish or to die with the process, holding nothing else up."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from typing import Any


def in_daemon_thread(fn: Callable[..., Any], *args: Any, name: str = "molt-worker") -> asyncio.Future:
    """`fn(*args)` on a new daemon thread, as a future of the running loop (its result or exception)."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if not future.done():  # not cancelled meanwhile
            future.set_exception(error) if error is not None else future.set_result(result)

    def run() -> None:
        try:
            result, error = fn(*args), None
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting caller
            result, error = None, e
        with contextlib.suppress(RuntimeError):  # the loop closed while the call ran
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future
