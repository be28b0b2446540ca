"""Engine replicas as Ray actors, and the driver-side `RemoteEngine` that is one `Engine` to the loop.

`EngineActor` holds an engine from the one factory in its own process (an async actor: many requests in flight);
`RemoteEngine` forwards the `Engine` interface to it and counts the replica's requests. Weights travel as
`ChunkedWeights` (object-store chunks of at most `runtime.sync_chunk_mb`); a sync missing any engine parameter
is an error listing them. A dead replica is restarted by Ray (up to `runtime.engine_restarts`): the first caller to
see it re-sends the last weights and version, and every in-flight request is sent again (same id and seed), so no
sample is lost or mixes weights; past the budget the run stops with `ActorFailedError`. Knows Ray and the engine
interface, not the loop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import ray
import torch

from molt.config import Config
from molt.engine.interface import Completion, Engine, SamplingParams, SyncMode, Weights
from molt.runtime.cluster import ActorFailedError

log = logging.getLogger("molt.runtime")


@dataclass
class ChunkedWeights(Mapping):
    """Full weights as object-store chunks (each a {name: encoded tensor} dict); a lazy Mapping."""

    refs: list[Any]
    names: list[str]
    num_bytes: int
    gather_s: float = 0.0
    _cache: dict[str, torch.Tensor] | None = field(default=None, repr=False)

    def __getitem__(self, name: str) -> torch.Tensor:
        if self._cache is None:
            self._cache = {k: _decode(v) for chunk in ray.get(self.refs) for k, v in chunk.items()}
        return self._cache[name]

    def __iter__(self):
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


def _encode(tensor: torch.Tensor) -> tuple[torch.dtype, tuple[int, ...], np.ndarray]:
    """Bytes as a numpy array: Ray stores it out of band and readers map it without a copy."""
    return tensor.dtype, tuple(tensor.shape), tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()


def _decode(encoded: tuple[torch.dtype, tuple[int, ...], np.ndarray]) -> torch.Tensor:
    dtype, shape, data = encoded
    with warnings.catch_warnings():  # a read-only view of the object store; only ever copied from
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(data).view(dtype).view(shape)


def chunk_weights(weights: Weights, chunk_bytes: int) -> ChunkedWeights:
    """Put `weights` into the object store in chunks of about `chunk_bytes`."""
    t0 = time.perf_counter()
    items = weights.items() if isinstance(weights, Mapping) else weights
    refs, names, chunk, size, total = [], [], {}, 0, 0
    for name, tensor in items:
        chunk[name], size, total = _encode(tensor), size + tensor.nbytes, total + tensor.nbytes
        names.append(name)
        if size >= chunk_bytes:
            refs.append(ray.put(chunk))
            chunk, size = {}, 0
    if chunk:
        refs.append(ray.put(chunk))
    return ChunkedWeights(refs, names, total, time.perf_counter() - t0)


class EngineActor:
    """A rollout engine in its own process (wrapped with `ray.remote` by `RemoteEngine.spawn`)."""

    def __init__(self, cfg: Config, model, tokenizer, version: int):
        from molt.runtime.factory import build_engine

        threads = cfg.runtime.engine_threads or 1
        torch.set_num_threads(threads)
        self.engine = build_engine(cfg, model, tokenizer, version=version, threads=threads, owned=True)
        frozen = set(model.router_names()) if cfg.train.freeze_router else set()  # never synced: they stay
        self.expected = set(self.engine.model.state_dict()) - frozen

    async def ready(self) -> int:
        return self.engine.version

    async def process(self) -> tuple[str, int]:
        """(host name, process id) of this replica."""
        return socket.gethostname(), os.getpid()

    async def generate_group(self, prompt, sampling, request_id, session_id) -> list[Completion]:
        return await self.engine.generate_group(prompt, sampling, request_id=request_id, session_id=session_id)

    async def abort(self, request_id: str) -> bool:
        return await self.engine.abort(request_id)

    async def update_weights(self, refs: list, version: int, mode: SyncMode) -> dict:
        """Swap in the chunked weights; returns the engine's work counters (`Engine.stats`)."""
        weights = {k: _decode(v) for chunk in await asyncio.gather(*refs) for k, v in chunk.items()}
        if missing := sorted(self.expected - set(weights)):
            raise ValueError(f"update_weights: the sync misses {len(missing)} engine parameters: {missing}")
        await self.engine.update_weights(weights, version, mode)
        return dict(self.engine.stats)

    async def pause(self) -> None:
        await self.engine.pause()

    async def resume(self) -> None:
        await self.engine.resume()

    async def close(self) -> None:
        await self.engine.close()


