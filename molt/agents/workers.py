"""Rollouts in agent worker processes: agent code, its SDK clients and its chat server off the engine's process.

`AgentWorkers(setup, engine, n)` spawns `n` processes. Each calls `setup()` once (a `WorkerKit`: the tokenizer,
`make_env` and the chat server's options, built from the run's config as the main process builds its own) and
runs rollouts as `local_rollout` does in process, on its own event loop, against a `RemoteEngine`: the `Engine`
interface, its requests answered by the main process's engine over a socket pair. A rollout's Python (the SDK
building and parsing requests, templates, tool code) then no longer shares one GIL with the engine's thread, which
is what bounds a ChatAgent in one process (`benchmarks/chat_agent.py`).

The engine samples, stamps versions and computes log-probs in the main process as for any caller; the worker
captures its sessions exactly as in process and sends back the segments. A failing agent fails its rollout
(`RemoteRolloutError` with the worker's traceback), a dropped one stays dropped (`WorkerDrop` keeps the reason),
an error fatal to the run (`RunFatalError`, e.g. agent code blocking the worker's event loop past
`rollout.step_timeout_s`) stops the run as it would in process, and a worker that dies fails the rollouts it had
and is started again. An `info` value that does not pickle comes back as its repr (as the rollout dump writes it).

Wire: a 4-byte length and a pickle, each way (both ends are Molt's own processes). Both ends are a `_Peer`: a call
is `(kind, key, value)`, answered by `reply` / `error` (an exception) and ended early by `cancel`; `delta` carries a
streamed call's tokens. main -> worker: `setup` (first; `ready` answers it), `run` (a rollout). worker -> main:
`generate`, `abort` (engine calls)."""

from __future__ import annotations

import asyncio
import faulthandler
import functools
import itertools
import logging
import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from molt.agents.chat.agent import ChatRunner, local_rollout
from molt.agents.runner import EpisodeLimits
from molt.data.trajectory import Trajectory
from molt.engine.interface import Completion, Engine, SamplingParams
from molt.errors import RemoteRolloutError, RolloutDrop, RunFatalError, describe_error, error_kind, error_traceback

log = logging.getLogger("molt.agents")
HEADER = struct.Struct("!I")
WORKER_MAIN = "from molt.agents.workers import worker_main; worker_main()"  # `python -c` of a worker, then its FD


@dataclass
class WorkerKit:
    """What a worker's `setup()` builds once from the run's config: tokenizer, agent factory, chat options, cleanup."""

    tokenizer: Any
    make_env: Callable[[], Any]
    chat_options: dict[str, Any] = field(default_factory=dict)
    close: Callable[[], None] = lambda: None


