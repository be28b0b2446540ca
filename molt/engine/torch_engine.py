"""The built-in rollout engine: Molt's own model, continuous batching, versioned in-place weights.

One worker thread owns the model, the cache and the scheduler and runs the step loop; asyncio callers (any
number, any event loop) hand it requests and commands through a locked inbox and get results back with
`call_soon_threadsafe`, one call per loop per step (each wakes the loop: a system call). Commands (abort, pause,
weight swaps) run between steps, at token boundaries.

One compute thread: OpenMP pools are per thread, and more pool threads than cores make every parallel op pay a
futex wake-up (docs/engine.md, "Threads"). So the process's other model compute (the trainer step) runs here
too, between steps (`run_on_engine_thread`), and the caller's thread keeps torch at 1 thread.

The step itself lives in `core.py`; this file owns the thread, the inbox, pause and the two weight-sync modes.
Knows models and the engine core; nothing of agents or trainers."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import random
import threading
import time
from collections.abc import Callable, Sequence

import torch

from molt.engine.blocks import DEFAULT_BLOCK_SIZE
from molt.engine.core import EngineCore
from molt.engine.images import check_request_images
from molt.engine.interface import (
    Completion,
    Engine,
    SamplingParams,
    SyncMode,
    TokenDelta,
    Weights,
    check_prompt,
    eos_ids,
    new_request_id,
)
from molt.engine.paged import num_kv_blocks
from molt.engine.sampling import sample_seed
from molt.engine.scheduler import Group
from molt.models.transformer import Transformer
from molt.threads import in_daemon_thread

log = logging.getLogger(__name__)
KV_POLICIES = ("recompute", "keep")


class TorchEngine(Engine):
    """Continuous-batching engine over a `Transformer` (CPU or CUDA: wherever the model lives).

    `kv_on_update` (interrupt mode): "recompute" the KV of already-processed tokens under the new weights (exact),
    or "keep" the old KV (faster). `num_threads`: intra-op threads of the engine's thread (None: the constructing
    thread's setting). `record_routing` (MoE): `Completion.routing` (docs/moe.md). `compile`: decode steps through
    `torch.compile` (`compiled.py`), compiled when the engine thread starts. `kv_blocks`, `kv_bytes` or
    `kv_memory_fraction` (of free CUDA memory): a paged KV cache of blocks of `block_size` positions instead of the
    slot cache (`paged.py`; dense text models). `graphs` (paged; None: on CUDA): decode replays CUDA graphs."""

    def __init__(
        self,
        model: Transformer,
        *,
        tokenizer=None,
        num_slots: int = 32,
        max_seq_len: int | None = None,
        max_num_batched_tokens: int = 2048,
        prefix_cache: bool = True,
        kv_on_update: str = "recompute",
        eos_token_ids: Sequence[int] | None = None,
        version: int = 0,
        seed: int | None = None,
        num_threads: int | None = None,
        record_routing: bool = True,
        compile: bool = False,
        kv_blocks: int | None = None,
        kv_bytes: int | None = None,
        kv_memory_fraction: float | None = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
        graphs: bool | None = None,
    ):
        if kv_on_update not in KV_POLICIES:
            raise ValueError(f"kv_on_update must be one of {KV_POLICIES}, got {kv_on_update!r}")
        self.model, self.tokenizer, self.kv_on_update = model, tokenizer, kv_on_update
        self.vision, self.image_token_id = model.cfg.vision, model.cfg.image_token_id
        self.max_seq_len = max_seq_len or min(model.cfg.max_position_embeddings, 2048)
        self.core = EngineCore(
            model,
            tokenizer=tokenizer,
            num_slots=num_slots,
            max_seq_len=self.max_seq_len,
            max_num_batched_tokens=max_num_batched_tokens,
            prefix_cache=prefix_cache,
            eos_token_ids=eos_ids(model.cfg.stop_ids(), tokenizer) if eos_token_ids is None else eos_token_ids,
            version=version,
            record_routing=record_routing,
            compile=compile,
            kv_blocks=num_kv_blocks(model, block_size, kv_blocks, kv_bytes, kv_memory_fraction),
            block_size=block_size,
            graphs=graphs,
        )
        self.manager, self.stats = self.core.manager, self.core.stats
        self._rng = random.Random(seed)
        self._cv = threading.Condition()
        self._inbox: list[Callable[[], None]] = []
        self._drains: list[tuple[Weights, int, concurrent.futures.Future]] = []
        self._outbox: list[tuple] = []  # (caller's loop, fn, *args): results for callers, sent after each step
        self._paused = self._closed = False
        self._thread: threading.Thread | None = None
        self.num_threads = num_threads or torch.get_num_threads()

    @property
    def version(self) -> int:
        return self.core.version

    # ---- caller side (any thread / event loop) -------------------------------------------------
    async def generate_group(
        self,
        prompt_token_ids: Sequence[int],
        sampling: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        session_id: str | None = None,
        images: Sequence[torch.Tensor] | None = None,
    ) -> list[Completion]:
        return await self.generate_streamed(prompt_token_ids, sampling, None, request_id=request_id, images=images)

    async def generate_streamed(
        self,
        prompt_token_ids: Sequence[int],
        sampling: SamplingParams | None,
        on_tokens: Callable[[TokenDelta], None] | None,
        *,
        request_id: str | None = None,
        session_id: str | None = None,
        images: Sequence[torch.Tensor] | None = None,
    ) -> list[Completion]:
        sampling = sampling or SamplingParams()
        prompt = check_prompt(prompt_token_ids, sampling, self.max_seq_len, "max_seq_len", self.tokenizer)
        vocab = self.model.cfg.vocab_size
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if sampling.n > self.manager.num_slots:
            raise ValueError(f"n={sampling.n} exceeds the engine's num_slots={self.manager.num_slots}")
        pixels = check_request_images(self.model.cfg, prompt, images)
        request_id = request_id or new_request_id()
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()

        def on_done(result) -> None:  # engine thread, as `on_step`: sent at the end of the step (`_send_out`)
            self._outbox.append((loop, _settle, future, result))

        def on_step(deltas: list[TokenDelta]) -> None:
            self._outbox.append((loop, _deliver, on_tokens, deltas))

        base_seed = self._rng.getrandbits(63) if sampling.seed is None else sampling.seed
        seeds = [sample_seed(base_seed, i) for i in range(sampling.n)]
        stop_ids = frozenset(sampling.stop_token_ids).union(() if sampling.ignore_eos else self.core.eos_token_ids)
        group = Group(request_id, prompt, sampling, seeds, on_done, stop_ids, time.perf_counter(), images=pixels)
        self._post(lambda: self.core.add(group, on_step if on_tokens is not None else None))
        try:
            return await future
        except asyncio.CancelledError:
            self._post(lambda: self.core.abort(request_id))
            raise

    async def abort(self, request_id: str) -> bool:
        return await self._call(lambda: self.core.abort(request_id))

    async def pause(self) -> None:
        await self._call(lambda: setattr(self, "_paused", True))

    async def resume(self) -> None:
        await self._call(lambda: setattr(self, "_paused", False))

    async def update_weights(self, weights: Weights, version: int, mode: SyncMode = "interrupt") -> None:
        if mode not in ("drain", "interrupt"):
            raise ValueError(f"mode must be 'drain' or 'interrupt', got {mode!r}")
        if mode == "interrupt":
            await self._call(lambda: self.core.swap_weights(weights, version, self.kv_on_update == "recompute"))
            return
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._post(lambda: self._drains.append((weights, version, done)))
        await asyncio.wrap_future(done)

    async def run_on_engine_thread(self, fn: Callable[..., object], *args):
        """`fn(*args)` on the engine's thread between two steps (the one compute thread); returns its result."""
        return await self._call(lambda: fn(*args))

    def num_pending(self) -> int:
        return self.core.num_pending

    async def close(self) -> None:
        if self._thread is None:
            return
        self._post(self._shutdown)
        await asyncio.to_thread(self._thread.join)
        self._thread = None

    def _post(self, fn: Callable[[], None]) -> None:
        with self._cv:
            if self._closed:
                raise RuntimeError("the engine is closed")
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="molt-engine", daemon=True)
                self._thread.start()
            self._inbox.append(fn)
            self._cv.notify()

    async def _call(self, fn: Callable[[], object]):
        """Run `fn` on the engine thread between steps; return its result."""
        done: concurrent.futures.Future = concurrent.futures.Future()

        def run() -> None:
            if not done.set_running_or_notify_cancel():  # the caller was cancelled while this waited
                return
            try:
                done.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                done.set_exception(e)

        self._post(run)
        return await asyncio.wrap_future(done)

    # ---- engine thread -------------------------------------------------------------------------
    def _loop(self) -> None:
        torch.set_num_threads(self.num_threads)  # this thread's pool (OpenMP pools are per thread)
        self.core.runner.warm_up()
        while True:
            with self._cv:
                while not (self._inbox or self._drain_ready() or self._runnable()):
                    self._cv.wait()
                inbox, self._inbox = self._inbox, []
            for fn in inbox:
                try:
                    fn()
                except Exception:  # a bad command must not kill the loop every caller waits on
                    log.exception("engine command failed")
            if not self._closed and self._drain_ready():
                self._finish_drains()
            if not self._closed and self._runnable():
                self.core.step_safely(admit=not self._drains)
            self._send_out()
            if self._closed:
                return

    def _send_out(self) -> None:
        """Hand the results of this iteration's commands and step to their callers' loops: one wake-up per loop
        (a system call), not one per request."""
        calls: dict[asyncio.AbstractEventLoop, list] = {}
        for loop, *call in self._outbox:
            calls.setdefault(loop, []).append(call)
        self._outbox = []
        for loop, batch in calls.items():
            with contextlib.suppress(RuntimeError):  # the caller's loop is gone
                loop.call_soon_threadsafe(_run_all, batch)

    def _drain_ready(self) -> bool:
        return bool(self._drains) and not self.core.scheduler.has_work(admit=False)  # preempted ones too

    def _runnable(self) -> bool:
        return not self._paused and self.core.scheduler.has_work(admit=not self._drains)

    def _finish_drains(self) -> None:
        for weights, version, done in self._drains:
            try:
                self.core.swap_weights(weights, version, recompute=False)
                done.set_result(None)
            except Exception as e:  # noqa: BLE001 - handed to the caller
                done.set_exception(e)
        self._drains = []

    def _shutdown(self) -> None:
        for request_id in list(self.core.groups):
            self.core.abort(request_id)
        self._closed = True


async def on_fresh_thread(fn: Callable[..., object], *args, threads: int):
    """`fn(*args)` on a new thread with `threads` torch threads (its OpenMP pool ends with the thread), awaited
    with the event loop free: Ctrl-C stops the command at once (the daemon thread dies with the process)."""
    return await in_daemon_thread(with_threads, threads, fn, *args, name="molt-build")


def with_threads(threads: int, fn: Callable[..., object], *args):
    torch.set_num_threads(threads)
    return fn(*args)


def _run_all(calls: list[list]) -> None:
    """One engine iteration's results on a caller's loop; a failing callback does not keep the others'."""
    for fn, *args in calls:
        try:
            fn(*args)
        except Exception:  # noqa: BLE001 - as the loop reports a failing callback of its own
            log.exception("engine result callback failed")


def _deliver(on_tokens: Callable[[TokenDelta], None], deltas: list[TokenDelta]) -> None:
    """One step's tokens of a streamed request, one delta per sample (on the caller's loop)."""
    for delta in deltas:
        on_tokens(delta)


def _settle(future: asyncio.Future, result) -> None:
    if future.done():
        return
    if isinstance(result, BaseException):
        future.set_exception(result)
    else:
        future.set_result(result)
