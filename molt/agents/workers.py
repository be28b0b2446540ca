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
and is started again. Training's per-step `reward/<name>` metrics are fed with the named rewards the workers'
reward functions scored (sent back with the segments, as in process: an agent's own `info["reward/..."]` is not
one), and an `info` value that does not pickle comes back as its repr (as the rollout dump writes it).

Wire: a 4-byte length and a pickle, each way (both ends are Molt's own processes). main -> worker: `setup`
(first), `run` (a rollout), `stop` (cancel it), `reply` / `delta` / `error` (an engine call's result, streamed
tokens, failure). worker -> main: `ready` (setup done), `generate`, `cancel`, `abort` (engine calls), `done` /
`failed` / `dropped` / `fatal` (a rollout's outcome)."""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from molt.agents.chat.agent import ChatRunner, local_rollout
from molt.agents.reward_fn import EVALUATING, WORKER_REWARDS, RewardLog
from molt.agents.runner import EpisodeLimits
from molt.data.trajectory import Trajectory
from molt.engine.interface import Completion, Engine, SamplingParams, TokenDelta
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


def _send(writer: asyncio.StreamWriter, message: tuple) -> None:
    if writer.is_closing():
        return  # the other side is gone; its reader reports that
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    writer.write(HEADER.pack(len(data)) + data)


async def _receive(reader: asyncio.StreamReader) -> tuple:
    (size,) = HEADER.unpack(await reader.readexactly(HEADER.size))
    return pickle.loads(await reader.readexactly(size))


def _portable(error: BaseException) -> BaseException:
    """`error` if it pickles (e.g. a ContextLengthError the worker's server turns into a 400), else its words."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001 - any unpicklable exception
        return RuntimeError(describe_error(error))


def _picklable(segments: list[Trajectory]) -> list[Trajectory]:
    """`segments` with each `info` value that does not pickle (a lambda, an SDK client) replaced by its repr."""
    for segment in segments:
        for key, value in segment.info.items():
            try:
                pickle.dumps(value)
            except Exception:  # noqa: BLE001 - any value that does not pickle
                segment.info[key] = repr(value)
    return segments


# ---- main process --------------------------------------------------------------------------------------------
@dataclass(eq=False)
class _Worker:
    process: subprocess.Popen
    writer: asyncio.StreamWriter
    jobs: dict[int, asyncio.Future] = field(default_factory=dict)
    calls: dict[int, asyncio.Task] = field(default_factory=dict)
    reading: asyncio.Task | None = None


class AgentWorkers:
    """`run(row, sampling, limits, **ids)` -> a rollout's segments, run in the least busy of `n` worker processes."""

    def __init__(self, setup: Callable[[], WorkerKit], engine: Engine, n: int, reward_log: RewardLog | None = None):
        self.setup, self.engine, self.n, self.reward_log = setup, engine, n, reward_log
        self.workers: list[_Worker] = []  # running ones; a lost worker leaves until its replacement joins
        self.joined = asyncio.Event()
        self.job_ids = itertools.count()
        self.closing, self.fatal = False, None

    async def start(self) -> AgentWorkers:
        """Spawn the workers; if one cannot start, stop the others and raise why."""
        started = await asyncio.gather(*(self._spawn(i) for i in range(self.n)), return_exceptions=True)
        self.workers = [w for w in started if isinstance(w, _Worker)]
        failed = next((e for e in started if isinstance(e, BaseException)), None)
        if failed is not None:
            await self.close()
            raise failed
        return self

    async def _spawn(self, index: int) -> _Worker:
        """A fresh interpreter (no forked copy of the engine's threads; no re-run of the caller's `__main__`) on one
        end of a socket pair, sent `setup` and the engine's vision spec; returned once `setup()` has returned."""
        ours, theirs = socket.socketpair()
        env = os.environ | {"PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}  # the modules this process sees
        command = [sys.executable, "-c", WORKER_MAIN, str(theirs.fileno())]
        process = subprocess.Popen(command, pass_fds=[theirs.fileno()], env=env)
        theirs.close()
        reader, writer = await asyncio.open_unix_connection(sock=ours)
        info = {"vision": self.engine.vision, "image_token_id": self.engine.image_token_id}
        _send(writer, ("setup", index, (self.setup, info)))
        try:
            await _receive(reader)  # "ready": setup() returned
        except (asyncio.IncompleteReadError, ConnectionError):
            code = await asyncio.to_thread(process.wait)
            error = f"agent worker {index} exited (code {code}) before it was ready; its error is above"
            raise RunFatalError(error) from None
        worker = _Worker(process, writer)
        worker.reading = asyncio.create_task(self._serve(worker, reader, index))
        return worker

    async def run(self, row: dict, sampling: SamplingParams, limits: EpisodeLimits, **kw: Any) -> list[Trajectory]:
        """One rollout in a worker; raises what the rollout raised there (as `RemoteRolloutError` / `WorkerDrop`)."""
        while not self.workers and self.fatal is None:
            self.joined.clear()
            await self.joined.wait()
        if self.fatal is not None:
            raise self.fatal
        worker = min(self.workers, key=lambda w: len(w.jobs))
        job, done = next(self.job_ids), asyncio.get_running_loop().create_future()
        worker.jobs[job] = done
        _send(worker.writer, ("run", job, (row, sampling, limits, kw, EVALUATING.get())))
        try:
            segments, rewards = await done
        except asyncio.CancelledError:
            _send(worker.writer, ("stop", job, None))
            raise
        finally:
            worker.jobs.pop(job, None)
        for named in rewards if self.reward_log is not None else ():
            self.reward_log.add(named)
        return segments

    async def _serve(self, worker: _Worker, reader: asyncio.StreamReader, index: int) -> None:
        """Answer one worker's engine calls and settle its rollouts, until it exits (then start another)."""
        try:
            while True:
                kind, key, value = await _receive(reader)
                if kind == "generate":
                    worker.calls[key] = asyncio.create_task(self._generate(worker, key, *value))
                elif kind == "cancel":
                    if (call := worker.calls.pop(key, None)) is not None:
                        call.cancel()
                elif kind == "abort":
                    await self.engine.abort(key)
                elif (job := worker.jobs.get(key)) is None or job.done():
                    continue  # cancelled meanwhile
                elif kind == "done":
                    job.set_result(value)
                elif kind == "fatal":
                    job.set_exception(value)  # the worker's RunFatalError itself
                else:
                    job.set_exception((WorkerDrop if kind == "dropped" else RemoteRolloutError)(*value))
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            await self._lost(worker, index)

    async def _generate(self, worker: _Worker, call: int, prompt: list[int], sampling, kw: dict, streamed: bool):
        try:
            if streamed:
                stream = lambda delta: _send(worker.writer, ("delta", call, delta))  # noqa: E731
                result: list[Completion] = await self.engine.generate_streamed(prompt, sampling, stream, **kw)
            else:
                result = await self.engine.generate_group(prompt, sampling, **kw)
            _send(worker.writer, ("reply", call, result))
        except Exception as e:  # noqa: BLE001 - the worker's caller gets it, as it would in process
            _send(worker.writer, ("error", call, _portable(e)))
        finally:
            worker.calls.pop(call, None)

    async def _lost(self, worker: _Worker, index: int) -> None:
        """A worker's connection closed: its engine calls are cancelled, its rollouts failed; unless closing, a
        new worker takes its place."""
        self.workers = [w for w in self.workers if w is not worker]
        for call in list(worker.calls.values()):
            call.cancel()
        worker.writer.close()
        if self.closing:
            return
        code = await asyncio.to_thread(worker.process.wait)
        error = RemoteRolloutError(
            f"agent worker {index} exited (code {code}) during this rollout", "", ("worker exit", str(code))
        )
        for job in worker.jobs.values():
            if not job.done():
                job.set_exception(error)
        log.warning("agent worker %d exited with code %s; starting another", index, code)
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
            if worker.reading is not None:
                worker.reading.cancel()


# ---- worker process ------------------------------------------------------------------------------------------
class RemoteEngine(Engine):
    """The main process's engine as an agent worker sees it: generation only, over the socket."""

    def __init__(self, writer: asyncio.StreamWriter, info: dict[str, Any]):
        self.writer, self.vision, self.image_token_id = writer, info["vision"], info["image_token_id"]
        self.calls: dict[int, tuple[asyncio.Future, Callable[[TokenDelta], None] | None]] = {}
        self.call_ids = itertools.count()

    async def generate_group(self, prompt_token_ids, sampling=None, *, request_id=None, session_id=None, images=None):
        return await self._call(prompt_token_ids, sampling, request_id, session_id, images, None)

    async def generate_streamed(
        self, prompt_token_ids, sampling, on_tokens, *, request_id=None, session_id=None, images=None
    ) -> list[Completion]:
        return await self._call(prompt_token_ids, sampling, request_id, session_id, images, on_tokens)

    async def _call(self, prompt, sampling, request_id, session_id, images, on_tokens) -> list[Completion]:
        call, reply = next(self.call_ids), asyncio.get_running_loop().create_future()
        self.calls[call] = (reply, on_tokens)
        kw = {"request_id": request_id, "session_id": session_id} | ({"images": list(images)} if images else {})
        _send(self.writer, ("generate", call, (list(prompt), sampling or SamplingParams(), kw, on_tokens is not None)))
        try:
            return await reply
        except asyncio.CancelledError:
            _send(self.writer, ("cancel", call, None))  # the main process aborts the request
            raise
        finally:
            self.calls.pop(call, None)

    def deliver(self, kind: str, call: int, value: Any) -> None:
        """A message from the main process about engine call `call`."""
        reply, on_tokens = self.calls.get(call, (None, None))
        if reply is None or reply.done():
            return
        if kind == "delta":
            on_tokens(value)
        elif kind == "reply":
            reply.set_result(value)
        else:
            reply.set_exception(value)

    async def abort(self, request_id: str) -> bool:
        _send(self.writer, ("abort", request_id, None))
        return True

    async def update_weights(self, weights, version, mode="interrupt") -> None:
        raise NotImplementedError("an agent worker's engine only generates; weights are synced in the main process")

    async def pause(self) -> None:
        raise NotImplementedError("an agent worker's engine only generates")

    async def resume(self) -> None:
        raise NotImplementedError("an agent worker's engine only generates")

    def num_pending(self) -> int:
        return len(self.calls)


def worker_main() -> None:
    """A worker process (`python -c ... FD`): the socket's first message is `setup` and the engine's vision spec;
    then rollouts, with one torch thread (agents do not compute), until the main process hangs up. Ctrl-C is the
    main process's to handle: a worker ignores it and exits when the main process closes the socket."""
    import torch

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(1)
    asyncio.run(_work(socket.socket(fileno=int(sys.argv[1]))))


async def _work(sock: socket.socket) -> None:
    reader, writer = await asyncio.open_unix_connection(sock=sock)
    try:
        _, _, (setup, info) = await _receive(reader)
    except (asyncio.IncompleteReadError, ConnectionError):
        return  # the main process hung up before sending setup
    kit = setup()  # nothing else runs on this loop yet
    _send(writer, ("ready", 0, None))
    engine = RemoteEngine(writer, info)
    chat = ChatRunner(engine, kit.tokenizer, **kit.chat_options)
    run_one = local_rollout(chat, engine, kit.tokenizer, kit.make_env)
    jobs: dict[int, asyncio.Task] = {}

    async def rollout(job: int, row, sampling, limits, kw: dict, evaluating: bool) -> None:
        EVALUATING.set(evaluating)  # this task's own context
        rewards: list[dict[str, float]] = []
        WORKER_REWARDS.set(rewards)  # what its reward function scores, for the main process's reward log
        try:
            segments = await run_one(row, sampling, limits, **kw)
            try:
                _send(writer, ("done", job, (segments, rewards)))
            except (pickle.PicklingError, AttributeError, TypeError):  # an info value that does not pickle
                _send(writer, ("done", job, (_picklable(segments), rewards)))
        except RolloutDrop as e:
            _send(writer, ("dropped", job, (e.drop_reason, str(e))))
        except RunFatalError as e:  # e.g. agent code blocked this loop (watchdog.LoopWatchdog): the run stops
            _send(writer, ("fatal", job, _portable(e)))
        except Exception as e:  # noqa: BLE001 - the agent's failure, reported to the loop
            _send(writer, ("failed", job, (describe_error(e), error_traceback(e), error_kind(e))))
        finally:
            jobs.pop(job, None)

    try:
        while True:
            kind, key, value = await _receive(reader)
            if kind == "run":
                jobs[key] = asyncio.create_task(rollout(key, *value))
            elif kind == "stop":
                if (task := jobs.pop(key, None)) is not None:
                    task.cancel()
            else:
                engine.deliver(kind, key, value)
    except (asyncio.IncompleteReadError, ConnectionError):
        pass  # the main process closed the connection: stop
    finally:
        for task in list(jobs.values()):
            task.cancel()
        await asyncio.gather(*jobs.values(), return_exceptions=True)
        await chat.close()
        kit.close()
