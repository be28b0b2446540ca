"""Token-exact capture of one chat session: requests in, engine generations and segments out.

Plain Python over the engine interface and the tokenizer (no HTTP). Per request, under the session's lock:

1. A retry (same messages, tools and bounds as the last request) returns the cached reply.
2. If the messages extend the previous request's messages plus its reply (by fingerprint, `messages.py`)
   with the same tools, only the template's delta after the last action is tokenized (`observation_ids`)
   and the context is the segment's exact ids + delta: earlier actions are never re-tokenized.
3. Otherwise (first turn, compaction, changed tools, a template that re-renders history) the whole
   conversation is the prompt of a new segment; the current one is sealed.
4. Nothing is recorded until generation succeeds, so a client retry after a failed or aborted generation
   re-runs cleanly. No room left (context or turns) answers an empty "length" reply without generating;
   in serve mode (`honor_sampling`) an over-context prompt is a 400 `context_length_exceeded` instead.
5. `n > 1`: the samples share the prompt; each becomes a segment over the whole context (earlier actions
   there have loss mask 0), and a later request extends the one whose reply it continues (as in 2).

Streaming yields `TextDelta`s as the engine produces tokens (with tools, the text up to a call's opening), then
the `TurnReply`; the text sent is a prefix of the reply's content, and the wires send the rest with the reply.
Large requests are rendered and tokenized in a worker thread, and one whose text certainly overflows the
context is not tokenized at all (`prompt_tokens.py`)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from dataclasses import dataclass

from jinja2 import TemplateError

from molt.agents.chat.messages import ChatRequest, Message, assistant_message, fingerprints, request_key
from molt.agents.chat.prompt_tokens import OverContext, encode_within, min_tokens
from molt.agents.chat.replies import (
    ContextLengthExceeded,
    GenerationError,
    RequestError,
    SessionClosed,
    TextDelta,
    TurnReply,
    coalesced,
    take_all,
)
from molt.agents.chat.textstream import TextStream, decoder, trim_at_stop
from molt.agents.chat.tool_parser import Parser, call_opener, call_prefix, parse_none
from molt.agents.images import expand_images, message_images, pixels_arg
from molt.agents.runner import (
    TemplateRewriteError,
    emitted_markup,
    first_prompt_ids,
    observation_ids,
    record_completion,
)
from molt.agents.watchdog import paused
from molt.data.trajectory import Trajectory
from molt.engine.interface import Completion, ContextLengthError, SamplingParams
from molt.models.tokenizer import render_chat
from molt.models.vision import ImageError

RENDER_INLINE_BYTES = 64 << 10  # smaller requests render on the event loop (a thread hop costs more)


async def off_loop(size: int, fn, *args):
    """`fn(*args)`, in a worker thread for a request over RENDER_INLINE_BYTES (keeps the event loop responsive)."""
    return await asyncio.to_thread(fn, *args) if size > RENDER_INLINE_BYTES else fn(*args)


@dataclass
class _Plan:
    context: list[int]  # what the engine sees
    new_ids: list[int]  # the new segment's prompt, or the delta appended to the current segment
    new_segment: bool
    images: list = dataclasses.field(default_factory=list)  # records of all images in `context`
    prefix: str = ""  # a forced tool-call opening at the end of `context` (tool_choice required/named)


def forced_prefix(parser: Parser, request: ChatRequest) -> str:
    """The tool-call opening a tool_choice required / named request forces (RequestError where it cannot)."""
    if not request.tools:
        raise RequestError("tool_choice requires a tool call, but the request offers no tools", "tool_choice")
    names = [t.get("function", {}).get("name") for t in request.tools]
    if request.force_tool and request.force_tool not in names:
        message = f"tool_choice names {request.force_tool!r}, not one of the request's tools {names}"
        raise RequestError(message, "tool_choice")
    if (prefix := call_prefix(parser, request.force_tool)) is None:
        message = "tool_choice required/named needs a tool-call format (chat.tool_parser hermes/molt)"
        raise RequestError(message, "tool_choice")
    return prefix


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
        self.answered: list[Message] = []  # those and the reply; their fingerprints once a request needs them
        self.fps: list[str] | None = []
        self.emitted = ""  # the closing markup the last reply ended with (`emitted_markup`)
        self.siblings: list[tuple[Trajectory, TurnReply]] = []  # n > 1: the other samples, which a request may continue
        self.last_request: ChatRequest | None = None  # and its retry key, once a request needs it
        self.last_key: str | None = None
        self.last_reply: TurnReply | None = None
        self.num_turns = 0
        self.truncated = self.closed = False
        self.budget: asyncio.Timeout | None = None  # the agent's time limit, stopped while the engine generates

    async def turn(self, request: ChatRequest) -> TurnReply:
        """Answer one request (idempotent for retries); raises SessionClosed, RequestError, GenerationError."""
        return [event async for event in self.stream(request, live=False)][-1]  # not live: the reply alone

    async def stream(self, request: ChatRequest, live: bool = True) -> AsyncIterator[TextDelta | TurnReply]:
        """`TextDelta`s as tokens are generated (with `live`), then the `TurnReply`. Closing the iterator
        before the reply aborts the generation and records nothing."""
        async with self.lock:
            if self.closed:
                raise SessionClosed(f"session {self.id[:6]}... is finished")
            # a retry gets the cached reply: a request equal to the last (so as long), unless the client says it
            # is its first try (an identical request from an SDK asks for a new sample)
            retry = not request.first_try and len(request.messages) == len(self.history)
            retry = retry and request_key(request) == self._last_key()
            prepared = self.last_reply if retry else await self._prepare(request)
            if isinstance(prepared, TurnReply):  # that, or the empty "length" reply
                yield prepared
                return
            plan, sampling, tools = prepared
            parse = bool(request.parse_tools and request.tools)  # the text up to a call streams; the calls at the end
            opener = call_opener(self.parser) if parse else None
            live = live and not plan.prefix and (not parse or opener is not None or self.parser is parse_none)
            if not live:  # the reply alone; cancelled meanwhile, the engine aborts it and nothing is recorded
                completions = await self._generate(plan, sampling, None)
            else:
                inbox: asyncio.Queue = asyncio.Queue()  # the engine's token deltas, then None once it is done
                texts = [TextStream(self.tokenizer, request.stop, opener) for _ in range(request.n)]
                task = asyncio.ensure_future(self._generate(plan, sampling, inbox.put_nowait))
                task.add_done_callback(lambda _: inbox.put_nowait(None))
                try:  # once the generation is done, what it streamed last goes out with the reply
                    while (deltas := await take_all(inbox)) and not task.done():
                        for delta in coalesced(deltas):
                            index, text = delta.sample_index, texts[delta.sample_index].push(delta.token_ids)
                            if request.logprobs:
                                tokens = list(zip(delta.token_ids, delta.logprobs, strict=True))
                                tops = delta.top_logprobs if request.top_logprobs else None
                                yield TextDelta(index, text, tokens, tops, len(plan.context))
                            elif text:
                                yield TextDelta(index, text, num_prompt_tokens=len(plan.context))
                    completions = task.result()
                finally:
                    if not task.done():  # the consumer went away: abort, record nothing
                        task.cancel()
                        with contextlib.suppress(BaseException):
                            await task
            if self.closed:
                raise SessionClosed(f"session {self.id[:6]}... finished during generation")
            if not completions:
                yield TurnReply.length(request.n, len(plan.context))
                return
            reply = self._commit(request, tools, plan, completions)
            self.last_request, self.last_key, self.last_reply = request, None, reply
            yield reply

    def _last_key(self) -> str | None:
        if self.last_key is None and self.last_request is not None:
            self.last_key = request_key(self.last_request)
        return self.last_key

    def close(self) -> list[Trajectory]:
        """Finish the session (later requests get SessionClosed); its segments in order."""
        self.closed = True
        return self.sealed + ([self.current] if self.current is not None else [])

    async def _prepare(self, request: ChatRequest) -> tuple[_Plan, SamplingParams, list | None] | TurnReply:
        """The plan and sampling of a request, or the empty "length" reply when nothing fits."""
        if not request.messages:
            raise RequestError("messages must not be empty")
        tools = request.tools if self.render_tools else None
        try:
            plan = await off_loop(request.size, self._plan, request, tools)
            num_tokens, at_least = len(plan.context), ""
        except OverContext as e:
            num_tokens, at_least = e.num_tokens, "at least "
        room = self.max_len - num_tokens
        if room <= 0 and self.honor_sampling:
            raise ContextLengthExceeded(
                f"this model's context is {self.max_len} tokens (molt serve --chat.max_len); the prompt is "
                f"{at_least}{num_tokens} tokens and leaves no room to generate"
            )
        if room <= 0 or (self.max_turns is not None and self.num_turns >= self.max_turns):
            self.truncated = True
            return TurnReply.length(request.n, num_tokens)
        return plan, self._sampling(request, room), tools

    async def _generate(self, plan: _Plan, sampling: SamplingParams, on_tokens) -> list[Completion]:
        args = (plan.context, sampling) if on_tokens is None else (plan.context, sampling, on_tokens)
        try:
            generate = self.engine.generate_group if on_tokens is None else self.engine.generate_streamed
            with paused(self.budget):
                completions = await generate(*args, session_id=self.id, **pixels_arg(plan.images))
        except ContextLengthError as e:
            if self.honor_sampling:
                raise ContextLengthExceeded(str(e)) from e
            self.truncated = True
            return []  # training: an empty "length" reply, as when the session's own budget is used up
        except Exception as e:  # noqa: BLE001 - any engine failure: nothing is recorded
            raise GenerationError(f"generation failed: {type(e).__name__}: {e}") from e
        for c in completions:
            if c.finish_reason == "abort":
                raise GenerationError("generation was aborted (engine shutting down?)")
            if len(c.logprobs) != len(c.token_ids):
                raise GenerationError("the engine returned log-probs not aligned with its tokens")
            if sampling.top_logprobs and len(c.top_logprobs or ()) != len(c.token_ids):
                raise RequestError("top_logprobs is not supported by this engine")  # nothing recorded
        return completions

    def _plan(self, request: ChatRequest, tools: list | None) -> _Plan:
        messages, large = request.messages, request.size > RENDER_INLINE_BYTES
        try:
            plan = self._extension(messages, tools, large) or self._new_segment(messages, tools, large)
        except ImageError as e:
            raise RequestError(str(e)) from e
        except RecursionError:
            raise RequestError("the request nests too deeply to render") from None
        except (TemplateError, TypeError, KeyError, AttributeError, ValueError) as e:
            raise RequestError(f"the chat template cannot render these messages: {type(e).__name__}: {e}") from e
        return self._force_call(plan, request) if request.force_tool is not None else plan

    def _extension(self, messages: list[Message], tools: list | None, large: bool) -> _Plan | None:
        n = len(self.answered)
        if self.current is None or tools != self.tools:
            return None
        fps = fingerprints(messages[:n])
        if self.fps is None:  # computed once a request needs them
            self.fps = fingerprints(self.answered)
        if fps != self.fps and not self._continue_sibling(fps):
            return None
        if large:  # the new turns' text alone may not fit
            self._check_fits(sum(len(c) for m in messages[n:] if isinstance(c := m.get("content"), str)))
        try:
            delta = observation_ids(self.tokenizer, self.history, messages[n:], self.emitted, tools)
        except TemplateRewriteError:
            return None  # the template re-renders history: start a new segment
        delta, images = expand_images(self.engine, delta, message_images(messages[n:]), len(self.current.tokens))
        return _Plan(self.current.tokens + delta, delta, False, (self.current.images or []) + images)

    def _continue_sibling(self, fps: list[str]) -> bool:
        """Whether the request continues another sample of the last n > 1 turn; if so, its segment is the current."""
        for k, (segment, reply) in enumerate(self.siblings):
            answered = [*self.history, assistant_message(reply.content, reply.tool_calls)]
            if fingerprints(answered) == fps:
                at = next(i for i, sealed in enumerate(self.sealed) if sealed is segment)  # (== compares values)
                self.sealed[at] = self.current  # in the sibling's place: the segments keep their order
                self.siblings[k] = (self.current, self.last_reply)
                self.current, self.answered, self.fps = segment, answered, fps
                self.emitted = emitted_markup(self.tokenizer, reply.token_ids)
                return True
        return False

    def _new_segment(self, messages: list[Message], tools: list | None, large: bool) -> _Plan:
        if large:  # not cached, and not tokenized at all if it cannot fit
            text = render_chat(self.tokenizer, messages, tools=tools, add_generation_prompt=True)
            self._check_fits(len(text), new_segment=True)
            prompt = encode_within(self.tokenizer, text, self.max_len)  # = apply_chat_template
        else:
            prompt = first_prompt_ids(self.tokenizer, messages, tools)  # a group's n sessions render it once
        prompt, images = expand_images(self.engine, prompt, message_images(messages), 0)
        return _Plan(prompt, prompt, True, images)

    def _check_fits(self, num_chars: int, new_segment: bool = False) -> None:
        """Raise OverContext if `num_chars` more characters of text certainly overflow the context."""
        before = 0 if new_segment else len(self.current.tokens)  # an extension has a current segment
        num_tokens = before + min_tokens(self.tokenizer, num_chars)
        if num_tokens >= self.max_len:
            raise OverContext(num_tokens)

    def _force_call(self, plan: _Plan, request: ChatRequest) -> _Plan:
        """tool_choice required / named: the tool-call opening goes after the generation prompt (as prompt)."""
        prefix = forced_prefix(self.parser, request)
        ids = self.tokenizer(prefix, add_special_tokens=False)["input_ids"]
        return dataclasses.replace(plan, context=plan.context + ids, new_ids=plan.new_ids + ids, prefix=prefix)

    def _sampling(self, request: ChatRequest, room: int) -> SamplingParams:
        base = self.sampling
        # serve: the request's max_tokens, up to the context; training: the rollout's max_tokens bounds every turn too
        cap = room if self.honor_sampling else min(room, base.max_tokens)
        max_tokens = min(request.max_tokens or base.max_tokens, cap)
        changes = {
            "n": request.n,
            "max_tokens": max_tokens,
            "min_tokens": min(base.min_tokens, max_tokens),
            "seed": None if base.seed is None else base.seed * 64 + self.num_turns,  # distinct, reproducible
            "top_logprobs": request.top_logprobs if request.logprobs else 0,  # reported only: sampling unchanged
        }
        if request.stop:
            changes["stop"] = tuple(request.stop)
        if self.honor_sampling:  # training sessions keep the rollout's settings: the trainer assumes them
            changes |= {
                k: v for k in ("temperature", "top_p", "top_k", "seed") if (v := getattr(request, k)) is not None
            }
        try:
            return dataclasses.replace(base, **changes)
        except ValueError as e:
            raise RequestError(str(e)) from e

    def _commit(
        self, request: ChatRequest, tools: list | None, plan: _Plan, completions: list[Completion]
    ) -> TurnReply:
        replies = [self._reply(request, plan, c) for c in completions]
        if plan.new_segment or len(completions) > 1:  # siblings: each a segment over the whole context
            if self.current is not None:
                self.sealed.append(self.current)
            segments, new_ids = [Trajectory() for _ in completions], plan.context
            self.sealed += segments[1:]
            self.current, self.tools = segments[0], tools  # sample 0's, unless a request continues another
        else:
            segments, new_ids = [self.current], plan.new_ids
        self.siblings = list(zip(segments[1:], replies[1:], strict=True))
        for segment, completion in zip(segments, completions, strict=True):
            segment.extend_prompt(new_ids)
            segment.images = list(plan.images) or None
            record_completion(segment, completion, self.keep_ids)
        self.num_turns += 1
        first = replies[0]
        self.history = list(request.messages)
        self.answered, self.fps = [*request.messages, assistant_message(first.content, first.tool_calls)], None
        self.emitted = emitted_markup(self.tokenizer, first.token_ids)
        first.siblings = replies[1:]
        return first

    def _reply(self, request: ChatRequest, plan: _Plan, completion: Completion) -> TurnReply:
        ids = list(completion.token_ids)
        text = plan.prefix + decoder(self.tokenizer)(ids)
        stop = completion.stop_reason if isinstance(completion.stop_reason, str) else None
        if request.stop:
            text, found = trim_at_stop(text, request.stop)
            stop = found or stop  # the stop string that cut the text (the engine's may be a later one)
        content, calls = self.parser(text, request.tools) if request.parse_tools and request.tools else (text, [])
        finish = "tool_calls" if calls else completion.finish_reason
        reply = TurnReply(content, calls, finish, len(plan.context), len(ids), stop, ids, list(completion.logprobs))
        reply.top_logprobs = completion.top_logprobs
        return reply
