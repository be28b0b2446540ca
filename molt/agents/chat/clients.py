"""SDK clients bound to one session, sharing one HTTP client per runner (`ctx.openai()`, `ctx.anthropic()`).

Building an SDK client from nothing loads the system CA bundle (20-90 ms of CPU on the event loop the rollouts share),
opens new connections and detects the platform in a worker thread, so `ClientPool` keeps one HTTP client per SDK and
hands out session-bound SDK clients on it, copies of a prototype. With the server on the same event loop (the runner's
case) requests go into it in-process (`loopback.py`) and name their session in a header (`x-molt-session`; a
`/s/{session}` path still wins); without it, over a keep-alive loopback pool. Closing a session client leaves the shared
one open; the runner closes it. Imports the SDKs only when asked for their client."""

from __future__ import annotations

import copy
import functools
import importlib
from typing import Any

from molt.agents.chat.ids import new_id
from molt.agents.chat.loopback import SESSION_HEADER, transport_class

MAX_KEEPALIVE = 512  # idle loopback connections kept (one per concurrent request at most)


@functools.cache
def _session_client_class(sdk: str) -> type:
    """The SDK's async client with `close()` leaving the shared pool open."""
    base = getattr(importlib.import_module(sdk), "AsyncOpenAI" if sdk == "openai" else "AsyncAnthropic")

    async def close(self) -> None:  # the pool belongs to the runner
        return None

    def _idempotency_key(self) -> str:  # the SDK's is a uuid4 per request: an os.urandom call
        return new_id("molt-retry-")

    body = {"close": close, "_idempotency_key": _idempotency_key, "__module__": __name__}
    return type(f"Session{base.__name__}", (base,), body)


def sdk_httpx(sdk: str) -> tuple[type, Any]:
    """The SDK's own default httpx client class (its timeouts) and the httpx module it is built on (httpx or httpx2)."""
    pool_cls = importlib.import_module(sdk).DefaultAsyncHttpxClient
    return pool_cls, importlib.import_module(pool_cls.__mro__[1].__module__.split(".")[0])


def session_client(sdk: str, base_url: str, api_key: str, http_client: Any, **options: Any) -> Any:
    """An `AsyncOpenAI` / `AsyncAnthropic` client on `http_client`, with the platform headers computed once."""
    client = _session_client_class(sdk)(base_url=base_url, api_key=api_key, http_client=http_client, **options)
    if getattr(client, "_platform", False) is None:  # SDK-internal cache; skips a thread hop per client
        client._platform = _platform(sdk)
    return client


@functools.cache
def _platform(sdk: str) -> Any:
    """The SDK's platform headers, computed once (the SDK does it per client instance, in a thread)."""
    get_platform = getattr(importlib.import_module(f"{sdk}._base_client"), "get_platform", None)
    return get_platform() if get_platform is not None else None


class ClientPool:
    """One HTTP client per SDK, created on first use on the caller's event loop; `app`: in-process."""

    def __init__(self, app=None):
        self.app = app
        self._pools: dict[str, Any] = {}
        self._prototypes: dict[tuple[str, str, str], Any] = {}  # (sdk, api key, URL) -> a client never used itself

    def client(self, sdk: str, base_url: str, api_key: str, session_id: str = "", **options: Any) -> Any:
        """An `AsyncOpenAI` (`sdk="openai"`) or `AsyncAnthropic` client on the shared HTTP client; without
        `options`, a shallow copy of a prototype (the constructor costs as much as a rollout's request). In process,
        `session_id`'s client names its session in a header on the server's root URL, one URL for every session
        (httpx parses a new URL in Python, twice per request)."""
        if options:
            return self._build(sdk, base_url, api_key, options)
        in_header = bool(session_id) and self.app is not None
        if in_header:
            base_url = base_url.replace(f"/s/{session_id}", "", 1)
        key = (sdk, api_key, base_url if in_header else "")
        if (prototype := self._prototypes.get(key)) is None:
            prototype = self._prototypes[key] = self._build(sdk, base_url, api_key, {})
        client = copy.copy(prototype)  # its resources (`client.chat`, ...) are cached on first use: its own
        if in_header:
            client._custom_headers = prototype._custom_headers | {SESSION_HEADER: session_id}  # SDK-internal
        else:
            client.base_url = base_url.rstrip("/") + "/"  # one URL parse, not two
        return client

    def _build(self, sdk: str, base_url: str, api_key: str, options: dict[str, Any]) -> Any:
        if sdk not in self._pools:  # the SDK's own httpx client: in-process into `app`, or a keep-alive pool
            pool_cls, httpx = sdk_httpx(sdk)
            if self.app is not None:
                self._pools[sdk] = pool_cls(transport=transport_class(httpx)(self.app), trust_env=False)
            else:
                limits = httpx.Limits(max_connections=None, max_keepalive_connections=MAX_KEEPALIVE)
                self._pools[sdk] = pool_cls(limits=limits, trust_env=False)
        return session_client(sdk, base_url, api_key, self._pools[sdk], **options)

    async def close(self) -> None:
        pools, self._pools, self._prototypes = self._pools, {}, {}
        for pool in pools.values():
            await pool.aclose()
