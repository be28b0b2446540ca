"""OpenAI Chat Completions wire: request schema -> `ChatRequest`, `TurnReply` -> response / SSE chunks.

Decoding: `developer` becomes `system`; content is a string or text and `image_url` parts (base64 data URIs only, for a
VLM policy: a URL or path is a 400, never fetched or read; audio is refused with 400); tool-call arguments are decoded
from JSON; tools need unique names without whitespace and `parameters` describing an object (else 400, as OpenAI
answers). `n` samples share the prompt; `seed` and `top_k` (vLLM's extra) apply in serve mode; `tool_choice` required /
named opens the reply with a tool call of the request's tools; `response_format` other than `text`, `top_logprobs`
without `logprobs`, and the options of `UNSUPPORTED` set to anything but their no-op values are refused (400).

Encoding: one choice per sample with `content` and parsed `tool_calls`; `logprobs` are the engine's (by default
log_softmax(logits / T) over the whole vocabulary: the number the trainer's ratio uses), one per generated token, as
captured (a trimmed stop string's tokens and the end-of-turn token included), and `top_logprobs` the k most likely
tokens under that same distribution (each token's `bytes` are its own: a byte-level token may hold part of a character,
whose `token` escapes those bytes); `usage` counts the whole context as prompt. Streaming sends role, content deltas as
the engine generates (with their `logprobs`), then each tool call (id and name, then its arguments in pieces, as OpenAI
does), finish, usage when `stream_options.include_usage`, and `[DONE]`."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from molt.agents.chat.ids import new_id
from molt.agents.chat.messages import ChatRequest, decode_arguments, function_call, refuse_unsupported, text_content
from molt.agents.chat.replies import RequestError, TextDelta, TurnReply

MAX_N = 16  # samples per request (each holds a sequence slot)
# options Molt does not implement, with the values that ask for nothing: any other value is a 400, never ignored
UNSUPPORTED = {
    "frequency_penalty": (0,),
    "presence_penalty": (0,),
    "logit_bias": ({},),
    "repetition_penalty": (1,),
    "min_p": (0,),
    "parallel_tool_calls": (True,),
    "functions": ([],),
    "function_call": ("none", "auto"),
    "modalities": (["text"],),
} | dict.fromkeys(("audio", "prediction", "reasoning_effort", "web_search_options"), ())  # any value is refused


TOOL_NAME = r"^[^\s]{1,128}$"  # a tool's name: looser than either API (MCP's dotted names, long prefixed ones)
NOT_FETCHED = "image URLs and paths are not fetched; send the image as a base64 data URI (data:image/png;base64,...)"


class WireModel(BaseModel):  # both wires' schemas: unknown fields are ignored
    model_config = ConfigDict(extra="ignore")


def object_schema(schema: dict[str, Any] | None) -> dict[str, Any] | None:
    """A tool's JSON schema, which must describe an object (its `type`, if given, is "object"), as both APIs check."""
    kind = (schema or {}).get("type", "object")
    if kind != "object" and not (isinstance(kind, list) and "object" in kind):
        raise ValueError(f"a tool's schema must describe an object (type 'object'), not {kind!r}")
    return schema


def unique_names(names: list[str]) -> None:
    """Tools share a request's namespace: a name given twice is refused (OpenAI and Anthropic answer 400)."""
    if twice := sorted({name for name in names if names.count(name) > 1}):
        raise ValueError(f"tool names must be unique; {', '.join(map(repr, twice))} given more than once")


class ImageUrl(WireModel):
    url: str


class ContentPart(WireModel):
    type: Literal["text", "image_url"]  # audio/file parts are refused (400), not dropped
    text: str | None = None
    image_url: ImageUrl | None = None

    def canonical(self) -> dict[str, Any]:
        if self.type == "image_url":
            if self.image_url is None:
                raise RequestError("an image_url part needs image_url.url")
            if not self.image_url.url.startswith("data:"):
                raise RequestError(NOT_FETCHED)
            return {"type": "image", "image": self.image_url.url}
        return {"type": "text", "text": self.text or ""}


class FunctionCall(WireModel):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallIn(WireModel):
    id: str = ""
    type: str = "function"
    function: FunctionCall