class WorkerDrop(RolloutDrop):
    """A rollout a worker dropped (e.g. its prompt over the context): counted under the worker's reason."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.drop_reason = reason


async def _receive(reader: asyncio.StreamReader) -> tuple:
    (size,) = HEADER.unpack(await reader.readexactly(HEADER.size))
    return pickle.loads(await reader.readexactly(size))


def _pickles(value: Any) -> bool:
    """Whether `value` survives pickling (an exception, an `info` value: a lambda or an SDK client does not)."""
    try:
        pickle.loads(pickle.dumps(value))
        return True
    except Exception:  # noqa: BLE001 - any value that does not pickle
        return False


def _portable(result: tuple[str, Any]) -> tuple[str, Any]:
    """A worker's `done` rollout with each `info` value that does not pickle replaced by its repr (the rest of a
    rollout, and every answer of the main process, always pickles)."""
    outcome, segments = result
    for segment in segments:
        segment.info = {k: v if _pickles(v) else repr(v) for k, v in segment.info.items()}
    return outcome, segments


class _Peer:
    """One end of the socket pair: its calls to the other end (`waiting`: futures, with their `delta` callback) and
    the other end's calls to it (`serving`: tasks running `answer(kind, key, value)`)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, process=None):
        self.reader, self.writer, self.process = reader, writer, process  # process: the worker's (main process)
        self.waiting: dict[int, tuple[asyncio.Future, Callable[[Any], None] | None]] = {}
        self.serving: dict[int, asyncio.Task] = {}
        self.ids = itertools.count()
        self.reading: asyncio.Task | None = None
        self.outbox: list[bytes] = []

    def send(self, message: tuple, now: bool = False) -> None:
        """Send `message` with the others of this loop iteration, in one write (a system call each way); `now`:
        at once, with those before it."""
        if self.writer.is_closing():
            return  # the other side is gone; its reader reports that
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        if not self.outbox and not now:
            asyncio.get_running_loop().call_soon(self._flush)
        self.outbox += (HEADER.pack(len(data)), data)
        if now:
            self._flush()

    def _flush(self) -> None:
        data, self.outbox = b"".join(self.outbox), []
        if data and not self.writer.is_closing():
            self.writer.write(data)

    async def call(self, kind: str, value: Any, on_delta: Callable[[Any], None] | None = None) -> Any:
        """The other end's answer to `(kind, value)`; cancelling the call cancels it there."""
        key, reply = next(self.ids), asyncio.get_running_loop().create_future()
        self.waiting[key] = (reply, on_delta)
        self.send((kind, key, value))
        try:
            return await reply
        except asyncio.CancelledError:
            self.send(("cancel", key, None))
            raise
        finally:
            self.waiting.pop(key, None)

    async def serve(self, answer: Callable[[str, int, Any], Awaitable[Any]]) -> None:
        """Settle this end's calls and answer the other end's, until it hangs up (then its calls are cancelled)."""
        try:
            while True:
                kind, key, value = await _receive(self.reader)
                if kind == "cancel":
                    if (task := self.serving.pop(key, None)) is not None:
                        task.cancel()
                elif kind not in ("reply", "error", "delta"):
                    self.serving[key] = asyncio.create_task(self._answer(answer, kind, key, value))
                elif (waiting := self.waiting.get(key)) is None or waiting[0].done():
                    continue  # cancelled meanwhile
                elif kind == "delta":
                    waiting[1](value)
                elif kind == "reply":
                    waiting[0].set_result(value)
                else:
                    waiting[0].set_exception(value)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            for task in list(self.serving.values()):
                task.cancel()

    async def _answer(self, answer, kind: str, key: int, value: Any) -> None:
        now = self.process is None  # a worker sends a rollout's outcome at once: a crash right after keeps it
        try:
            result = await answer(kind, key, value)
            try:
                self.send(("reply", key, result), now)
            except (pickle.PicklingError, AttributeError, TypeError):  # pickled once; these values only on failure
                self.send(("reply", key, _portable(result)), now)
        except Exception as e:  # noqa: BLE001 - the caller gets it, as it would in process
            self.send(("error", key, e if _pickles(e) else RuntimeError(describe_error(e))), now)  # else its words
        finally:
            self.serving.pop(key, None)


