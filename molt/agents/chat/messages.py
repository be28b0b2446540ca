"""The wire-independent chat request both decoders produce, and message fingerprints.

Messages are canonical dicts the chat template renders: `role` (system/user/assistant/tool), `content` (a string, or a
list of parts when not all text), and for assistant turns `tool_calls` in OpenAI form with `arguments` decoded to an
object. A *fingerprint* is what decides whether a request extends the session's conversation: role, content and calls
(name + arguments, compared as JSON values, so re-serialised arguments or `None` vs `""` content still match); call ids
are left out, because templates do not render them."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from molt.agents.chat.replies import RequestError
from molt.agents.chat.tool_parser import ToolCall

Message = dict[str, Any]


@dataclass
class ChatRequest:
    """One completion request, decoded from either wire."""

    messages: list[Message]
    tools: list[dict[str, Any]] | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop: tuple[str, ...] = ()
    parse_tools: bool = True  # False for tool_choice "none"
    stream: bool = False
    extra: dict[str, Any] = field(default_factory=dict)  # wire-specific options (e.g. include_usage)
    n: int = 1  # samples of this request (siblings sharing the prompt)
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0  # with logprobs: the k most likely tokens per generated token
    force_tool: str | None = None  # tool_choice required/any: "" (some tool), named: the function's name
    size: int = 0  # the request body's bytes (large ones are rendered off the event loop)
    first_try: bool = False  # the client says it is no retry (an SDK's x-stainless-retry-count 0): never a cached reply


def text_content(content: Any) -> str | list[dict[str, Any]]:
    """`None` -> "", all-text part lists -> their joined text, other lists kept as parts."""
    if content is None or isinstance(content, str):
        return content or ""
    parts = [dict(p) for p in content]
    if all(p.get("type") == "text" for p in parts):
        return "".join(str(p.get("text") or "") for p in parts)
    return parts


MAX_DEPTH = 64  # JSON nesting a request may use (tool schemas, arguments); deeper is refused (400)


class TooDeep(RequestError):
    """A request value nests deeper than MAX_DEPTH (its rendering would exhaust the interpreter's stack)."""


def check_depth(value: Any, where: str = "request body") -> None:
    """Raise TooDeep if `value` (parsed JSON) nests more than MAX_DEPTH levels; iterative, so never recurses."""
    level, frontier = 0, [value] if isinstance(value, dict | list) else []
    while frontier:
        frontier = [v for x in frontier for v in (x.values() if isinstance(x, dict) else x)
                    if isinstance(v, dict | list)]  # fmt: skip
        level += 1
        if frontier and level >= MAX_DEPTH:
            raise TooDeep(f"{where} nests deeper than {MAX_DEPTH} levels")


def refuse_unsupported(body: Any, defaults: dict[str, tuple]) -> None:
    """RequestError naming the first option of `defaults` (options Molt does not implement, each with the values
    that ask for nothing) that `body` sets otherwise: such a setting is refused, never silently ignored."""
    for name, allowed in defaults.items():
        if isinstance(body, dict) and body.get(name) not in (None, *allowed):
            asked = f"{name}={json.dumps(body[name])[:40]}"
            raise RequestError(f"{asked} is not supported by Molt's server; omit it" + "".join(
                f" or send {json.dumps(value)}" for value in allowed[:1]))  # fmt: skip


_SURROGATE = re.compile("[\ud800-\udfff]")


def lone_surrogate(value: Any, path: str = "body") -> str | None:
    """Where in `value` (parsed JSON, depth already checked) a string holds a lone UTF-16 surrogate, or None."""
    if isinstance(value, str):
        return path if not value.isascii() and _SURROGATE.search(value) else None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        where = f"{path}[{key}]" if isinstance(key, int) else f"{path}.{key}".removeprefix("body.")
        if (found := lone_surrogate(key, where) or lone_surrogate(item, where)) is not None:
            return found
    return None


def decode_arguments(arguments: Any) -> Any:
    """Tool-call arguments as a JSON value (a string that is not JSON stays a string); TooDeep if too nested."""
    if isinstance(arguments, str):
        try:
            value = json.loads(arguments)
        except RecursionError:
            raise TooDeep(f"tool-call arguments nest deeper than {MAX_DEPTH} levels") from None
        except ValueError:
            return arguments
        check_depth(value, "tool-call arguments")
        return value
    return arguments


def function_call(call_id: str, name: str, arguments: Any) -> dict[str, Any]:
    """A tool call in OpenAI form (`arguments`: an object in canonical messages, JSON text on the OpenAI wire)."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def assistant_message(content: str, calls: list[ToolCall]) -> Message:
    """The canonical assistant turn for a reply."""
    message: Message = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [function_call(c.id, c.name, c.arguments) for c in calls]
    return message


def fingerprint(message: Message) -> str:
    calls = [
        [call["function"]["name"], decode_arguments(call["function"].get("arguments"))]
        for call in message.get("tool_calls") or ()
    ]
    key = {"role": message["role"], "content": text_content(message.get("content")), "calls": calls}
    return json.dumps(key, sort_keys=True, ensure_ascii=False, default=str)


def fingerprints(messages: list[Message]) -> list[str]:
    return [fingerprint(m) for m in messages]


def request_key(request: ChatRequest) -> str:
    """Identity of a request for idempotent retries: its messages, tools and generation bounds."""
    key = [fingerprints(request.messages), request.tools, request.max_tokens, list(request.stop), request.n]
    key += [request.seed, request.force_tool, request.logprobs, request.top_logprobs]
    return json.dumps(key, sort_keys=True, ensure_ascii=False, default=str)
