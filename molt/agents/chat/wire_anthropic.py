"""Anthropic Messages wire: request schema -> `ChatRequest`, `TurnReply` -> message / event stream.

Decoding: top-level `system` becomes the first message; assistant `text` blocks are the content and `tool_use` blocks
its tool calls; each user `tool_result` block becomes a `tool` message (in order, before the user's remaining text; its
images kept); `tools` (unique names; `input_schema` an object's, or none for a typed client tool such as `bash`)
become OpenAI function schemas so one template path renders both wires. Base64 `image` blocks become image parts
(for a VLM policy; a `url` or `file` source is a 400, never fetched), as are OpenAI `image_url` parts with a data URI
(`ChatContext.messages` hold those, so one list drives both SDKs); document blocks are refused (400). `max_tokens`
is required (not by `count_tokens`); `top_k` applies in serve mode; a final assistant
message (a prefill to continue), the `UNSUPPORTED` options (`thinking`, `output_config`) and
`tool_choice.disable_parallel_tool_use` true are refused (400): Molt's reply is always a new turn, captured token-exact.
Encoding: `text` and `tool_use` content blocks (ids `toolu_...`), `stop_reason` (end_turn, max_tokens, tool_use,
stop_sequence) and `usage`; `tool_choice` any / tool opens the reply with a call of the request's
tools. Streaming sends the standard event sequence as the engine generates: text deltas live, then each
`tool_use` block with its input in `input_json_delta` pieces."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from molt.agents.chat.ids import new_id
from molt.agents.chat.messages import ChatRequest, function_call, refuse_unsupported, text_content
from molt.agents.chat.replies import RequestError, TextDelta, TurnReply
from molt.agents.chat.wire_openai import NOT_FETCHED, TOOL_NAME, WireModel, object_schema, pieces, unique_names

# options Molt does not implement, with the values that ask for nothing: any other value is a 400, never ignored
UNSUPPORTED = {"thinking": ({"type": "disabled"},), "output_config": ({},), "mcp_servers": ([],)}


class Block(WireModel):
    type: str
    text: str | None = None
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None
    content: str | list[Block] | None = None
    source: dict[str, Any] | None = None
    image_url: dict[str, Any] | None = None  # an OpenAI image part (ChatContext.messages hold those)

    @field_validator("type")
    @classmethod
    def _supported(cls, kind: str) -> str:
        if kind == "document":
            raise ValueError("document blocks are not supported")
        return kind

    def image_part(self) -> dict[str, Any]:
        """An `image` block (base64 source) or OpenAI `image_url` part (data URI) as a canonical image part."""
        src = self.source or {}
        if self.type == "image_url":
            url = (self.image_url or {}).get("url")
            if not isinstance(url, str) or not url.startswith("data:"):
                raise RequestError(NOT_FETCHED)
            return {"type": "image", "image": url}
        if src.get("type") == "base64":
            return {"type": "image", "image": f"data:{src.get('media_type', 'image/png')};base64,{src.get('data', '')}"}
        if src.get("type") == "file":
            raise RequestError("image file_id sources are not supported; send a base64 image source")
        raise RequestError("image URLs are not fetched; send a base64 image source (source.type 'base64')")


class MessageIn(WireModel):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class ToolIn(WireModel):
    type: str | None = None  # "custom" (or none): a function with its schema; else a typed client tool (bash_...)
    name: str = Field(pattern=TOOL_NAME)
    description: str | None = None
    input_schema: dict[str, Any] | None = None

    _object = field_validator("input_schema")(object_schema)

    @model_validator(mode="after")
    def _schema_given(self) -> ToolIn:
        if self.input_schema is None and self.type in (None, "custom"):
            raise ValueError("input_schema: required for a custom tool (only a typed client tool such as "
                             "bash_20250124 may leave it out)")  # fmt: skip
        return self


class ToolChoice(WireModel):
    type: Literal["auto", "any", "tool", "none"] = "auto"
    name: str | None = None
    disable_parallel_tool_use: bool = False

    @field_validator("disable_parallel_tool_use")
    @classmethod
    def _parallel(cls, disable: bool) -> bool:
        if disable:  # as OpenAI's parallel_tool_calls false: refused, not ignored
            raise ValueError("true is not supported: a reply holds every tool call the policy writes")
        return disable

    def forced(self) -> str | None:
        """The function a reply must call ("" any) or None."""
        if self.type == "any":
            return ""
        if self.type == "tool":
            if not self.name:
                raise RequestError("tool_choice type 'tool' needs a name", "tool_choice")
            return self.name
        return None


class MessagesRequest(WireModel):
    model: str = ""
    max_tokens: int | None = Field(default=None, ge=1)
    messages: list[MessageIn] = Field(min_length=1)
    system: str | list[Block] | None = None
    tools: list[ToolIn] | None = None
    tool_choice: ToolChoice | None = None
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    stop_sequences: list[str] | None = Field(default=None, max_length=8)
    stream: bool = False

    @field_validator("tools")
    @classmethod
    def _unique(cls, tools):
        unique_names([t.name for t in tools or ()])
        return tools

    @field_validator("stop_sequences")
    @classmethod
    def _non_empty(cls, stops):
        if stops and any(not s for s in stops):
            raise ValueError("stop_sequences must be non-empty strings")
        return stops


Block.model_rebuild()


def _text(blocks: str | list[Block] | None) -> str:
    if blocks is None or isinstance(blocks, str):
        return blocks or ""
    return "".join(b.text or "" for b in blocks if b.type == "text")


def _messages(m: MessageIn) -> list[dict[str, Any]]:
    if isinstance(m.content, str):
        return [{"role": m.role, "content": m.content}]
    if m.role == "assistant":
        out: dict[str, Any] = {"role": "assistant", "content": _text(m.content)}
        calls = [b for b in m.content if b.type == "tool_use"]
        if calls:
            out["tool_calls"] = [function_call(b.id or "", b.name or "", b.input or {}) for b in calls]
        return [out]
    results = [
        {"role": "tool", "content": text_content(_parts(b.content)), "tool_call_id": b.tool_use_id or ""}
        for b in m.content
        if b.type == "tool_result"
    ]
    parts = _parts(m.content)
    return results + ([{"role": "user", "content": text_content(parts)}] if parts or not results else [])


def _parts(blocks: str | list[Block] | None) -> list[dict[str, Any]]:
    """The text and image blocks of a user message or a `tool_result` (a screenshot tool's image) as content parts."""
    if blocks is None or isinstance(blocks, str):
        return [{"type": "text", "text": blocks}] if blocks else []
    return [{"type": "text", "text": b.text or ""} if b.type == "text" else b.image_part() for b in blocks
            if b.type in ("text", "image", "image_url")]  # fmt: skip


def decode(body: Any, counting: bool = False) -> ChatRequest:
    """A validated request (raises pydantic.ValidationError, or RequestError for what Molt refuses); `counting`:
    for `count_tokens`, which needs no `max_tokens`."""
    req = MessagesRequest.model_validate(body)
    refuse_unsupported(body, UNSUPPORTED)
    if req.max_tokens is None and not counting:
        raise RequestError("max_tokens is required")
    if req.messages[-1].role == "assistant":
        raise RequestError("a final assistant message (prefill) is not supported: Molt's reply is a new turn")
    messages = [{"role": "system", "content": text_content(_text(req.system))}] if req.system else []
    messages += [message for m in req.messages for message in _messages(m)]
    specs = [
        {"name": t.name, "description": t.description or "", "parameters": t.input_schema or {}}
        for t in req.tools or ()
    ]
    return ChatRequest(
        messages=messages,
        tools=[{"type": "function", "function": spec} for spec in specs] or None,
        stop=tuple(req.stop_sequences or ()),
        parse_tools=not (req.tool_choice and req.tool_choice.type == "none"),
        extra={"model": req.model},
        force_tool=req.tool_choice.forced() if req.tool_choice else None,
        **req.model_dump(include={"max_tokens", "temperature", "top_p", "top_k", "stream"}),  # as given
    )


STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def _stop(reply: TurnReply) -> dict[str, Any]:
    reason = "stop_sequence" if reply.stop_sequence else STOP_REASONS.get(reply.finish_reason, "end_turn")
    return {"stop_reason": reason, "stop_sequence": reply.stop_sequence}


def _usage(reply: TurnReply) -> dict[str, int]:
    return {"input_tokens": reply.num_prompt_tokens, "output_tokens": reply.num_completion_tokens}


def _head(model: str, content: list[dict[str, Any]]) -> dict[str, Any]:
    return {"id": new_id("msg_"), "type": "message", "role": "assistant", "model": model, "content": content}


def _tool_use_id(call_id: str) -> str:
    """A tool call's id as Anthropic's look (`toolu_...`; the parser's are OpenAI's `call_...`). Only the wire
    shows it: a `tool_result` names the id its client got, and a request continues a segment by its messages'
    fingerprints, which leave ids out, after the reply's own tokens (never re-rendered from its id)."""
    return "toolu_" + call_id.removeprefix("call_")


def encode(reply: TurnReply, model: str, request: ChatRequest) -> dict[str, Any]:
    blocks = [{"type": "text", "text": reply.content}] if reply.content or not reply.tool_calls else []
    blocks += [
        {"type": "tool_use", "id": _tool_use_id(c.id), "name": c.name, "input": c.arguments} for c in reply.tool_calls
    ]
    return _head(model, blocks) | _stop(reply) | {"usage": _usage(reply)}


_json = json.JSONEncoder(ensure_ascii=False).encode  # = json.dumps(x, ensure_ascii=False), one encoder for all


def _event(name: str, data: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {_json({'type': name, **data})}\n\n"


# the stream's fixed events, and a text delta's event split around its text (the bytes `_event` writes)
TEXT_START = _event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
TEXT_STOP = _event("content_block_stop", {"index": 0})
MESSAGE_STOP = _event("message_stop", {})
_MARK = "\x00"
TEXT_DELTA = _event("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": _MARK}}).split(
    json.dumps(_MARK)
)


