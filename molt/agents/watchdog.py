"""Time limits on agent code, which runs on the rollouts' event loop: `within` awaits one agent call under a
timeout that says what ran past which limit (`paused` stops it while the model generates); `LoopWatchdog` stops
the run when agent code blocks that loop (a sync SDK client, `time.sleep`), which no asyncio timeout can interrupt.
Knows nothing of engines or trainers."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

from molt.errors import LIBRARY_DIRS, MOLT_DIR, RunFatalError, UserError

_WATCHDOGS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # event loop -> its LoopWatchdog
BLOCKED_SIGNAL = signal.SIGUSR1  # a watchdog's interrupt of the agent code blocking the loop (main thread only)
NOT_AGENT_CODE = (MOLT_DIR, "<", *LIBRARY_DIRS)
log = logging.getLogger("molt.agents")
IGNORED_S = 5.0  # past its time limit, how long agent code may take to honour the cancellation before a warning
SWALLOWED = "a bare `except:` or `except BaseException` catches asyncio.CancelledError; re-raise it"


class LoopBlockedError(UserError, RunFatalError):
    """Agent code blocked the rollouts' event loop past `rollout.step_timeout_s`: the run stops."""

    kind = "run stopped"


class _Interrupt(BaseException):
    """Raised by the watchdog's signal in the agent code blocking the loop. Not an `Exception`, so that an SDK's
    retry on any `Exception` passes it on; `within` turns it into a LoopBlockedError."""


async def within(
    timeout_s: float,
    awaitable,
    what: str,
    knob: str = "rollout.step_timeout_s",
    on_scope: Callable[[asyncio.Timeout], None] | None = None,
) -> Any:
    """`await awaitable`, or a TimeoutError saying what ran past which limit (asyncio's own has no message);
    `on_scope` gets its timeout scope, which `paused` stops while the model generates."""
    loop = asyncio.get_running_loop()
    dog = _WATCHDOGS.get(loop)
    if dog is not None and dog.stopped:  # agent code blocked this loop before: the run is stopping
        if asyncio.iscoroutine(awaitable):
            awaitable.close()  # never started
        raise LoopBlockedError(dog.stopped)
    late, timer = f"{what} did not finish within {timeout_s:g}s ({knob})", []

    def warn_if_ignored() -> None:  # agent code that catches the timeout's cancellation cannot be stopped: say so
        when = scope.when()
        if when is None or loop.time() < when + IGNORED_S:  # paused, or its deadline moved on: look again then
            timer.append(loop.call_at((loop.time() if when is None else when) + IGNORED_S, warn_if_ignored))
        else:
            log.warning("%s and ignored its cancellation: %s; it still runs", late, SWALLOWED)

    try:
        async with asyncio.timeout(timeout_s) as scope:
            if math.isfinite(timeout_s):
                timer.append(loop.call_at(scope.when() + IGNORED_S, warn_if_ignored))
            if on_scope is not None:
                on_scope(scope)
            result = await awaitable
    except TimeoutError as e:
        if not scope.expired():
            raise  # the agent's own timeout, with its own message
        raise TimeoutError(late) from e
    except _Interrupt as e:
        raise LoopBlockedError(str(e)) from e
    finally:
        for handle in timer:
            handle.cancel()
    if scope.expired():  # it caught the timeout's CancelledError and went on: a late result is not used
        raise TimeoutError(f"{late} and caught its cancellation: {SWALLOWED}")
    return result


@contextlib.contextmanager
def paused(scope: asyncio.Timeout | None) -> Iterator[None]:
    """`scope`'s deadline stopped inside the block and moved on by its duration after (a ChatAgent's budget does not
    count the time its model calls take: they wait for the engine, which trainer steps and other rollouts share)."""
    when = scope.when() if scope is not None and not scope.expired() else None
    if when is None:
        yield
        return
    loop = asyncio.get_running_loop()
    left = when - loop.time()
    scope.reschedule(None)
    try:
        yield
    finally:
        with contextlib.suppress(RuntimeError):  # the scope is finished (its call ended meanwhile)
            scope.reschedule(loop.time() + left)


