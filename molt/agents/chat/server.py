"""The chat server: OpenAI- and Anthropic-compatible HTTP endpoints over the session capture.

FastAPI app served by uvicorn on the caller's own asyncio loop (signals stay with the host program), on 127.0.0.1 and a
free port unless told otherwise. Routes: `POST /s/{session}/v1/chat/completions`, `POST /s/{session}/v1/messages` (and
its `count_tokens`), `GET /s/{session}/v1/models[/{model}]`, `GET /v1/models[/{model}]`, `GET /health`; with
`serve_sampling` set (`molt serve`) also `POST /v1/chat/completions` and `POST /v1/messages`, each in an implicit
one-request session.

Errors come in the wire's own format, never a 500 for what a client sent: 401 (API key), 404 (unknown or finished
session, unknown `model`), 413 (body over `max_body_bytes`), 400 (not JSON, nested deeper than `MAX_DEPTH`, no `model`,
a lone surrogate in a string, a schema mismatch (OpenAI's `param` names the field), unsupported options, a template
that cannot render the messages, serve mode's `context_length_exceeded`), 503 (the engine failed); an unknown path or
method is a 404 or 405 in the same format. Anything else is a 500 naming a request id, logged with its
traceback. A client that goes away mid-stream aborts the generation and nothing is recorded. A chat template that
ignores `tools` (so requests' tools never reach the prompt) is warned about once: at start-up in serve mode, else at the
first tools. `direct_route` gives in-process clients (`loopback.py`) the completion handler itself, skipping FastAPI's
routing and middleware: the same function, validation and responses as over HTTP."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import re
import secrets
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from jinja2 import TemplateError
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from tokenizers import decoders
from transformers.convert_slow_tokenizer import bytes_to_unicode

from molt.agents.chat import wire_anthropic, wire_openai
from molt.agents.chat.ids import new_id
from molt.agents.chat.loopback import IN_PROCESS
from molt.agents.chat.messages import ChatRequest, check_depth, lone_surrogate
from molt.agents.chat.replies import GenerationError, RequestError, SessionClosed
from molt.agents.chat.session import Session, forced_prefix, off_loop
from molt.agents.chat.tool_parser import PARSERS, get_parser
from molt.agents.images import expand_images, message_images
from molt.agents.runner import first_prompt_ids
from molt.data.trajectory import Trajectory
from molt.engine.interface import SamplingParams
from molt.models.tokenizer import TEMPLATE_ARGS, render_chat
from molt.models.vision import ImageError

log = logging.getLogger("molt.chat")
BYTE_OF_CHAR = {c: b for b, c in bytes_to_unicode().items()}  # byte-level BPE's alphabet -> the byte it spells
BYTE_FALLBACK = re.compile(r"<0x[0-9A-Fa-f]{2}>")
PROBE_TOOL = {"type": "function", "function": {"name": "probe", "description": "A probe.", "parameters": {}}}


class HTTPError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status, self.code, self.param = status, code, param  # code, param: OpenAI's


async def _unless_gone(request: Request, turn: Awaitable) -> Any:
    """`turn`'s result, or None when the HTTP client disconnects first: then the turn is cancelled, which aborts
    its generation, as a streamed one's is (vLLM's server does the same)."""
    task, gone = asyncio.ensure_future(turn), asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    return None if task.cancelled() else task.result()


async def _disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


UNION_TAGS = frozenset(("str", "int", "float", "bool", "none"))  # pydantic's names of a union's simple branches


def _field(loc: tuple) -> str:
    """A validation error's location as a dotted path, without the union branch pydantic names in it
    (`messages.0.content.str` -> `messages.0.content`): field names are identifiers, branches types."""
    return ".".join(str(x) for x in loc if not isinstance(x, str) or (x.isidentifier() and x not in UNION_TAGS))


def _summary(error: ValidationError, limit: int = 3) -> str:
    parts = [f"{_field(e['loc']) or 'body'}: {e['msg']}" for e in error.errors()[:limit]]
    more = error.error_count() - limit
    return "invalid request: " + "; ".join(parts) + (f" (+{more} more)" if more > 0 else "")


def template_renders_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template puts a request's `tools` into the prompt: a probe conversation
    renders differently with one tool than without (a template that cannot render it counts as rendering)."""
    messages = [{"role": "user", "content": "Hi."}]
    try:
        with_tool = render_chat(tokenizer, messages, tools=[PROBE_TOOL], add_generation_prompt=True)
        return with_tool != render_chat(tokenizer, messages, add_generation_prompt=True)
    except (TemplateError, TypeError, KeyError, AttributeError, ValueError):
        return True


