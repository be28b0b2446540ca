"""Anthropic Messages wire: request schema -> `ChatRequest`, `TurnReply` -> message / event stream.

Decoding: top-level `system` becomes the first message; assistant `text` blocks are the content and
`tool_use` blocks its tool calls; each user `tool_result` block becomes a `tool` message (in order,
before the user's remaining text); `tools` (`input_schema`) become OpenAI function schemas so one
template path renders both wires. Base64 `image` blocks become image parts (for a VLM policy);
document blocks are refused (422).
Encoding: `text` and `tool_use` content blocks, `stop_reason` (end_turn, max_tokens, tool_use,
stop_sequence) and `usage`; streaming sends the standard event sequence after the generation.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from molt.agents.chat.messages import ChatRequest, text_content
from molt.agents.chat.session import TurnReply


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore")


class Block(_Model):
    type: str
    text: str | None = None
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None
    content: str | list[Block] | None = None
    source: dict[str, Any] | None = None

    @field_validator("type")
    @classmethod
    def _supported(cls, kind: str) -> str:
        if kind == "document":
            raise ValueError("document blocks are not supported")
        return kind

    def image_part(self) -> dict[str, Any]:
        """An `image` block as a canonical image part (base64 source -> data URI)."""
        src = self.source or {}
        if src.get("type") == "base64":
            return {"type": "image", "image": f"data:{src.get('media_type', 'image/png')};base64,{src.get('data', '')}"}
        return {"type": "image", "image": src.get("url", "")}


class MessageIn(_Model):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class ToolIn(_Model):
    name: str
    description: str | None = None
    input_schema: dict[str, Any] = Field(default_factory=dict)


class ToolChoice(_Model):
    type: Literal["auto", "any", "tool", "none"] = "auto"


class MessagesRequest(_Model):
    model: str = ""
    max_tokens: int | None = Field(default=None, ge=1)
    messages: list[MessageIn] = Field(min_length=1)
    system: str | list[Block] | None = None
    tools: list[ToolIn] | None = None
    tool_choice: ToolChoice | None = None
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = Field(default=None, gt=0, le=1)
    stop_sequences: list[str] | None = Field(default=None, max_length=8)
    stream: bool = False

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
            out["tool_calls"] = [
                {"id": b.id or "", "type": "function", "function": {"name": b.name or "", "arguments": b.input or {}}}
                for b in calls
            ]
        return [out]
    results = [
        {"role": "tool", "content": _text(b.content), "tool_call_id": b.tool_use_id or ""}
        for b in m.content
        if b.type == "tool_result"
    ]
    parts = [b.image_part() if b.type == "image" else {"type": "text", "text": b.text or ""} for b in m.content
             if b.type in ("text", "image")]  # fmt: skip
    return results + ([{"role": "user", "content": text_content(parts)}] if parts or not results else [])


def decode(body: Any) -> ChatRequest:
    """A validated request (raises pydantic.ValidationError)."""
    req = MessagesRequest.model_validate(body)
    messages = [{"role": "system", "content": text_content(_text(req.system))}] if req.system else []
    for m in req.messages:
        messages += _messages(m)
    tools = [
        {
            "type": "function",
            "function": {"name": t.name, "description": t.description or "", "parameters": t.input_schema},
        }
        for t in req.tools or ()
    ]
    return ChatRequest(
        messages=messages,
        tools=tools or None,
        max_tokens=req.max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        stop=tuple(req.stop_sequences or ()),
        parse_tools=not (req.tool_choice and req.tool_choice.type == "none"),
        stream=req.stream,
        extra={"model": req.model},
    )


STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def _stop_reason(reply: TurnReply) -> str:
    return "stop_sequence" if reply.stop_sequence else STOP_REASONS.get(reply.finish_reason, "end_turn")


def _blocks(reply: TurnReply) -> list[dict[str, Any]]:
    blocks = [{"type": "text", "text": reply.content}] if reply.content or not reply.tool_calls else []
    return blocks + [{"type": "tool_use", "id": c.id, "name": c.name, "input": c.arguments} for c in reply.tool_calls]


def encode(reply: TurnReply, model: str) -> dict[str, Any]:
    return {
        "id": "msg_" + secrets.token_hex(12),
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": _blocks(reply),
        "stop_reason": _stop_reason(reply),
        "stop_sequence": reply.stop_sequence,
        "usage": {"input_tokens": reply.num_prompt_tokens, "output_tokens": reply.num_completion_tokens},
    }


def _event(name: str, data: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps({'type': name, **data}, ensure_ascii=False)}\n\n"


def stream(reply: TurnReply, model: str, request: ChatRequest) -> Iterator[str]:
    """message_start, one start/delta/stop triple per content block, message_delta, message_stop."""
    message = encode(reply, model)
    usage = message["usage"]
    head = message | {"content": [], "stop_reason": None, "stop_sequence": None}
    yield _event("message_start", {"message": head | {"usage": usage | {"output_tokens": 0}}})
    for i, block in enumerate(message["content"]):
        if block["type"] == "text":
            yield _event("content_block_start", {"index": i, "content_block": {"type": "text", "text": ""}})
            delta = {"type": "text_delta", "text": block["text"]}
        else:
            yield _event("content_block_start", {"index": i, "content_block": block | {"input": {}}})
            delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"], ensure_ascii=False)}
        yield _event("content_block_delta", {"index": i, "delta": delta})
        yield _event("content_block_stop", {"index": i})
    stop = {"stop_reason": message["stop_reason"], "stop_sequence": message["stop_sequence"]}
    yield _event("message_delta", {"delta": stop, "usage": usage})
    yield _event("message_stop", {})


ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "request_too_large",
    422: "invalid_request_error",
}


def error(status: int, message: str) -> dict[str, Any]:
    kind = ERROR_TYPES.get(status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}
