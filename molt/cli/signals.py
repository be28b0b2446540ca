"""Signals and event loops for the commands: SIGTERM stops a command as Ctrl-C does (`on_sigterm`), a run's coroutine
is cancelled on its own loop by either (`interruptible`: its clean-up runs, then KeyboardInterrupt), and a coroutine
runs from synchronous code, on a worker thread when a loop already runs there (`run_sync`: a notebook's)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import signal
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import ParamSpec, TypeVar

P, R = ParamSpec("P"), TypeVar("R")


def catchable() -> list[int]:
    """SIGINT and SIGTERM, those this thread may handle: on the main thread, each not ignored (a background job
    ignores SIGINT) nor handled outside Python."""
    if threading.current_thread() is not threading.main_thread():
        return []
    return [s for s in (signal.SIGINT, signal.SIGTERM) if signal.getsignal(s) not in (signal.SIG_IGN, None)]


TERMINATED: list[int] = []  # SIGTERM arrived (the interrupt that follows is reported as it)


def on_sigterm(signum: int, frame) -> None:
    """SIGTERM stops the command as Ctrl-C does: through SIGINT's handler (asyncio's cancels the run, so its
    clean-up runs), or a KeyboardInterrupt where SIGINT is ignored (a background job's)."""
    TERMINATED.append(signum)
    if not callable(signal.getsignal(signal.SIGINT)):
        raise KeyboardInterrupt
    signal.raise_signal(signal.SIGINT)


def interruptible(fn: Callable[P, Awaitable[R]]) -> Callable[P, Awaitable[R]]:
    """`fn` run so that SIGINT (Ctrl-C, a notebook's interrupt) and SIGTERM (`timeout`, Slurm) cancel it on its event
    loop: its clean-up runs, then a KeyboardInterrupt is raised (SIGTERM noted in `TERMINATED`); a signal while the
    loop has not got to the previous one (code blocking it) raises at once, and a later one cancels the clean-up too.
    For the `catchable` signals. Raised from the first signal's
    handler instead, the interrupt landed wherever the process was: in torch's threads' teardown (an abort), or in a
    notebook cell awaiting the run (which then went on in the background)."""

    @functools.wraps(fn)
    async def run(*args: P.args, **kwargs: P.kwargs) -> R:
        loop, task = asyncio.get_running_loop(), asyncio.current_task()
        caught = catchable()
        before = {s: signal.getsignal(s) for s in caught}
        arrived: list[int] = []
        pending: list[bool] = []  # a cancel asked for that the loop has not run yet: it is blocked

        def cancel() -> None:
            pending.clear()
            task.cancel()  # (a no-op once the run returned: a signal at its very end keeps its result)

        def on_signal(signum: int, frame) -> None:
            arrived.append(signum)
            if pending or task.done():  # the loop never got to the first: out of the code blocking it
                raise KeyboardInterrupt
            pending.append(True)
            loop.call_soon_threadsafe(cancel)  # on the loop, between two steps of the run

        for each in caught:
            signal.signal(each, on_signal)
        try:
            return await fn(*args, **kwargs)
        except asyncio.CancelledError:
            if not arrived:
                raise
            task.uncancel()
            raise KeyboardInterrupt from None
        finally:
            TERMINATED.extend(s for s in arrived[:1] if s == signal.SIGTERM)
            for each in caught:
                signal.signal(each, before[each])

    return run


def _loop_running() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def run_sync(fn: Callable[P, Awaitable[R]], *args: P.args, **kwargs: P.kwargs) -> R:
    """`asyncio.run(fn(...))` from synchronous code: on this thread, or, when it already runs an event loop (a
    notebook cell), on a worker thread with its own loop (asyncio.run refuses to nest), where an interrupt or SIGTERM
    here cancels the run, waits for its clean-up (engines closed, rollouts cancelled), then re-raises."""
    if not _loop_running():
        return asyncio.run(fn(*args, **kwargs))
    running: Future[tuple[asyncio.AbstractEventLoop, asyncio.Task]] = Future()

    async def run() -> R:
        running.set_result((asyncio.get_running_loop(), asyncio.current_task()))
        return await fn(*args, **kwargs)

    # Ctrl-C and SIGTERM raise here while this call blocks the host's loop (asyncio.run's handler only cancels a task)
    previous = {s: signal.signal(s, signal.default_int_handler) for s in catchable()}
    pool, done = ThreadPoolExecutor(1, thread_name_prefix="molt-run"), None
    try:
        done = pool.submit(asyncio.run, run())
        try:
            return done.result()
        except KeyboardInterrupt:
            loop, task = running.result()
            with contextlib.suppress(RuntimeError):  # its loop is closed: the run just ended
                loop.call_soon_threadsafe(task.cancel)
            with contextlib.suppress(Exception, asyncio.CancelledError):  # a second Ctrl-C stops the wait
                done.result()
            raise
    finally:
        pool.shutdown(wait=done is None or done.done())  # a second Ctrl-C: the clean-up goes on without this call
        for each, handler in previous.items():
            signal.signal(each, handler)