def _text_delta(text: str) -> str:
    return _json(text).join(TEXT_DELTA)


def _tool_use_events(index: int, call) -> Iterator[str]:
    block = {"type": "tool_use", "id": _tool_use_id(call.id), "name": call.name, "input": {}}
    yield _event("content_block_start", {"index": index, "content_block": block})
    for piece in pieces(_json(call.arguments)):
        delta = {"type": "input_json_delta", "partial_json": piece}
        yield _event("content_block_delta", {"index": index, "delta": delta})
    yield _event("content_block_stop", {"index": index})


async def stream(events: AsyncIterator[TextDelta | TurnReply], model: str, request: ChatRequest) -> AsyncIterator[str]:
    """message_start (with the prompt's tokens, once the first event has them), text deltas as generated (an empty
    reply: an empty text block), tool_use blocks (input_json_delta pieces), message_delta, message_stop; the events one
    session event brings go out as one chunk (each chunk costs the client a read)."""
    start = _head(model, []) | {"stop_reason": None, "stop_sequence": None}
    parts, sent, text_open = [], "", False
    async for event in events:
        if start is not None:
            usage = {"input_tokens": event.num_prompt_tokens, "output_tokens": 0}
            parts, start = [_event("message_start", {"message": start | {"usage": usage}})], None
        text = event.text if isinstance(event, TextDelta) else event.content[len(sent) :]
        if text:  # the text block opens with the first text
            parts += [_text_delta(text)] if text_open else [TEXT_START, _text_delta(text)]
            sent, text_open = sent + text, True
        if isinstance(event, TextDelta):
            if parts:
                yield "".join(parts)
                parts = []
            continue
        if not text_open and not event.tool_calls:  # an empty reply: one empty text block, as `encode` gives
            parts.append(TEXT_START)
            text_open = True
        if text_open:
            parts.append(TEXT_STOP)
        for k, call in enumerate(event.tool_calls):
            parts += _tool_use_events(k + text_open, call)
        parts.append(_event("message_delta", {"delta": _stop(event), "usage": _usage(event)}))
    yield "".join([*parts, MESSAGE_STOP])


def stream_error(status: int, message: str) -> str:
    return _event("error", {"error": error(status, message)["error"]})


ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "invalid_request_error", 413: "request_too_large"}  # fmt: skip


def error(status: int, message: str, code: str | None = None, param: str | None = None) -> dict[str, Any]:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}
