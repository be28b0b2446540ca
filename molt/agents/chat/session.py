"""Token-exact capture of one chat session: requests in, engine generations and segments out.

Plain Python over the engine interface and the tokenizer (no HTTP), so it is tested directly.
Per request, under the session's lock:

1. A retry (same messages, tools and bounds as the last request) returns the cached reply.
2. If the messages start with the previous request's messages plus the reply it got (compared by
   fingerprint, `messages.py`) and the tools are unchanged, the request *extends* the segment: only
   the template's delta after the last action is tokenized (`observation_ids`, which renders the
   action as a probe), and the context is the segment's exact ids + delta. Earlier actions are never
   re-tokenized.
3. Otherwise (first turn, compaction, changed tools, or a template that re-renders history) the
   whole conversation is rendered as the prompt of a new segment; the current one is sealed.
4. Nothing is recorded until generation succeeds; a failed or aborted generation leaves the session
   as it was, so a client retry re-runs cleanly. No room left (context or turn budget) answers an
   empty "length" reply without generating.
"""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
from dataclasses import dataclass

from jinja2 import TemplateError

from molt.agents.chat.messages import (
    ChatRequest,
    Message,
    assistant_message,
    fingerprint,
    fingerprints,
    request_key,
)
from molt.agents.chat.tool_parser import Parser, ToolCall, parse_none
from molt.agents.images import expand_images, message_images
from molt.agents.runner import TemplateRewriteError, observation_ids
from molt.data.trajectory import Trajectory
from molt.engine.interface import Completion, ContextLengthError, SamplingParams
from molt.models.tokenizer import apply_chat_template
from molt.models.vision import ImageError


class SessionClosed(LookupError):
    """The session is unknown or its rollout has finished."""


class RequestError(ValueError):
    """The request is well-formed JSON but cannot be served (e.g. the template cannot render it)."""


class GenerationError(RuntimeError):
    """The engine failed or aborted the generation; nothing was recorded."""


@dataclass
class TurnReply:
    """What one request answers, wire-independent."""

    content: str
    tool_calls: list[ToolCall]
    finish_reason: str  # stop | length | tool_calls
    num_prompt_tokens: int
    num_completion_tokens: int
    stop_sequence: str | None = None


@dataclass
class _Plan:
    context: list[int]  # what the engine sees
    new_ids: list[int]  # the new segment's prompt, or the delta appended to the current segment
    new_segment: bool
    images: list = dataclasses.field(default_factory=list)  # records of the images in new_ids (absolute starts)


