"""OpenAI Chat Completions wire: request schema -> `ChatRequest`, `TurnReply` -> response / SSE chunks.

Decoding: `developer` becomes `system`; content is a string or text and `image_url` parts (data URIs,
for a VLM policy; audio is refused with 422); assistant `tool_calls`
arguments are decoded from their JSON string. `n` must be 1 (each sample is its own rollout).
Encoding: one choice whose message carries `content` and parsed `tool_calls`; `usage` counts the
engine's prompt (the whole context) and generated tokens. Streaming sends the reply as chunks
(role, content, each tool call, finish, then usage when `stream_options.include_usage`) and
`[DONE]`; the engine interface returns whole completions, so chunks follow the generation.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Iterator
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from molt.agents.chat.messages import ChatRequest, decode_arguments, text_content
from molt.agents.chat.session import TurnReply


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore")


class ImageUrl(_Model):
    url: str


class ContentPart(_Model):
    type: Literal["text", "image_url"]  # audio/file parts are refused (422), not dropped
    text: str | None = None
    image_url: ImageUrl | None = None

    def canonical(self) -> dict[str, Any]:
        if self.type == "image_url":
            if self.image_url is None:
                raise ValueError("an image_url part needs image_url.url")
            return {"type": "image", "image": self.image_url.url}
        return {"type": "text", "text": self.text or ""}


class FunctionCall(_Model):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallIn(_Model):
    id: str = ""
    type: str = "function"
    function: FunctionCall


class MessageIn(_Model):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class FunctionSpec(_Model):
    model_config = ConfigDict(extra="allow")
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolSpec(_Model):
    type: Literal["function"] = "function"
    function: FunctionSpec


class StreamOptions(_Model):
    include_usage: bool = False


class CompletionRequest(_Model):
    model: str = ""
    messages: list[MessageIn] = Field(min_length=1)
    tools: list[ToolSpec] | None = None
    tool_choice: str | dict[str, Any] | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None

    @field_validator("n")
    @classmethod
    def _one_sample(cls, n: int) -> int:
        if n != 1:
            raise ValueError("n must be 1 (each sample is its own rollout: open more sessions)")
        return n

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, stop):
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if any(not s for s in stops) or len(stops) > 4:
            raise ValueError("stop must be at most 4 non-empty strings")
        return stops


def _message(m: MessageIn) -> dict[str, Any]:
    out: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role}
    out["content"] = text_content([p.canonical() for p in m.content] if isinstance(m.content, list) else m.content)
    if m.tool_calls:
        out["tool_calls"] = [
            {
                "id": c.id,
                "type": "function",
                "function": {"name": c.function.name, "arguments": decode_arguments(c.function.arguments)},
            }
            for c in m.tool_calls
        ]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    return out


def decode(body: Any) -> ChatRequest:
    """A validated request (raises pydantic.ValidationError)."""
    req = CompletionRequest.model_validate(body)
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    return ChatRequest(
        messages=[_message(m) for m in req.messages],
        tools=tools,
        max_tokens=req.max_completion_tokens or req.max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        stop=tuple(req.stop or ()),
        parse_tools=req.tool_choice != "none",
        stream=req.stream,
        extra={"include_usage": bool(req.stream_options and req.stream_options.include_usage), "model": req.model},
    )


def _tool_calls(reply: TurnReply) -> list[dict[str, Any]]:
    return [
        {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments_json}}
        for c in reply.tool_calls
    ]


def _usage(reply: TurnReply) -> dict[str, int]:
    return {
        "prompt_tokens": reply.num_prompt_tokens,
        "completion_tokens": reply.num_completion_tokens,
        "total_tokens": reply.num_prompt_tokens + reply.num_completion_tokens,
    }


def encode(reply: TurnReply, model: str) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": reply.content or (None if reply.tool_calls else "")}
    if reply.tool_calls:
        message["tool_calls"] = _tool_calls(reply)
    return {
        "id": "chatcmpl-" + secrets.token_hex(12),
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": reply.finish_reason, "logprobs": None}],
        "usage": _usage(reply),
    }


def stream(reply: TurnReply, model: str, request: ChatRequest) -> Iterator[str]:
    """Server-sent events of `chat.completion.chunk` objects, then `[DONE]`."""
    head = {"id": "chatcmpl-" + secrets.token_hex(12), "object": "chat.completion.chunk", "created": int(time.time())}
    head["model"] = model

    def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> str:
        body = head | {"choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]} | extra
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    yield chunk({"role": "assistant", "content": ""})
    if reply.content:
        yield chunk({"content": reply.content})
    for i, call in enumerate(_tool_calls(reply)):
        yield chunk({"tool_calls": [{"index": i, **call}]})
    yield chunk({}, reply.finish_reason)
    if request.extra.get("include_usage"):
        yield f"data: {json.dumps(head | {'choices': [], 'usage': _usage(reply)})}\n\n"
    yield "data: [DONE]\n\n"


ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error"}


def error(status: int, message: str) -> dict[str, Any]:
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}
