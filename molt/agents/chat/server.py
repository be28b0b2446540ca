"""The chat server: OpenAI- and Anthropic-compatible HTTP endpoints over the session capture.

FastAPI app served by uvicorn on the caller's own asyncio loop (`start()` runs `Server.serve()` as a
task; signals stay with the host program), bound to 127.0.0.1 on a free port unless told otherwise.
Routes: `POST /s/{session}/v1/chat/completions`, `POST /s/{session}/v1/messages`,
`GET /s/{session}/v1/models`, `GET /v1/models`, `GET /health`; with `serve_sampling` set (`molt serve`)
also `POST /v1/chat/completions` and `POST /v1/messages`, each in an implicit one-request session.

Errors, in the wire's own error format: 401 without the API key (when one is set), 404 for an unknown
or finished session, 413 for a body over `max_body_bytes`, 400 for a body that is not JSON, 422 for
a body that does not match the schema (or that the template cannot render), 503 when the engine fails.
Knows sessions and wires; nothing of the trainer.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import socket
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from molt.agents.chat import wire_anthropic, wire_openai
from molt.agents.chat.session import GenerationError, RequestError, Session, SessionClosed, SessionStore
from molt.agents.chat.tool_parser import get_parser
from molt.data.trajectory import Trajectory
from molt.engine.interface import SamplingParams

log = logging.getLogger("molt.chat")


class HTTPError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _summary(error: ValidationError, limit: int = 3) -> str:
    parts = [f"{'.'.join(str(x) for x in e['loc']) or 'body'}: {e['msg']}" for e in error.errors()[:limit]]
    more = error.error_count() - limit
    return "invalid request: " + "; ".join(parts) + (f" (+{more} more)" if more > 0 else "")


class _EmbeddedServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):  # the host program (e.g. the RL loop) owns SIGINT/SIGTERM
        yield


class ChatServer:
    """Sessions plus the HTTP app; `open_session` / `close_session` are the runner's side."""

    def __init__(
        self,
        engine,
        tokenizer,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        api_key: str = "",
        model_name: str = "molt",
        max_body_bytes: int = 4 << 20,
        tool_parser: str = "auto",
        render_tools: bool = True,
        serve_sampling: SamplingParams | None = None,
        serve_max_len: int = 2048,
    ):
        self.engine, self.tokenizer = engine, tokenizer
        self.host, self.port, self.api_key, self.model_name = host, port, api_key, model_name
        self.max_body_bytes, self.render_tools = max_body_bytes, render_tools
        self.parser = get_parser(tool_parser, tokenizer)
        self.serve_sampling, self.serve_max_len = serve_sampling, serve_max_len
        self.store = SessionStore()
        self.app = self._build_app()
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    # ---- sessions ---------------------------------------------------------------------------------
    def open_session(self, sampling: SamplingParams, *, max_len: int, **options) -> Session:
        """A new recording session (options: max_turns, keep_ids, honor_sampling)."""
        return self.store.open(
            self.engine,
            self.tokenizer,
            sampling,
            max_len=max_len,
            parser=self.parser,
            render_tools=self.render_tools,
            **options,
        )

    def close_session(self, session_id: str) -> list[Trajectory]:
        """Finish a session (later requests get 404) and return its segments."""
        return self.store.close(session_id)

    # ---- lifecycle --------------------------------------------------------------------------------
    async def start(self) -> ChatServer:
        """Serve on the running loop until `stop()`; returns once the socket is bound."""
        config = uvicorn.Config(
            self.app,
            host=self.host,
            port=self.port,
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=2,
        )
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        try:  # bound here, so a taken port is a clear OSError (uvicorn would sys.exit inside the task)
            sock = socket.create_server((self.host, self.port), family=family)
        except OSError as e:
            raise RuntimeError(f"chat server cannot bind {self.host}:{self.port}: {e}") from None
        self.port = sock.getsockname()[1]
        self._server = _EmbeddedServer(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]), name="chat-server")
        while not self._server.started:
            if self._task.done():
                raise RuntimeError(f"chat server on {self.url} stopped while starting")
            await asyncio.sleep(0.005)
        return self

    async def stop(self) -> None:
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            with contextlib.suppress(Exception):
                await self._task
        self._server = self._task = None

    # ---- HTTP -------------------------------------------------------------------------------------
    def _build_app(self) -> FastAPI:
        app = FastAPI(title="Molt chat server", docs_url=None, redoc_url=None, openapi_url=None)
        app.get("/health")(self._health)
        app.get("/v1/models")(self._models)
        app.get("/s/{session_id}/v1/models")(self._session_models)

        @app.post("/s/{session_id}/v1/chat/completions")
        async def openai_session(request: Request, session_id: str) -> Response:
            return await self._complete(request, session_id, wire_openai)

        @app.post("/s/{session_id}/v1/messages")
        async def anthropic_session(request: Request, session_id: str) -> Response:
            return await self._complete(request, session_id, wire_anthropic)

        if self.serve_sampling is not None:

            @app.post("/v1/chat/completions")
            async def openai_serve(request: Request) -> Response:
                return await self._complete(request, None, wire_openai)

            @app.post("/v1/messages")
            async def anthropic_serve(request: Request) -> Response:
                return await self._complete(request, None, wire_anthropic)

        return app

    async def _health(self) -> dict[str, Any]:
        return {"status": "ok", "sessions": len(self.store), "version": getattr(self.engine, "version", 0)}

    def _model_list(self) -> dict[str, Any]:
        card = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "molt"}
        return {"object": "list", "data": [card]}

    async def _models(self, request: Request) -> Response:
        try:
            self._authorize(request)
        except HTTPError as e:
            return JSONResponse(wire_openai.error(e.status, e.message), e.status)
        return JSONResponse(self._model_list())

    async def _session_models(self, request: Request, session_id: str) -> Response:
        try:
            self._authorize(request)
            self.store.get(session_id)
        except HTTPError as e:
            return JSONResponse(wire_openai.error(e.status, e.message), e.status)
        except SessionClosed as e:
            return JSONResponse(wire_openai.error(404, str(e)), 404)
        return JSONResponse(self._model_list())

    def _authorize(self, request: Request) -> None:
        if not self.api_key:
            return
        bearer = request.headers.get("authorization", "")
        given = bearer[7:] if bearer.lower().startswith("bearer ") else request.headers.get("x-api-key", "")
        if not secrets.compare_digest(given.encode(), self.api_key.encode()):
            raise HTTPError(401, "missing or wrong API key")

    async def _read_json(self, request: Request) -> Any:
        declared = request.headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_body_bytes):
            raise HTTPError(413 if declared.isdigit() else 400, f"request body over {self.max_body_bytes} bytes")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > self.max_body_bytes:
                raise HTTPError(413, f"request body over {self.max_body_bytes} bytes")
        try:
            return json.loads(bytes(body), parse_constant=_reject_constant)
        except (ValueError, RecursionError) as e:
            raise HTTPError(400, f"request body is not valid JSON: {e}") from None

    async def _turn(self, request: Request, session_id: str | None, wire):
        self._authorize(request)
        session = self._implicit_session() if session_id is None else self.store.get(session_id)
        try:
            body = await self._read_json(request)
            try:
                chat = wire.decode(body)
            except ValidationError as e:
                raise HTTPError(422, _summary(e)) from None
            return chat, await session.turn(chat)
        finally:
            if session_id is None:
                self.store.close(session.id)

    def _implicit_session(self) -> Session:
        return self.open_session(self.serve_sampling, max_len=self.serve_max_len, honor_sampling=True)

    async def _complete(self, request: Request, session_id: str | None, wire) -> Response:
        try:
            chat, reply = await self._turn(request, session_id, wire)
        except HTTPError as e:
            return JSONResponse(wire.error(e.status, e.message), e.status)
        except SessionClosed as e:
            return JSONResponse(wire.error(404, str(e)), 404)
        except RequestError as e:
            return JSONResponse(wire.error(422, str(e)), 422)
        except GenerationError as e:
            log.warning("chat session %s: %s", (session_id or "implicit")[:6], e)
            return JSONResponse(wire.error(503, str(e)), 503)
        if chat.stream:  # the configured model name, never the client's string echoed back
            return StreamingResponse(wire.stream(reply, self.model_name, chat), media_type="text/event-stream")
        return JSONResponse(wire.encode(reply, self.model_name))
