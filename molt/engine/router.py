"""A router over engine replicas: least-loaded placement with session affinity, behind the same interface.

A request without a session goes to the replica with the fewest sequences in flight (counted by the router at
submission, so concurrent submissions spread at once; ties go to the lowest index). A request with a `session_id` (one
agent episode) goes where that session went before, so the replica's prefix cache still holds the episode's earlier
turns. Sessions are remembered least-recently-used up to `max_sessions`. Streamed requests stream from their replica.
Weight updates, pause and resume fan out to every replica. Knows only the `Engine` interface: replicas may be torch
engines, vLLM or other routers."""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping, Sequence

from molt.engine.interface import Completion, Engine, SamplingParams, SyncMode, TokenDelta, Weights, new_request_id


class Router(Engine):
    """Places requests on `engines`; one `Engine` to its callers."""

    def __init__(self, engines: Sequence[Engine], max_sessions: int = 100_000):
        if not engines:
            raise ValueError("Router needs at least one engine")
        self.vision, self.image_token_id = engines[0].vision, engines[0].image_token_id
        self.engines = list(engines)
        self.max_sessions = max_sessions
        self._sessions: OrderedDict[str, int] = OrderedDict()
        self._requests: dict[str, int] = {}
        self._in_flight = [0] * len(self.engines)

    @property
    def version(self) -> int:
        return min(e.version for e in self.engines)

    def place(self, session_id: str | None = None) -> int:
        """The replica index for a new request of `session_id` (records the session's choice)."""
        if session_id in self._sessions:
            self._sessions.move_to_end(session_id)
            return self._sessions[session_id]
        index = min(range(len(self.engines)), key=lambda i: (self._in_flight[i], i))
        if session_id is not None:
            self._sessions[session_id] = index
            if len(self._sessions) > self.max_sessions:
                self._sessions.popitem(last=False)
        return index

    def end_session(self, session_id: str) -> None:
        """Forget a finished episode's placement."""
        self._sessions.pop(session_id, None)

    async def generate_group(
        self,
        prompt_token_ids: Sequence[int],
        sampling: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        session_id: str | None = None,
        images=None,
    ) -> list[Completion]:
        def call(engine: Engine, **kw) -> Awaitable[list[Completion]]:
            return engine.generate_group(prompt_token_ids, sampling, **kw)

        return await self._placed(call, sampling, request_id, session_id, images)

    async def generate_streamed(
        self,
        prompt_token_ids: Sequence[int],
        sampling: SamplingParams | None,
        on_tokens: Callable[[TokenDelta], None],
        *,
        request_id: str | None = None,
        session_id: str | None = None,
        images=None,
    ) -> list[Completion]:
        def call(engine: Engine, **kw) -> Awaitable[list[Completion]]:
            return engine.generate_streamed(prompt_token_ids, sampling, on_tokens, **kw)

        return await self._placed(call, sampling, request_id, session_id, images)

    async def _placed(self, call, sampling: SamplingParams | None, request_id, session_id, images) -> list[Completion]:
        """`call(replica, request_id=, session_id=[, images=])` on the replica `place` picks, counted in flight."""
        n, request_id = (sampling or SamplingParams()).n, request_id or new_request_id()
        index = self.place(session_id)
        self._in_flight[index] += n
        self._requests[request_id] = index
        kw = {"images": images} if images else {}  # engines without image support need not take the argument
        try:
            return await call(self.engines[index], request_id=request_id, session_id=session_id, **kw)
        finally:
            self._in_flight[index] -= n
            self._requests.pop(request_id, None)

    async def abort(self, request_id: str) -> bool:
        index = self._requests.get(request_id)
        return False if index is None else await self.engines[index].abort(request_id)

    async def update_weights(self, weights: Weights, version: int, mode: SyncMode = "interrupt") -> None:
        weights = weights if isinstance(weights, Mapping) else list(weights)  # read once per replica
        await asyncio.gather(*(e.update_weights(weights, version, mode) for e in self.engines))

    async def pause(self) -> None:
        await asyncio.gather(*(e.pause() for e in self.engines))

    async def resume(self) -> None:
        await asyncio.gather(*(e.resume() for e in self.engines))

    def num_pending(self) -> int:
        return sum(e.num_pending() for e in self.engines)

    def load(self) -> list[int]:
        """Sequences in flight per replica, as the router counts them."""
        return list(self._in_flight)

    async def close(self) -> None:
        await asyncio.gather(*(e.close() for e in self.engines))
