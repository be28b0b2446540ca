"""An in-process HTTP transport: SDK requests go straight into the chat server's ASGI app, no socket.

`ctx.openai()` / `ctx.anthropic()` clients (`clients.py`) use it when the agent shares the server's event
loop, as in training. The request is exactly the HTTP request the SDK would send (same app, validation and
capture) without TCP, HTTP/1.1 framing and the connection pool. Responses stream chunk by chunk, and a client
that closes the response early is a disconnect to the app, which aborts the generation. With a `ChatServer`
the completion routes skip the ASGI stack too: `direct_route` names the handler FastAPI would call, which gets
the same Starlette `Request` and returns the same `Response` (`_direct`). The request's read timeout (httpx's
`timeout` extension, which the SDKs set from their `timeout`) bounds the wait for the response head and for each body
chunk, as a socket read's would: past it, the request ends as a client that hangs up (the generation is aborted) and
`httpx.ReadTimeout` is raised, which the SDKs retry and report as their timeout error.
Works with `httpx` and `httpx2` (the SDKs use either): the classes are built per httpx module."""

from __future__ import annotations

import asyncio
import contextlib
import functools
from typing import Any

from starlette.requests import Request
from starlette.responses import StreamingResponse

_END = None  # end of the response body in the chunk queue
IN_PROCESS = "molt.in_process"  # a scope key of `_direct`'s requests: the caller's cancellation reaches the handler
SESSION_HEADER = "x-molt-session"  # an in-process session client's session (`clients.py`), read as `/s/{session}`


class _Exchange:
    """One request running in the app: its response head, body chunks, and the disconnect signal."""

    def __init__(self, app, scope: dict[str, Any], body: bytes):
        self.body, self.head = body, asyncio.get_running_loop().create_future()
        self.chunks: asyncio.Queue = asyncio.Queue()
        self.disconnected = asyncio.Event()
        self.task = asyncio.ensure_future(app(scope, self.receive, self.send))
        self.task.add_done_callback(self._finished)

    async def receive(self) -> dict[str, Any]:
        if self.body is not None:
            body, self.body = self.body, None
            return {"type": "http.request", "body": body, "more_body": False}
        await self.disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start" and not self.head.done():
            self.head.set_result(message)
        elif message["type"] == "http.response.body":
            if message.get("body"):
                self.chunks.put_nowait(message["body"])
            if not message.get("more_body", False):
                self.chunks.put_nowait(_END)

    def _finished(self, task: asyncio.Task) -> None:
        self.chunks.put_nowait(_END)  # a body the app never ended: the stream ends anyway
        if not self.head.done():
            error = task.exception() if not task.cancelled() else None
            self.head.set_exception(error or ConnectionError("the chat server closed the request"))

    async def iter_body(self):
        while (chunk := await self.chunks.get()) is not _END:
            yield chunk

    async def close(self) -> None:
        """The client is done reading: a disconnect to the app if it is still sending."""
        self.disconnected.set()
        if not self.task.done():
            await asyncio.sleep(0)  # let the app see the disconnect and abort its work
            self.task.cancel()
            with contextlib.suppress(BaseException):
                await self.task


@contextlib.asynccontextmanager
async def _read_deadline(httpx, request):
    """Raises `httpx.ReadTimeout` when the block runs past the request's read timeout (cancelling what it awaits)."""
    seconds = request.extensions.get("timeout", {}).get("read")
    if seconds is None:
        yield
        return
    deadline = asyncio.timeout(seconds)
    try:
        async with deadline:
            yield
    except TimeoutError:
        if not deadline.expired():  # the app's own TimeoutError
            raise
        raise httpx.ReadTimeout(f"the chat server sent nothing for {seconds} s", request=request) from None