def _agent_frame(frame: FrameType | None) -> FrameType | None:
    """The innermost frame of agent code (not Molt, the standard library or an installed package; else the
    frame `within` awaits) on the stack ending in `frame`; None when that stack runs no agent code."""
    inner = []
    while frame is not None and frame.f_code is not within.__code__:
        inner.append(frame)
        frame = frame.f_back
    if frame is None or not inner:
        return None
    return next((f for f in inner if not f.f_code.co_filename.startswith(NOT_AGENT_CODE)), inner[-1])


def _interrupt(signum: int, frame: FrameType | None) -> None:
    """The watchdog's signal: raise its message in the agent code still blocking this thread's loop."""
    loop = asyncio._get_running_loop()
    dog = _WATCHDOGS.get(loop) if loop is not None else None
    if dog is None or dog.message is None:
        return
    message, dog.message = dog.message, None
    if _agent_frame(frame) is not None and time.monotonic() - dog.beat > dog.limit_s:  # still blocked there
        dog.stopped = message  # later agent calls on this loop fail at once
        raise _Interrupt(message)


class LoopWatchdog:
    """Notices agent code that blocks the event loop for longer than `limit_s` (a sync OpenAI client waiting for
    the chat server on this very loop, `time.sleep`): a heartbeat on the loop, checked by a daemon thread. Only
    a stack through `within` counts (Molt's own work, e.g. a checkpoint save, may block longer). It then raises
    LoopBlockedError in that code by a signal (which also interrupts a blocking read or sleep) when the loop runs
    on the main thread, else logs the message."""

    def __init__(self, loop: asyncio.AbstractEventLoop, limit_s: float):
        self.loop, self.limit_s, self.every_s = loop, limit_s, min(0.5, limit_s / 4)
        self.thread_id, self.beat, self.message = threading.get_ident(), time.monotonic(), None
        self.stopped = ""  # the message, once agent code was interrupted
        main = threading.current_thread() is threading.main_thread()  # only there may a signal be handled
        if main and signal.getsignal(BLOCKED_SIGNAL) == signal.SIG_DFL:  # not another library's
            signal.signal(BLOCKED_SIGNAL, _interrupt)
        loop.call_soon(self._beat)
        threading.Thread(target=self._watch, name="molt-loop-watchdog", daemon=True).start()

    def _beat(self) -> None:
        self.beat = time.monotonic()
        self.loop.call_later(self.every_s, self._beat)

    def _watch(self) -> None:
        warned = None
        while not self.loop.is_closed():
            time.sleep(self.every_s)
            if not self.loop.is_running():
                self.beat = time.monotonic()  # stopped, not blocked
            beat = self.beat
            if time.monotonic() - beat <= self.limit_s or beat == warned:
                continue
            frame = _agent_frame(sys._current_frames().get(self.thread_id))
            if frame is None:
                continue
            warned, code = beat, frame.f_code
            message = (
                f"agent code blocks the event loop: {code.co_qualname} ({code.co_filename}:{frame.f_lineno}) has not "
                f"returned for {self.limit_s:g}s (rollout.step_timeout_s, at least 1s), so nothing else runs, not "
                "even the chat server it may be waiting for. Use async clients (ctx.openai() / AsyncOpenAI, "
                "ctx.anthropic()) or run blocking code with `await asyncio.to_thread(...)`"
            )
            if signal.getsignal(BLOCKED_SIGNAL) is _interrupt and self.thread_id == threading.main_thread().ident:
                self.message = message
                signal.pthread_kill(self.thread_id, BLOCKED_SIGNAL)
            else:
                log.error("%s; the run cannot go on until it returns", message)


def watch_loop(step_timeout_s: float, new_run: bool = False) -> None:
    """Start the running event loop's `LoopWatchdog` (once per loop), for blocks longer than `step_timeout_s` (at
    least 1 s: a sync step of a few ms is no hang, whatever the timeout). `new_run`: a run starts on a loop an earlier
    one watched (a notebook's): its limit holds, and the earlier run's blocked agent code no longer stops it."""
    loop, limit_s = asyncio.get_running_loop(), max(step_timeout_s, 1.0)
    if loop not in _WATCHDOGS:
        _WATCHDOGS[loop] = LoopWatchdog(loop, limit_s)
    elif new_run:
        dog = _WATCHDOGS[loop]
        dog.limit_s, dog.every_s, dog.stopped = limit_s, min(0.5, limit_s / 4), ""