class RemoteEngine(Engine):
    """One `EngineActor` replica behind the `Engine` interface, with restart-and-resend on its death."""

    def __init__(self, actor, index: int, version: int, chunk_bytes: int):
        self.actor, self.index, self.chunk_bytes = actor, index, chunk_bytes
        self.version, self._epoch, self._lock = version, 0, asyncio.Lock()
        self._last: tuple[ChunkedWeights, int] | None = None
        self._pending = self.num_requests = self.num_restarts = self.num_resent = 0
        self.sync_s = 0.0
        self.stats: dict = {}  # the replica's work counters at the last weight sync

    @classmethod
    def spawn(cls, index: int, options: dict, args: tuple, version: int, chunk_bytes: int) -> RemoteEngine:
        actor = ray.remote(EngineActor).options(max_concurrency=10_000, **options).remote(*args)
        return cls(actor, index, version, chunk_bytes)

    async def watch(self, timeout_s: float) -> None:
        """Ping the replica every `timeout_s / 4` s until cancelled; one that leaves a ping unanswered for `timeout_s`
        is hung (a dead one raises instead): it is killed, so that it restarts and `_retry` re-sends its requests."""
        process = None  # where it runs: (host, pid), for a SIGKILL
        while True:
            ping = self.actor.process.remote()
            try:
                process = await asyncio.wait_for(asyncio.ensure_future(ping), timeout_s)
            except TimeoutError:
                if not ray.wait([ping], timeout=0)[0]:  # else answered: this process's own loop was what stalled
                    log.warning("engine replica %d did not answer for %.0f s: hung; killed", self.index, timeout_s)
                    self._kill(process)
            except ray.exceptions.RayError:
                pass  # dead or restarting: the calls on it recover it (`_retry`)
            await asyncio.sleep(timeout_s / 4)

    def _kill(self, process: tuple[str, int] | None) -> None:
        """End a hung replica as a crash would (SIGKILL: Ray restarts it); on another host, `ray.kill` (no restart:
        the run then stops with the replica named, instead of waiting for ever)."""
        if process is not None and process[0] == socket.gethostname():
            with contextlib.suppress(ProcessLookupError):
                os.kill(process[1], signal.SIGKILL)
        else:
            ray.kill(self.actor)

    async def _retry(self, call):
        """Await `call()` on the actor; on its death recover once per death and call again."""
        while True:
            epoch = self._epoch
            try:
                return await call()
            except ray.exceptions.RayActorError as e:
                self.num_resent += 1
                await self._recover(epoch, e)

    async def _recover(self, epoch: int, error: Exception) -> None:
        async with self._lock:
            if epoch != self._epoch:
                return  # another caller already waited for the restart
            log.warning("engine replica %d died (%s); waiting for its restart", self.index, type(error).__name__)
            deadline = time.monotonic() + 600
            while True:
                try:
                    await self.actor.ready.remote()
                    if self._last is not None:
                        await self.actor.update_weights.remote(self._last[0].refs, self._last[1], "interrupt")
                    break
                except ray.exceptions.ActorUnavailableError:  # still restarting
                    if time.monotonic() > deadline:
                        raise
                    await asyncio.sleep(0.5)
                except ray.exceptions.RayActorError as e:
                    msg = f"engine replica {self.index} died and was not restarted (runtime.engine_restarts)"
                    raise ActorFailedError(f"{msg}:\n{error}") from e
            self._epoch += 1
            self.num_restarts += 1
            log.warning("engine replica %d restarted; its requests are sent again", self.index)

    async def generate_group(
        self,
        prompt_token_ids: Sequence[int],
        sampling: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        session_id: str | None = None,
        images=None,
    ) -> list[Completion]:
        if images:  # a clear refusal instead of a TypeError deep in the router
            raise NotImplementedError("Ray engine replicas do not take images yet; run VLMs on the local backend")
        sampling = sampling or SamplingParams()
        prompt = list(prompt_token_ids)
        self.num_requests += 1
        self._pending += sampling.n
        try:
            return await self._retry(lambda: self.actor.generate_group.remote(prompt, sampling, request_id, session_id))
        finally:
            self._pending -= sampling.n

    async def abort(self, request_id: str) -> bool:
        return await self.actor.abort.remote(request_id)

    async def update_weights(self, weights: Weights, version: int, mode: SyncMode = "interrupt") -> None:
        if not isinstance(weights, ChunkedWeights):
            weights = chunk_weights(weights, self.chunk_bytes)
        t0 = time.perf_counter()
        self._last = (weights, version)  # a replica restarted from now on gets these
        self.stats = await self._retry(lambda: self.actor.update_weights.remote(weights.refs, version, mode))
        self.version, self.sync_s = version, time.perf_counter() - t0

    async def pause(self) -> None:
        await self.actor.pause.remote()

    async def resume(self) -> None:
        await self.actor.resume.remote()

    def num_pending(self) -> int:
        return self._pending

    async def close(self) -> None:
        with contextlib.suppress(ray.exceptions.RayError, TimeoutError):
            await asyncio.wait_for(self.actor.close.remote(), timeout=30)
