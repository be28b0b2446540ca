"""What a chat session answers: the wire-independent reply (`TurnReply`), streamed text (`TextDelta`), the
errors a request can meet, and how a streaming consumer takes the engine's token deltas."""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass

from molt.agents.chat.tool_parser import ToolCall
from molt.engine.interface import TokenDelta


class SessionClosed(LookupError):
    """The session is unknown or its rollout has finished."""

    status = 404


class RequestError(ValueError):
    """The request is well-formed JSON but cannot be served: an invalid or unsupported option, messages the template
    cannot render (HTTP 400, as the OpenAI and Anthropic APIs answer); `param`: the field at fault, if one is."""

    status, code = 400, None

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class ContextLengthExceeded(RequestError):
    """Serve mode: the prompt leaves no room to generate (OpenAI's `context_length_exceeded`)."""

    code = "context_length_exceeded"

    def __init__(self, message: str):
        super().__init__(message, "messages")


class GenerationError(RuntimeError):
    """The engine failed or aborted the generation; nothing was recorded."""


@dataclass
class TurnReply:
    """What one request answers, wire-independent: the first sample, and `siblings` when n > 1."""

    content: str
    tool_calls: list[ToolCall]
    finish_reason: str  # stop | length | tool_calls
    num_prompt_tokens: int
    num_completion_tokens: int
    stop_sequence: str | None = None
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)  # the engine's, as trained on
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per token, when the request asked for them
    siblings: list[TurnReply] = dataclasses.field(default_factory=list)

    @property
    def choices(self) -> list[TurnReply]:
        return [self, *self.siblings]

    @classmethod
    def length(cls, n: int, num_prompt_tokens: int) -> TurnReply:
        """The empty "length" reply (no room left to generate), with its n choices."""
        return cls(
            "", [], "length", num_prompt_tokens, 0, siblings=[cls.length(1, num_prompt_tokens) for _ in range(n - 1)]
        )


@dataclass
class TextDelta:
    """Text of sample `index` that can be sent now, and the tokens generated since the last delta as (id, log-prob)
    pairs when the request asked for log-probs (else empty), with their alternatives if it asked for `top_logprobs`."""

    index: int
    text: str
    tokens: list[tuple[int, float]] = dataclasses.field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] | None = None
    num_prompt_tokens: int = 0  # the context's (Anthropic's message_start reports them)


async def take_all(inbox: asyncio.Queue) -> list:
    """All that arrived in `inbox` since the last take (waits for one): a slow consumer takes fewer, larger batches."""
    return [await inbox.get()] + [inbox.get_nowait() for _ in range(inbox.qsize())]


def coalesced(deltas: list[TokenDelta]) -> list[TokenDelta]:
    """One delta per sample: each sample's deltas concatenated, in order."""
    if len(deltas) == 1:
        return deltas
    merged: dict[int, TokenDelta] = {}
    for d in deltas:
        m = merged.setdefault(d.sample_index, TokenDelta(d.sample_index, [], [], []))
        m.token_ids += d.token_ids
        m.logprobs += d.logprobs
        m.top_logprobs = None if m.top_logprobs is None or d.top_logprobs is None else m.top_logprobs + d.top_logprobs
    return list(merged.values())