def _listening_socket(host: str, port: int) -> socket.socket:
    """A listening socket whose `proto` is IPPROTO_TCP, the only kind asyncio sets TCP_NODELAY on for accepted
    connections (`socket.create_server` leaves it 0); without it each response waits for a delayed ACK (~40 ms)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(1024)
    except OSError:
        sock.close()
        raise
    return sock


class _EmbeddedServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):  # the host program (e.g. the RL loop) owns SIGINT/SIGTERM
        yield


WIRES = {"/v1/chat/completions": wire_openai, "/v1/messages": wire_anthropic}  # the completion routes


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
        model_aliases: tuple[str, ...] = (),
    ):
        self.engine, self.tokenizer = engine, tokenizer
        self.host, self.port, self.api_key, self.model_name = host, port, api_key, model_name
        self.model_names = frozenset((model_name, *model_aliases))  # what a request's `model` may say
        self.max_body_bytes, self.render_tools = max_body_bytes, render_tools
        self.parser = get_parser(tool_parser, tokenizer)
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self._byte_level = isinstance(decoder, decoders.ByteLevel)  # tokens spell bytes (GPT-2's byte alphabet)
        self._added_ids = frozenset(getattr(tokenizer, "added_tokens_decoder", ()))  # their text is literal
        self._tools_checked = not render_tools  # whether a template that ignores tools was looked for
        self.serve_sampling, self.serve_max_len = serve_sampling, serve_max_len
        self.sessions: dict[str, Session] = {}  # open sessions by unguessable id (192 random bits)
        self.app = self._build_app()
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def open_session(self, sampling: SamplingParams, *, max_len: int, **options) -> Session:
        """A new recording session (options: max_turns, keep_ids, honor_sampling)."""
        options |= {"max_len": max_len, "parser": self.parser, "render_tools": self.render_tools}
        session = Session(new_id(num_bytes=24), self.engine, self.tokenizer, sampling, **options)
        self.sessions[session.id] = session
        return session

    def close_session(self, session_id: str) -> list[Trajectory]:
        """Finish a session (later requests get 404) and return its segments."""
        session = self.sessions.pop(session_id, None)
        return session.close() if session is not None else []

    async def start(self) -> ChatServer:
        """Serve on the running loop until `stop()`; returns once the socket is bound."""
        options = {"log_level": "warning", "access_log": False, "lifespan": "off"}  # stop() sets the shutdown's grace
        try:  # bound here, so a taken port is a clear OSError (uvicorn would sys.exit inside the task)
            sock = _listening_socket(self.host, self.port)
        except OSError as e:
            raise RuntimeError(f"chat server cannot bind {self.host}:{self.port}: {e}") from None
        self.port = sock.getsockname()[1]
        if self.serve_sampling is not None:  # `molt serve`: say at start-up; training: at the first tools
            self._warn_if_tools_ignored()
        self._server = _EmbeddedServer(uvicorn.Config(self.app, host=self.host, port=self.port, **options))
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]), name="chat-server")
        while not self._server.started:
            if self._task.done():
                raise RuntimeError(f"chat server on {self.url} stopped while starting")
            await asyncio.sleep(0.005)
        return self

    async def stop(self, grace: float = 2.0, abort: Callable[[], Awaitable[None]] | None = None) -> None:
        """Stop accepting; requests in flight get `grace` seconds to finish. Then uvicorn cancels the rest, or
        `abort()` (called once, e.g. closing the engine: generations end, streams with an error event) ends them."""
        if self._server is not None and self._task is not None:
            self._server.config.timeout_graceful_shutdown = grace + 30 if abort else grace  # + 30: a backstop
            self._server.should_exit = True
            if abort is not None:
                await asyncio.wait([self._task], timeout=grace)
                await abort()
            with contextlib.suppress(Exception):
                await self._task
        elif abort is not None:
            await abort()
        self._server = self._task = None

    async def __call__(self, scope, receive, send) -> None:  # ASGI: the FastAPI app
        await self.app(scope, receive, send)

    def direct_route(self, method: str, path: str) -> Callable[[Request], Awaitable[Response]] | None:
        """The handler `self.app` would route a completion request to (`path` URL-decoded), else None."""
        if method != "POST":
            return None
        session_id = None
        if path.startswith("/s/"):
            session_id, slash, rest = path[3:].partition("/")
            if not session_id or not slash:
                return None
            path = "/" + rest
        elif self.serve_sampling is None:
            return None
        wire = WIRES.get(path)
        return None if wire is None else functools.partial(self._complete, session_id=session_id, wire=wire)

    def _build_app(self) -> FastAPI:
        app = FastAPI(title="Molt chat server", docs_url=None, redoc_url=None, openapi_url=None)
        app.add_exception_handler(StarletteHTTPException, self._unrouted)
        app.get("/health")(self._health)
        for prefix in ("/s/{session_id}", ""):  # the handlers read `session_id` (None: none) from the path
            app.get(prefix + "/v1/models")(self._models)
            app.get(prefix + "/v1/models/{model_id:path}")(self._models)
            if prefix or self.serve_sampling is not None:  # serve mode: each request in an implicit session
                for path, wire in WIRES.items():
                    app.post(prefix + path)(self._route(wire))
                app.post(prefix + "/v1/messages/count_tokens")(self._count_tokens)
        return app

    async def _unrouted(self, request: Request, error: StarletteHTTPException) -> Response:
        """An unknown path or method (404, 405) in the wire's error format."""
        wire = wire_anthropic if "/messages" in request.url.path else wire_openai
        return JSONResponse(wire.error(error.status_code, f"{request.method} {request.url.path}: {error.detail}"),
                            error.status_code, headers=error.headers)  # fmt: skip

    def _route(self, wire) -> Callable[[Request], Awaitable[Response]]:
        async def complete(request: Request) -> Response:
            return await self._complete(request, request.path_params.get("session_id"), wire)

        return complete

    async def _health(self) -> dict[str, Any]:
        return {"status": "ok", "sessions": len(self.sessions), "version": getattr(self.engine, "version", 0)}

    async def _models(self, request: Request) -> Response:
        """The model's card in a list, or `model_id`'s card (a name it answers to), once the session (if any) exists."""
        session_id, model_id = request.path_params.get("session_id"), request.path_params.get("model_id")
        try:
            self._session(request, session_id)
            if model_id is not None:
                self._check_model(model_id)
        except (HTTPError, SessionClosed) as e:
            return self._error(wire_openai, e, session_id)
        card = {"id": model_id or self.model_name, "object": "model", "created": 0, "owned_by": "molt"}
        return JSONResponse(card if model_id is not None else {"object": "list", "data": [card]})

    def _check_model(self, model: str) -> None:
        if not model:
            raise HTTPError(400, f"model is required (this server serves {self.model_name!r})")
        if model not in self.model_names:
            message = f"the model {model!r} does not exist; this server serves {self.model_name!r}"
            raise HTTPError(404, message, "model_not_found")

    def _session(self, request: Request, session_id: str | None) -> Session | None:
        """The request's open session (None on a route without one), once its API key is checked."""
        if self.api_key:
            bearer = request.headers.get("authorization", "")
            given = bearer[7:] if bearer.lower().startswith("bearer ") else request.headers.get("x-api-key", "")
            if not secrets.compare_digest(given.encode(), self.api_key.encode()):
                raise HTTPError(401, "missing or wrong API key", "invalid_api_key")
        session = self.sessions.get(session_id) if session_id is not None else None
        if session_id is not None and session is None:
            raise SessionClosed("unknown or finished session")
        return session

    async def _read_json(self, request: Request) -> Any:
        declared, over = request.headers.get("content-length"), f"request body over {self.max_body_bytes} bytes"
        over += " (the server's chat.max_body_bytes)"
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_body_bytes):
            raise HTTPError(413 if declared.isdigit() else 400, over)
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > self.max_body_bytes:
                raise HTTPError(413, over)
        try:
            return json.loads(bytes(body), parse_constant=_reject_constant)
        except (ValueError, RecursionError) as e:
            raise HTTPError(400, f"request body is not valid JSON: {e}") from None

    async def _decode(self, request: Request, wire, **options) -> ChatRequest:
        body = await self._read_json(request)
        try:
            check_depth(body)
            if (where := lone_surrogate(body)) is not None:  # not text: the tokenizer would fail on it
                raise HTTPError(400, f"{where} holds a lone UTF-16 surrogate (not valid Unicode text)")
            self._check_template_args(body)
            chat = wire.decode(body, **options)
        except ValidationError as e:
            loc = e.errors()[0]["loc"] if e.error_count() else ()
            raise HTTPError(400, _summary(e), param=_field(loc) or None) from None
        self._check_model(chat.extra.get("model") or "")
        if chat.tools:
            self._warn_if_tools_ignored()
        chat.size = int(request.headers.get("content-length") or 0)
        chat.first_try = request.headers.get("x-stainless-retry-count") == "0"  # the OpenAI and Anthropic SDKs' count
        chat.extra["decode_token"] = self._decode_token
        return chat

    def _check_template_args(self, body: Any) -> None:
        """A request's `chat_template_kwargs` (vLLM's) may only restate the server's own template options
        (`--model.template_args`), which render every conversation of its sessions: others are a 400, not ignored."""
        asked = body.pop("chat_template_kwargs", None) if isinstance(body, dict) else None
        own = getattr(self.tokenizer, TEMPLATE_ARGS, {})
        restated = isinstance(asked, dict) and all(k in own and own[k] == v for k, v in asked.items())
        if asked is not None and not restated:
            raise HTTPError(400, f"chat_template_kwargs={json.dumps(asked)[:80]} is not this server's template "
                            f"options ({json.dumps(own)}, --model.template_args): they render every conversation, "
                            "so a request may only restate them", param="chat_template_kwargs")  # fmt: skip

    def _warn_if_tools_ignored(self) -> None:
        """Once per server (with render_tools on): log a warning if the chat template ignores `tools`, so that
        requests' tools never reach the prompt; such requests are still answered."""
        checked, self._tools_checked = self._tools_checked, True
        if checked or template_renders_tools(self.tokenizer):
            return
        parser = next(name for name in PARSERS if PARSERS[name] is self.parser)
        parsed = "so replies never carry tool calls" if parser == "none" else f"calls are parsed as {parser!r}"
        log.warning(
            "the chat template ignores `tools`: a request's tools are not rendered into the prompt (the model never "
            "sees them), and the tool parser (--chat.tool_parser) is %r, %s. Describe the tools in the messages "
            "(e.g. the system prompt) and pass --chat.no_render_tools (the policy knows its tools: this warning "
            "goes), and --chat.tool_parser hermes (or molt) to parse <tool_call>{json}</tool_call> calls it writes.",
            parser,
            parsed,
        )

    def _decode_token(self, token_id: int) -> tuple[str, bytes]:
        """A token as OpenAI's logprobs show it: its text and its own bytes, which joined rebuild the reply's
        UTF-8. A byte-level (or byte-fallback) token may hold part of a character: its text then escapes the
        bytes that do not decode ("\\xe3\\x81"), as OpenAI does. Other tokens: their decoded text's bytes."""
        text = self.tokenizer.decode([token_id])
        piece = None if token_id in self._added_ids else self.tokenizer.convert_ids_to_tokens(token_id)
        if self._byte_level and piece and all(c in BYTE_OF_CHAR for c in piece):
            raw = bytes(BYTE_OF_CHAR[c] for c in piece)
        elif piece and BYTE_FALLBACK.fullmatch(piece):  # sentencepiece's <0xE3>
            raw = bytes([int(piece[3:5], 16)])
        else:
            return text, text.encode()
        return (raw.decode(errors="backslashreplace") if "\ufffd" in text else text), raw

    async def _complete(self, request: Request, session_id: str | None, wire) -> Response:
        """One completion request -> JSON or an event stream; every failure in the wire's error format."""
        session, owned = None, session_id is None
        try:
            session = self._session(request, session_id)
            if owned:
                session = self.open_session(self.serve_sampling, max_len=self.serve_max_len, honor_sampling=True)
            chat = await self._decode(request, wire)
            if not chat.stream:
                turn = session.turn(chat)  # in process, the caller's cancellation reaches it directly
                reply = await (turn if request.scope.get(IN_PROCESS) else _unless_gone(request, turn))
                if reply is None:  # nobody reads the answer: nginx's "client closed request"
                    return Response(status_code=499)
                return JSONResponse(wire.encode(reply, self.model_name, chat))
            events = session.stream(chat)
            first = await anext(events)  # errors before anything was generated are plain HTTP errors
            owned = False  # the stream closes an implicit session when it ends
            body = self._sse(wire, chat, first, events, session if session_id is None else None)
            return StreamingResponse(body, media_type="text/event-stream")
        except Exception as e:  # noqa: BLE001 - every failure answers in the wire's format
            return self._error(wire, e, session_id)
        finally:
            if owned and session is not None:
                self.close_session(session.id)

    async def _sse(self, wire, chat: ChatRequest, first, events, implicit: Session | None) -> AsyncIterator[str]:
        async def all_events():
            yield first
            async for event in events:
                yield event

        try:
            async for text in wire.stream(all_events(), self.model_name, chat):
                yield text
        except Exception as e:  # noqa: BLE001 - mid-stream: an error event, then the stream ends
            status, message = self._failure(e, None)
            yield wire.stream_error(status, message)
        finally:
            await events.aclose()  # a client gone mid-stream: aborts the generation, records nothing
            if implicit is not None:
                self.close_session(implicit.id)

    def _failure(self, error: Exception, session_id: str | None) -> tuple[int, str]:
        """(HTTP status, message) of an exception; Molt's own bugs are logged with a request id."""
        if isinstance(error, HTTPError | RequestError | SessionClosed):
            return error.status, str(error)
        if isinstance(error, RecursionError):
            return 400, "the request nests too deeply"
        if isinstance(error, GenerationError):
            if not (self._server and self._server.should_exit):  # stopping: `stop` aborts the generations left
                log.warning("chat session %s: %s", session_id[:6] if session_id else "implicit", error)
            return 503, str(error)
        request_id = new_id("req_", 8)
        log.exception("chat server: internal error in request %s", request_id)
        return 500, f"internal error (request id {request_id}; see the server log)"

    async def _count_tokens(self, request: Request) -> Response:
        """Anthropic `count_tokens`: the prompt's tokens as the template renders it (nothing is generated)."""
        session_id = request.path_params.get("session_id")
        try:
            self._session(request, session_id)  # only checked to exist
            chat = await self._decode(request, wire_anthropic, counting=True)
            tools = chat.tools if self.render_tools else None
            ids = await off_loop(chat.size, self._prompt_ids, chat.messages, tools)
            forced = forced_prefix(self.parser, chat) if chat.force_tool is not None else None
            opening = self.tokenizer(forced, add_special_tokens=False)["input_ids"] if forced else []
            return JSONResponse({"input_tokens": len(ids) + len(opening)})  # as `messages` reports them
        except Exception as e:  # noqa: BLE001 - a template that cannot render it is a 400, the rest as elsewhere
            if isinstance(e, ImageError):
                e = RequestError(str(e))
            elif isinstance(e, TemplateError | TypeError | KeyError | ValueError) and not isinstance(e, RequestError):
                e = RequestError(f"the chat template cannot render these messages: {e}")
            return self._error(wire_anthropic, e, session_id)

    def _prompt_ids(self, messages: list, tools: list | None) -> list[int]:
        """The first prompt of `messages` as the engine takes it: rendered, its image placeholders expanded."""
        ids = first_prompt_ids(self.tokenizer, messages, tools)
        return expand_images(self.engine, ids, message_images(messages), 0)[0]

    def _error(self, wire, error: Exception, session_id: str | None) -> JSONResponse:
        status, message = self._failure(error, session_id)
        code, param = getattr(error, "code", None), getattr(error, "param", None)
        return JSONResponse(wire.error(status, message, code, param), status)