# ---- main process --------------------------------------------------------------------------------------------
class AgentWorkers:
    """`run(row, sampling, limits, **ids)` -> a rollout's segments, run in the least busy of `n` worker processes."""

    def __init__(self, setup: Callable[[], WorkerKit], engine: Engine, n: int):
        self.setup, self.engine, self.n = setup, engine, n
        self.workers: list[_Peer] = []  # running ones; a lost worker leaves until its replacement joins
        self.joined = asyncio.Event()
        self.closing, self.fatal = False, None

    async def start(self) -> AgentWorkers:
        """Spawn the workers; if one cannot start, stop the others and raise why."""
        started = await asyncio.gather(*(self._spawn(i) for i in range(self.n)), return_exceptions=True)
        self.workers = [w for w in started if isinstance(w, _Peer)]
        failed = next((e for e in started if isinstance(e, BaseException)), None)
        if failed is not None:
            await self.close()
            raise failed
        return self

    async def _spawn(self, index: int) -> _Peer:
        """A fresh interpreter (no forked copy of the engine's threads; no re-run of the caller's `__main__`) on one
        end of a socket pair, sent `setup` and the engine's vision spec; returned once `setup()` has returned."""
        ours, theirs = socket.socketpair()
        env = os.environ | {"PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}  # the modules this process sees
        command = [sys.executable, "-c", WORKER_MAIN, str(theirs.fileno())]
        process = subprocess.Popen(command, pass_fds=[theirs.fileno()], env=env)
        theirs.close()
        try:
            worker = _Peer(*await asyncio.open_unix_connection(sock=ours), process)
            info = {"vision": self.engine.vision, "image_token_id": self.engine.image_token_id}
            worker.send(("setup", index, (self.setup, info)))
            await _receive(worker.reader)  # "ready": setup() returned
        except (asyncio.IncompleteReadError, ConnectionError):
            code = await asyncio.to_thread(process.wait)
            error = f"agent worker {index} exited (code {code}) before it was ready; its error is above"
            raise RunFatalError(error) from None
        except BaseException:  # cancelled while it starts (the run is stopping): it must not outlive the run
            process.kill()
            process.wait()
            raise
        worker.reading = asyncio.create_task(self._serve(worker, index))
        return worker

    async def run(self, row: dict, sampling: SamplingParams, limits: EpisodeLimits, **kw: Any) -> list[Trajectory]:
        """One rollout in a worker; raises what the rollout raised there (as `RemoteRolloutError` / `WorkerDrop`)."""
        while not self.workers and self.fatal is None:
            self.joined.clear()
            await self.joined.wait()
        if self.fatal is not None:
            raise self.fatal
        worker = min(self.workers, key=lambda w: len(w.waiting))
        outcome, value = await worker.call("run", (row, sampling, limits, kw))
        if outcome != "done":
            raise (WorkerDrop if outcome == "dropped" else RemoteRolloutError)(*value)
        return value

    async def _serve(self, worker: _Peer, index: int) -> None:
        """Answer one worker's engine calls and settle its rollouts, until it exits (then start another)."""
        try:
            await worker.serve(functools.partial(self._answer, worker))
        finally:
            await self._lost(worker, index)

    async def _answer(self, worker: _Peer, kind: str, call: int, value: Any) -> Any:
        """A worker's engine call: `abort`, or `generate` (its tokens streamed back as `delta`s if asked)."""
        if kind == "abort":
            return await self.engine.abort(value)
        prompt, sampling, kw, streamed = value
        if not streamed:
            return await self.engine.generate_group(prompt, sampling, **kw)
        return await self.engine.generate_streamed(prompt, sampling, lambda d: worker.send(("delta", call, d)), **kw)

    async def _lost(self, worker: _Peer, index: int) -> None:
        """A worker's connection closed: its engine calls are cancelled (by `serve`), its rollouts failed; unless
        closing, a new worker takes its place."""
        self.workers = [w for w in self.workers if w is not worker]
        worker.writer.close()
        if self.closing:
            return
        code = await asyncio.to_thread(worker.process.wait)
        jobs = [job for job, _ in worker.waiting.values() if not job.done()]
        why = f"agent worker {index} exited (code {code}) during this rollout, one of {len(jobs)} it ran then"
        crash = code in (-signal.SIGSEGV, -signal.SIGBUS, -signal.SIGFPE, -signal.SIGILL, -signal.SIGABRT)
        stack = "its Python stack at the crash is on stderr above" if crash else ""
        for job in jobs:
            job.set_exception(RemoteRolloutError(why, stack, ("worker exit", str(code))))
        log.warning("agent worker %d exited with code %s%s; starting another", index, code,
                    " (its stack is above)" if crash else "")  # fmt: skip
        try:
            self.workers.append(await self._spawn(index))
        except RunFatalError as e:  # it cannot start: the run stops
            self.fatal = e
        self.joined.set()

    async def close(self) -> None:
        """Stop the workers (their rollouts in flight are cancelled) and wait for them to exit."""
        self.closing = True
        for worker in self.workers:
            worker.writer.close()
        for worker in self.workers:
            try:
                await asyncio.to_thread(worker.process.wait, 10)
            except subprocess.TimeoutExpired:
                worker.process.kill()
            worker.reading.cancel()


# ---- worker process ------------------------------------------------------------------------------------------
class RemoteEngine(Engine):
    """The main process's engine as an agent worker sees it: generation only, over the socket."""

    def __init__(self, peer: _Peer, info: dict[str, Any]):
        self.peer, self.vision, self.image_token_id = peer, info["vision"], info["image_token_id"]

    async def generate_group(self, prompt_token_ids, sampling=None, *, request_id=None, session_id=None, images=None):
        options = {"request_id": request_id, "session_id": session_id, "images": images}
        return await self.generate_streamed(prompt_token_ids, sampling, None, **options)

    async def generate_streamed(
        self, prompt_token_ids, sampling, on_tokens, *, request_id=None, session_id=None, images=None
    ) -> list[Completion]:
        """A `generate` call (`on_tokens` None: `generate_group`'s); cancelling it makes the main process abort it."""
        kw = {"request_id": request_id, "session_id": session_id} | ({"images": list(images)} if images else {})
        value = (list(prompt_token_ids), sampling or SamplingParams(), kw, on_tokens is not None)
        return await self.peer.call("generate", value, on_tokens)

    async def abort(self, request_id: str) -> bool:
        return await self.peer.call("abort", request_id)

    async def update_weights(self, *args, **kwargs) -> None:
        raise NotImplementedError("an agent worker's engine only generates: the main process syncs (and pauses) it")

    pause = resume = update_weights

    def num_pending(self) -> int:
        return len(self.peer.waiting)


def worker_main() -> None:
    """A worker process (`python -c ... FD`): the socket's first message is `setup` and the engine's vision spec;
    then rollouts, with one torch thread (agents do not compute), until the main process hangs up. Ctrl-C is the
    main process's to handle: a worker ignores it and exits when the main process closes the socket."""
    import torch

    faulthandler.enable()  # a segfault in agent code (a C extension) prints its Python stack to stderr
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(1)
    asyncio.run(_work(socket.socket(fileno=int(sys.argv[1]))))


async def _work(sock: socket.socket) -> None:
    peer = _Peer(*await asyncio.open_unix_connection(sock=sock))
    try:
        _, _, (setup, info) = await _receive(peer.reader)
    except (asyncio.IncompleteReadError, ConnectionError):
        return  # the main process hung up before sending setup
    kit = setup()  # nothing else runs on this loop yet
    peer.send(("ready", 0, None))
    engine = RemoteEngine(peer, info)
    chat = ChatRunner(engine, kit.tokenizer, **kit.chat_options)
    run_one = local_rollout(chat, engine, kit.tokenizer, kit.make_env, interrupts_ignored=True)  # SIGINT: ignored

    async def rollout(kind: str, job: int, value: tuple) -> tuple[str, Any]:
        """A `run` call: (`done`, segments), (`dropped`, ...) or (`failed`, ...); an error fatal to the run (e.g.
        agent code blocked this loop: `watchdog.LoopWatchdog`) is raised, to stop it."""
        row, sampling, limits, kw = value
        try:
            segments = await run_one(row, sampling, limits, **kw)
        except RolloutDrop as e:
            return "dropped", (e.drop_reason, str(e))
        except RunFatalError:
            raise
        except Exception as e:  # noqa: BLE001 - the agent's failure, reported to the loop
            return "failed", (describe_error(e), error_traceback(e), error_kind(e))
        return "done", segments  # an info value that does not pickle comes back as its repr (`_portable`)

    try:
        await peer.serve(rollout)  # the main process closed the connection: stop
    finally:
        await asyncio.gather(*peer.serving.values(), return_exceptions=True)
        await chat.close()
        kit.close()