def _scope(request) -> dict[str, Any]:
    """The request's ASGI scope; a session named in its header is the `/s/{session}` prefix its path lacks."""
    url, session = request.url, request.headers.get(SESSION_HEADER)
    path, raw_path = url.path, url.raw_path.split(b"?")[0]
    if session and not path.startswith("/s/"):
        path, raw_path = f"/s/{session}{path}", f"/s/{session}".encode() + raw_path
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.4"},
        "http_version": "1.1",
        "method": request.method,
        "headers": [(k.lower(), v) for k, v in request.headers.raw],
        "scheme": url.scheme,
        "path": path,  # decoded (once) by httpx, as its own ASGI transport passes it
        "raw_path": raw_path,
        "query_string": url.query,
        "server": (url.host, url.port),
        "client": ("127.0.0.1", 0),
        "root_path": "",
    }


def _one_body(body: bytes):
    """An ASGI `receive` giving the request body once (a handler reads nothing more)."""
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict[str, Any]:
        return messages.pop() if messages else {"type": "http.disconnect"}

    return receive


async def _direct(httpx, request, handler, scope: dict[str, Any], body: bytes):
    """`handler`'s response to the request as an httpx response. A streamed body runs on as a server's would, whether
    or not the client reads it (a client that stops reading without closing must not stall the session); closing it
    early closes the handler's stream, which aborts the generation, as a disconnect does."""
    response = await handler(Request(scope | {IN_PROCESS: True}, _one_body(body)))
    headers = response.raw_headers
    if not isinstance(response, StreamingResponse):
        return httpx.Response(response.status_code, headers=headers, stream=httpx.ByteStream(response.body))
    chunks, stream = asyncio.Queue(), response.body_iterator

    async def pump() -> None:
        try:
            async for chunk in stream:
                chunks.put_nowait(chunk)
        finally:
            chunks.put_nowait(_END)

    async def read():
        while (chunk := await chunks.get()) is not _END:
            yield chunk
        await task  # the handler's error, if its stream failed

    async def close() -> None:
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        await stream.aclose()

    task = asyncio.ensure_future(pump())
    task.add_done_callback(lambda done: done.cancelled() or done.exception())  # a body nobody reads: no warning
    return httpx.Response(response.status_code, headers=headers, stream=_body_class(httpx)(read(), close, request))


@functools.cache
def _body_class(httpx) -> type:
    """A streamed httpx response body over the app's chunks; closing it calls `on_close` (ending the app's work)."""

    class Body(httpx.AsyncByteStream):
        def __init__(self, chunks, on_close, request):
            self.chunks, self.on_close, self.request = chunks, on_close, request

        async def __aiter__(self):
            while True:
                try:
                    async with _read_deadline(httpx, self.request):
                        chunk = await anext(self.chunks, _END)
                except httpx.ReadTimeout:
                    await self.aclose()  # a client that stops waiting hangs up: the generation is aborted
                    raise
                if chunk is _END:
                    return
                yield chunk.encode() if isinstance(chunk, str) else chunk

        async def aclose(self) -> None:
            await self.on_close()

    return Body


@functools.cache
def transport_class(httpx) -> type:
    """`InProcessTransport` for one httpx module (`httpx` or `httpx2`)."""

    class InProcessTransport(httpx.AsyncBaseTransport):
        """Sends each request into `app` (an ASGI app, or a `ChatServer`) on the running event loop."""

        def __init__(self, app):
            self.app = app
            self.route = getattr(app, "direct_route", None)

        async def handle_async_request(self, request):
            scope, body, exchange = _scope(request), await request.aread(), None
            handler = self.route(scope["method"], scope["path"]) if self.route is not None else None
            try:
                async with _read_deadline(httpx, request):
                    if handler is not None:
                        return await _direct(httpx, request, handler, scope, body)
                    exchange = _Exchange(self.app, scope, body)
                    head = await exchange.head
            except (asyncio.CancelledError, httpx.ReadTimeout):
                if exchange is not None:
                    await exchange.close()
                raise
            except Exception as e:  # noqa: BLE001 - the app failed before answering: like a dropped connection
                raise httpx.RemoteProtocolError(f"chat server failed: {type(e).__name__}: {e}") from e
            stream = _body_class(httpx)(exchange.iter_body(), exchange.close, request)
            return httpx.Response(head["status"], headers=head.get("headers", []), stream=stream)

    return InProcessTransport