class MessageIn(WireModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class FunctionSpec(WireModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(pattern=TOOL_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None

    _object = field_validator("parameters")(object_schema)


class ToolSpec(WireModel):
    type: Literal["function"] = "function"
    function: FunctionSpec


class StreamOptions(WireModel):
    include_usage: bool = False


class CompletionRequest(WireModel):
    model: str = ""
    messages: list[MessageIn] = Field(min_length=1)
    tools: list[ToolSpec] | None = None
    tool_choice: str | dict[str, Any] | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1)  # vLLM's extra_body option; 0 or -1: off
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    response_format: dict[str, Any] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None

    @field_validator("tools")
    @classmethod
    def _unique(cls, tools):
        unique_names([t.function.name for t in tools or ()])
        return tools

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
            function_call(c.id, c.function.name, decode_arguments(c.function.arguments)) for c in m.tool_calls
        ]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    return out


def _forced_tool(choice: str | dict[str, Any] | None) -> str | None:
    """tool_choice -> the function a call must open with ("" any), or None (auto / none)."""
    if choice is None or choice in ("auto", "none"):
        return None
    if choice == "required":
        return ""
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(name, str) or not name:
        raise RequestError(
            "tool_choice must be none, auto, required or {type: function, function: {name}}", "tool_choice"
        )
    return name


def decode(body: Any) -> ChatRequest:
    """A validated request (raises pydantic.ValidationError, or RequestError for unsupported options)."""
    req = CompletionRequest.model_validate(body)
    refuse_unsupported(body, UNSUPPORTED)
    kind = (req.response_format or {}).get("type", "text")
    if kind != "text":
        raise RequestError(f"response_format {kind!r} is not supported (only 'text'): the output is unconstrained")
    if req.top_logprobs and not req.logprobs:
        raise RequestError("top_logprobs needs logprobs: true")
    return ChatRequest(
        messages=[_message(m) for m in req.messages],
        tools=list(body["tools"]) if req.tools else None,  # as sent (checked above): rendered as transformers would
        max_tokens=req.max_completion_tokens or req.max_tokens,
        stop=tuple(req.stop or ()),
        parse_tools=req.tool_choice != "none",
        extra={"include_usage": bool(req.stream_options and req.stream_options.include_usage), "model": req.model},
        top_logprobs=req.top_logprobs or 0,
        force_tool=_forced_tool(req.tool_choice),
        **req.model_dump(include={"temperature", "top_p", "top_k", "stream", "n", "seed", "logprobs"}),  # as given
    )


def _usage(reply: TurnReply) -> dict[str, int]:
    prompt, completion = reply.num_prompt_tokens, sum(c.num_completion_tokens for c in reply.choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _head(kind: str, model: str) -> dict[str, Any]:
    return {"id": new_id("chatcmpl-"), "object": kind, "created": int(time.time()), "model": model}


def _logprobs(tokens, tops, decode_token) -> dict[str, Any]:
    """OpenAI `logprobs.content`: each (token, the engine's log-prob: the one trained on) with its `top_logprobs`
    alternatives (`tops`, one list per token, or None); `decode_token(id)` gives a token's text and bytes."""

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text, raw = decode_token(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(raw)}

    tops = tops or [()] * len(tokens)
    return {"content": [entry(i, lp) | {"top_logprobs": [entry(*t) for t in top]}
                        for (i, lp), top in zip(tokens, tops, strict=True)]}  # fmt: skip


def _choice_logprobs(choice: TurnReply, request: ChatRequest, start: int = 0) -> dict[str, Any] | None:
    """The log-probs of `choice`'s tokens from `start` on, if the request asked for them."""
    if not request.logprobs:
        return None
    tops = choice.top_logprobs[start:] if choice.top_logprobs else None
    tokens = list(zip(choice.token_ids[start:], choice.logprobs[start:], strict=True))
    return _logprobs(tokens, tops, request.extra["decode_token"])


def _choice(index: int, choice: TurnReply, request: ChatRequest) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": choice.content or (None if choice.tool_calls else "")}
    if choice.tool_calls:
        message["tool_calls"] = [function_call(c.id, c.name, c.arguments_json) for c in choice.tool_calls]
    logprobs = _choice_logprobs(choice, request)
    return {"index": index, "message": message, "finish_reason": choice.finish_reason, "logprobs": logprobs}


def encode(reply: TurnReply, model: str, request: ChatRequest) -> dict[str, Any]:
    choices = [_choice(i, choice, request) for i, choice in enumerate(reply.choices)]
    return _head("chat.completion", model) | {"choices": choices, "usage": _usage(reply)}


ARGUMENT_PIECE = 16  # characters of tool-call arguments per streamed chunk


def pieces(arguments: str) -> list[str]:
    """Tool-call arguments in the pieces both wires stream them in."""
    return [arguments[at : at + ARGUMENT_PIECE] for at in range(0, len(arguments), ARGUMENT_PIECE)]


async def stream(events: AsyncIterator[TextDelta | TurnReply], model: str, request: ChatRequest) -> AsyncIterator[str]:
    """`chat.completion.chunk` events as text is generated, then tool calls, finish reasons, usage, `[DONE]`."""
    head = _head("chat.completion.chunk", model)

    def chunk(index: int, delta: dict[str, Any], finish: str | None = None, logprobs=None) -> str:
        body = head | {"choices": [{"index": index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}]}
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    for i in range(request.n):
        yield chunk(i, {"role": "assistant", "content": ""})
    sent, num_sent = [""] * request.n, [0] * request.n  # text and tokens (their log-probs) sent per choice
    async for event in events:
        if isinstance(event, TextDelta):
            sent[event.index] += event.text
            num_sent[event.index] += len(event.tokens)
            decode = request.extra["decode_token"]
            logprobs = _logprobs(event.tokens, event.top_logprobs, decode) if event.tokens else None
            yield chunk(event.index, {"content": event.text}, logprobs=logprobs)
            continue
        for i, choice in enumerate(event.choices):
            rest, logprobs = choice.content[len(sent[i]) :], _choice_logprobs(choice, request, num_sent[i])
            if rest or (logprobs and logprobs["content"]):
                yield chunk(i, {"content": rest}, logprobs=logprobs)
            for k, call in enumerate(choice.tool_calls):
                yield chunk(i, {"tool_calls": [{"index": k} | function_call(call.id, call.name, "")]})
                for piece in pieces(call.arguments_json):
                    yield chunk(i, {"tool_calls": [{"index": k, "function": {"arguments": piece}}]})
            yield chunk(i, {}, choice.finish_reason)
        if request.extra.get("include_usage"):
            yield f"data: {json.dumps(head | {'choices': [], 'usage': _usage(event)})}\n\n"
    yield "data: [DONE]\n\n"


def stream_error(status: int, message: str) -> str:
    return f"data: {json.dumps(error(status, message))}\n\n"


def error(status: int, message: str, code: str | None = None, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error body (a wrong key and an unknown model are `invalid_request_error`s too): `code` a string
    (`invalid_api_key`, `model_not_found`, `context_length_exceeded`, ...) or null; `param` the field at fault."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