class Session:
    """One rollout's conversation state: sealed segments, the current one, and the last reply."""

    def __init__(
        self,
        session_id: str,
        engine,
        tokenizer,
        sampling: SamplingParams,
        *,
        max_len: int,
        max_turns: int | None = None,
        parser: Parser = parse_none,
        render_tools: bool = True,
        honor_sampling: bool = False,
        keep_ids: bool = False,
    ):
        self.id, self.engine, self.tokenizer, self.sampling = session_id, engine, tokenizer, sampling
        self.max_len, self.max_turns, self.parser = max_len, max_turns, parser
        self.render_tools, self.honor_sampling, self.keep_ids = render_tools, honor_sampling, keep_ids
        self.lock = asyncio.Lock()
        self.sealed: list[Trajectory] = []
        self.current: Trajectory | None = None
        self.tools: list | None = None  # tools rendered into the current segment
        self.history: list[Message] = []  # the messages the current segment's last action answered
        self.history_fps: list[str] = []  # their fingerprints + the reply's
        self.ended_with_eos = False
        self.last_key: str | None = None
        self.last_reply: TurnReply | None = None
        self.num_turns = 0
        self.truncated = self.closed = False

    async def turn(self, request: ChatRequest) -> TurnReply:
        """Answer one request (idempotent for retries); raises SessionClosed, RequestError, GenerationError."""
        async with self.lock:
            if self.closed:
                raise SessionClosed(f"session {self.id[:6]}... is finished")
            key = request_key(request)
            if key == self.last_key:
                return self.last_reply
            reply = await self._answer(request)
            self.last_key, self.last_reply = key, reply
            return reply

    def close(self) -> list[Trajectory]:
        """Finish the session (later requests get SessionClosed); its segments in order."""
        self.closed = True
        return self.sealed + ([self.current] if self.current is not None else [])

    async def _answer(self, request: ChatRequest) -> TurnReply:
        if not request.messages:
            raise RequestError("messages must not be empty")
        tools = request.tools if self.render_tools else None
        plan = self._plan(request.messages, tools)
        room = self.max_len - len(plan.context)
        if room <= 0 or (self.max_turns is not None and self.num_turns >= self.max_turns):
            self.truncated = True
            return TurnReply("", [], "length", len(plan.context), 0)
        sampling = self._sampling(request, room)
        try:
            images = ([] if plan.new_segment else self.current.images or []) + plan.images
            kw = {"images": [r["pixels"] for r in images]} if images else {}
            completion = await self.engine.generate(plan.context, sampling, session_id=self.id, **kw)
        except ContextLengthError:
            self.truncated = True
            return TurnReply("", [], "length", len(plan.context), 0)
        except Exception as e:  # noqa: BLE001 - any engine failure: nothing is recorded
            raise GenerationError(f"generation failed: {type(e).__name__}: {e}") from e
        if completion.finish_reason == "abort":
            raise GenerationError("generation was aborted (engine shutting down?)")
        if len(completion.logprobs) != len(completion.token_ids):
            raise GenerationError("the engine returned log-probs not aligned with its tokens")
        if self.closed:
            raise SessionClosed(f"session {self.id[:6]}... finished during generation")
        return self._commit(request, tools, plan, completion)

    def _plan(self, messages: list[Message], tools: list | None) -> _Plan:
        try:
            n = len(self.history_fps)
            if self.current is not None and tools == self.tools and fingerprints(messages[:n]) == self.history_fps:
                try:
                    delta = observation_ids(self.tokenizer, self.history, messages[n:], self.ended_with_eos, tools)
                    offset = len(self.current.tokens)
                    delta, images = expand_images(self.engine, delta, message_images(messages[n:]), offset)
                    return _Plan(self.current.tokens + delta, delta, False, images)
                except TemplateRewriteError:
                    pass  # the template re-renders history: start a new segment
            prompt = apply_chat_template(self.tokenizer, messages, tools=tools, add_generation_prompt=True)
            prompt, images = expand_images(self.engine, prompt, message_images(messages), 0)
        except ImageError as e:
            raise RequestError(str(e)) from e
        except (TemplateError, TypeError, KeyError, AttributeError, ValueError) as e:
            raise RequestError(f"the chat template cannot render these messages: {type(e).__name__}: {e}") from e
        return _Plan(prompt, prompt, True, images)

    def _sampling(self, request: ChatRequest, room: int) -> SamplingParams:
        base = self.sampling
        max_tokens = min(base.max_tokens, request.max_tokens or base.max_tokens, room)
        changes = {
            "max_tokens": max_tokens,
            "min_tokens": min(base.min_tokens, max_tokens),
            "seed": None if base.seed is None else base.seed * 64 + self.num_turns,  # distinct, reproducible
        }
        if request.stop:
            changes["stop"] = tuple(request.stop)
        if self.honor_sampling:  # training sessions keep the rollout's settings: the trainer assumes them
            changes |= {k: v for k in ("temperature", "top_p") if (v := getattr(request, k)) is not None}
        try:
            return dataclasses.replace(base, **changes)
        except ValueError as e:
            raise RequestError(str(e)) from e

    def _commit(self, request: ChatRequest, tools: list | None, plan: _Plan, completion: Completion) -> TurnReply:
        ids = list(completion.token_ids)
        if plan.new_segment:
            if self.current is not None:
                self.sealed.append(self.current)
            self.current, self.tools = Trajectory(), tools
        self.current.extend_prompt(plan.new_ids)
        if plan.images:
            self.current.images = (self.current.images or []) + plan.images
        self.current.extend_action(ids, list(completion.logprobs), list(completion.versions), self.keep_ids)
        self.current.add_routing(getattr(completion, "routing", None))
        self.current.finish_reason = completion.finish_reason
        self.num_turns += 1
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        content, calls = self.parser(text, request.tools) if request.parse_tools and request.tools else (text, [])
        self.history = list(request.messages)
        self.history_fps = fingerprints(request.messages) + [fingerprint(assistant_message(content, calls))]
        self.ended_with_eos = bool(ids) and ids[-1] == self.tokenizer.eos_token_id
        stop = completion.stop_reason if isinstance(completion.stop_reason, str) else None
        finish = "tool_calls" if calls else completion.finish_reason
        return TurnReply(content, calls, finish, len(plan.context), len(ids), stop)


class SessionStore:
    """Open sessions by unguessable id (192 random bits); a closed session is forgotten."""

    def __init__(self):
        self._sessions: dict[str, Session] = {}

    def open(self, engine, tokenizer, sampling: SamplingParams, **options) -> Session:
        session_id = secrets.token_urlsafe(24)
        session = Session(session_id, engine, tokenizer, sampling, **options)
        self._sessions[session_id] = session
        return session

    def get(self, session_id: str) -> Session:
        session = self._sessions.get(session_id)
        if session is None:
            raise SessionClosed("unknown or finished session")
        return session

    def close(self, session_id: str) -> list[Trajectory]:
        session = self._sessions.pop(session_id, None)
        return session.close() if session is not None else []

    def __len__(self) -> int:
        return len(self._sessions)
