"""Tool-call parsers: the policy's raw action text -> (content, tool calls), one per chat-template family.

A parser is a registered function `parse(text, tools) -> (content, calls)`. Calls are parsed only when the request
offered `tools`, and only into functions it offered; anything malformed (bad JSON, JSON no wire can send back such as
NaN or a lone surrogate, a name that is not an offered function, an unclosed tag) comes back as plain text with no
calls, never as an error. The trajectory always keeps the raw generated ids: parsing only shapes the reply to the agent.

* `hermes` (Qwen2.5/Qwen3, Hermes): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks.
* `molt` (the built-in ChatML template): hermes, plus the compact form `<tool_call>TEXT</tool_call>` when the request
  offers exactly one function with exactly one parameter and TEXT does not start with `{`: TEXT is that argument (the
  built-in calculator task's demonstrations call `<tool_call>347*29</tool_call>`).
* `none`: never parses calls."""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from molt.agents.chat.ids import new_id
from molt.models.tokenizer import BUILTIN_CHAT_TEMPLATE, BUILTIN_VLM_CHAT_TEMPLATE
from molt.registry import Registry

TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)
Tools = Sequence[dict[str, Any]]


@dataclass(frozen=True)
class ToolCall:
    """One parsed call; `arguments` is the decoded JSON object."""

    id: str
    name: str
    arguments: dict[str, Any]

    @property
    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False)


Parser = Callable[[str, Tools], tuple[str, list[ToolCall]]]
PARSERS: Registry[Parser] = Registry("tool parser")


def function_specs(tools: Tools) -> dict[str, dict[str, Any]]:
    """Offered function name -> its JSON-schema `parameters` (OpenAI function-tool form)."""
    specs = {}
    for tool in tools or ():
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            params = fn.get("parameters")
            specs[fn["name"]] = params if isinstance(params, dict) else {}
    return specs


def _finite(text: str) -> float:
    """A JSON number or constant (NaN, Infinity) as a float; ValueError unless finite."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is not a finite number")
    return value


def _strict_json(text: str) -> Any:
    """`text` as a JSON value every wire can send back: ValueError for NaN/Infinity, a float that overflows or a
    lone surrogate (the policy's text may hold any of them); RecursionError if absurdly nested."""
    value = json.loads(text, parse_constant=_finite, parse_float=_finite)
    json.dumps(value, ensure_ascii=False).encode()  # a lone surrogate: UnicodeEncodeError, a ValueError
    return value


def _json_call(body: str, specs: dict[str, dict[str, Any]]) -> ToolCall | None:
    try:
        obj = _strict_json(body)
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or obj["name"] not in specs:
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        args = _strict_json(args) if isinstance(args, str) else args
    except (ValueError, RecursionError):  # the policy's text: malformed (or absurdly nested) is plain text
        return None
    return ToolCall(new_id("call_"), obj["name"], args) if isinstance(args, dict) else None


def _split_calls(text: str, tools: Tools, compact: bool) -> tuple[str, list[ToolCall]]:
    specs = function_specs(tools)
    blocks = list(TOOL_CALL_RE.finditer(text))
    if not specs or not blocks:
        return text, []
    content = TOOL_CALL_RE.sub("", text)
    if "<tool_call>" in content or "</tool_call>" in content:
        return text, []  # an unclosed or stray tag: malformed
    bodies = [block[1].strip() for block in blocks]
    calls = [_json_call(body, specs) or (_compact_call(body, specs) if compact else None) for body in bodies]
    # the text before the first call as it was generated (a stream sends it so), less the space before the call
    content = content.rstrip() if text[: blocks[0].start()].strip() else content.strip()
    return (content, calls) if all(calls) else (text, [])  # one malformed call: all plain text


def _compact_call(body: str, specs: dict[str, dict[str, Any]]) -> ToolCall | None:
    if len(specs) != 1 or not body or body.startswith("{"):  # a JSON body that is no valid call stays malformed
        return None
    ((name, params),) = specs.items()
    props = params.get("properties")
    if not isinstance(props, dict) or len(props) != 1:
        return None
    return ToolCall(new_id("call_"), name, {next(iter(props)): body})


parse_hermes = PARSERS.add("hermes", functools.partial(_split_calls, compact=False))
parse_molt = PARSERS.add("molt", functools.partial(_split_calls, compact=True))


@PARSERS.register("none")
def parse_none(text: str, tools: Tools) -> tuple[str, list[ToolCall]]:
    """Tool calls are not parsed; the agent sees the raw text."""
    return text, []


def call_opener(parser: Parser) -> str | None:
    """The text that opens a tool call in `parser`'s format (a stream sends text up to it), or None if the parser
    has no format."""
    return "<tool_call>" if parser in (parse_hermes, parse_molt) else None


def call_prefix(parser: Parser, name: str) -> str | None:
    """Text that opens a tool call in `parser`'s format (of function `name`, or any when ""), which a request
    with tool_choice required/named puts after the generation prompt; None if the parser has no format."""
    if (opener := call_opener(parser)) is None:
        return None
    return opener + "\n" + (f'{{"name": {json.dumps(name)}, "arguments": ' if name else "")


def get_parser(name: str, tokenizer=None) -> Parser:
    """The parser `name`; "auto" picks by the tokenizer's chat template (built-in, hermes-style, none)."""
    if name == "auto":
        template = getattr(tokenizer, "chat_template", None) or ""
        template = template if isinstance(template, str) else json.dumps(template)
        builtin = template in (BUILTIN_CHAT_TEMPLATE, BUILTIN_VLM_CHAT_TEMPLATE)
        name = "molt" if builtin else "hermes" if "<tool_call>" in template else "none"
    if name not in PARSERS:
        raise ValueError(f"chat.tool_parser: unknown parser {name!r}; choose auto or one of {sorted(PARSERS)}")
    return PARSERS[name]
