"""Session capture without HTTP: extension deltas, segments on rewrite, idempotent retries, commit-after-success."""

import asyncio
import copy
import dataclasses
import json
import threading

import pytest
from chat_support import CALC_TOOL, SAMPLING, TOK, ScriptedEngine, masked_ids

from molt.agents.chat.messages import ChatRequest
from molt.agents.chat.prompt_tokens import min_tokens
from molt.agents.chat.replies import GenerationError, RequestError, SessionClosed, TextDelta, TurnReply
from molt.agents.chat.session import RENDER_INLINE_BYTES, Session
from molt.agents.chat.tool_parser import get_parser
from molt.engine.interface import Completion, ContextLengthError, TokenDelta
from molt.models.tokenizer import apply_chat_template

CALL = '<tool_call>\n{"name": "calculate", "arguments": {"expression": "12*345"}}\n</tool_call>'


def _session(engine, **options):
    options.setdefault("parser", get_parser("auto", TOK))
    return Session("sid", engine, TOK, SAMPLING, max_len=options.pop("max_len", 1024), **options)


def _turn(session, messages, **kw):
    return asyncio.run(session.turn(ChatRequest(messages=messages, **kw)))


def _assistant(reply):
    message = {"role": "assistant", "content": reply.content}
    if reply.tool_calls:
        message["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments_json}}
            for c in reply.tool_calls
        ]
    return message


def test_three_turn_tool_conversation_is_one_exact_segment():
    engine = ScriptedEngine([CALL, CALL, "4140"])
    session = _session(engine)
    messages = [{"role": "user", "content": "12*345="}]
    for _ in range(3):
        reply = _turn(session, messages, tools=[CALC_TOOL])
        messages.append(_assistant(reply))
        for call in reply.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": "4140"})
    (segment,) = session.close()
    assert reply.content == "4140" and reply.finish_reason == "stop"
    assert masked_ids(segment) == engine.emitted[0] + engine.emitted[1] + engine.emitted[2]
    assert segment.versions == [3 if m else -1 for m in segment.loss_mask] and segment.num_turns == 3
    for k in range(2):  # each context is the previous one + its exact action + a rendered delta
        assert engine.prompts[k + 1][: len(engine.prompts[k]) + len(engine.emitted[k])] == (
            engine.prompts[k] + engine.emitted[k]
        )
    # the builtin template round-trips, so the segment equals an independent rendering of the conversation
    assert segment.tokens == apply_chat_template(TOK, messages, tools=[CALC_TOOL])[: len(segment.tokens)]


def test_an_end_of_turn_other_than_the_tokenizers_eos_is_not_repeated_in_the_next_context():
    """As in the Env runner (tests/agents/test_runner.py): Llama 3's turns end with `<|eot_id|>`, its tokenizer's
    eos is `<|end_of_text|>`; here the engine ends with `<|im_end|>`, the session's tokenizer's eos is another."""
    tokenizer = copy.deepcopy(TOK)
    tokenizer.eos_token = "<|endoftext|>"
    engine = ScriptedEngine(["It is 4.", "Yes."])
    session = Session("sid", engine, tokenizer, SAMPLING, max_len=1024, parser=get_parser("auto", tokenizer))
    messages = [{"role": "user", "content": "2+2?"}]
    for follow_up in ("Are you sure?", "Thanks."):
        messages += [_assistant(_turn(session, messages)), {"role": "user", "content": follow_up}]
    (segment,) = session.close()
    assert engine.emitted[0][-1] == TOK.convert_tokens_to_ids("<|im_end|>") != tokenizer.eos_token_id
    assert "<|im_end|><|im_end|>" not in TOK.decode(segment.tokens)
    assert segment.tokens == apply_chat_template(TOK, messages)[: len(segment.tokens)]


def test_rewrite_seals_the_segment_and_starts_a_new_one():
    engine = ScriptedEngine(["first answer", "second answer"])
    session = _session(engine)
    first = [{"role": "user", "content": "long question"}]
    reply = _turn(session, first)
    compacted = [{"role": "user", "content": "summary: " + reply.content}, {"role": "user", "content": "go on"}]
    _turn(session, compacted)
    segments = session.close()
    assert len(segments) == 2
    assert [masked_ids(s) for s in segments] == engine.emitted
    assert segments[1].tokens[: len(engine.prompts[1])] == engine.prompts[1]
    assert engine.prompts[1] == apply_chat_template(TOK, compacted, add_generation_prompt=True)


def test_changed_tools_start_a_new_segment():
    engine = ScriptedEngine(["a", "b"])
    session = _session(engine)
    messages = [{"role": "user", "content": "q"}]
    reply = _turn(session, messages)
    _turn(session, messages + [_assistant(reply), {"role": "user", "content": "q2"}], tools=[CALC_TOOL])
    assert len(session.close()) == 2


def test_reserialised_history_still_extends():
    engine = ScriptedEngine([CALL, "4140"])
    session = _session(engine)
    messages = [{"role": "user", "content": [{"type": "text", "text": "12*345="}]}]
    reply = _turn(session, messages, tools=[CALC_TOOL])
    (call,) = reply.tool_calls
    echoed = {  # content None instead of "", arguments re-serialised with other spacing, another call id
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "x", "type": "function", "function": {"name": "calculate", "arguments": '{"expression":"12*345"}'}}
        ],
    }
    _turn(session, messages + [echoed, {"role": "tool", "tool_call_id": call.id, "content": "4140"}], tools=[CALC_TOOL])
    (segment,) = session.close()
    assert masked_ids(segment) == engine.emitted[0] + engine.emitted[1]


def test_retry_is_idempotent_and_failed_generation_commits_nothing():
    engine = ScriptedEngine(["hello"], fail_next=1)
    session = _session(engine)
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(GenerationError):
        _turn(session, messages)
    assert session.current is None and session.num_turns == 0
    first, again = _turn(session, messages), _turn(session, messages)
    assert again is first and len(engine.emitted) == 1
    (segment,) = session.close()
    assert masked_ids(segment) == engine.emitted[0]
    with pytest.raises(SessionClosed):
        _turn(session, messages)


def test_budgets_answer_length_without_generating():
    engine = ScriptedEngine(["x"])
    session = _session(engine, max_len=8)
    reply = _turn(session, [{"role": "user", "content": "a question longer than eight tokens"}])
    assert (reply.finish_reason, reply.content, reply.num_completion_tokens) == ("length", "", 0)
    assert engine.emitted == [] and session.close() == [] and session.truncated
    session = _session(ScriptedEngine(["x"]), max_turns=1)
    reply = _turn(session, [{"role": "user", "content": "q"}])
    reply = _turn(session, [{"role": "user", "content": "q"}, _assistant(reply), {"role": "user", "content": "r"}])
    assert reply.finish_reason == "length" and session.truncated and len(session.close()[0].actions) == 1


class _OverContextEngine(ScriptedEngine):
    async def generate_group(self, prompt_token_ids, sampling=None, *, request_id=None, session_id=None):
        raise ContextLengthError("no room")


def test_an_empty_length_reply_has_n_choices():
    spent, no_room = _session(ScriptedEngine(["x"]), max_turns=0), _session(_OverContextEngine())
    for session in (spent, no_room):  # the session's turns are used up / the engine finds no room
        reply = _turn(session, [{"role": "user", "content": "q"}], n=2)
        assert [c.finish_reason for c in reply.choices] == ["length", "length"]


def test_max_tokens_is_clipped_to_the_context_and_the_request():
    engine = ScriptedEngine(["0123456789" * 3])
    session = _session(engine, max_len=40)
    prompt = apply_chat_template(TOK, [{"role": "user", "content": "q"}], add_generation_prompt=True)
    reply = _turn(session, [{"role": "user", "content": "q"}], max_tokens=100)
    assert reply.num_completion_tokens == 40 - len(prompt) and reply.finish_reason == "length"
    reply = _turn(_session(ScriptedEngine(["0123456789"])), [{"role": "user", "content": "q"}], max_tokens=3)
    assert reply.num_completion_tokens == 3


def test_unrenderable_messages_are_a_request_error():
    session = _session(ScriptedEngine(["x"]))
    with pytest.raises(RequestError):
        _turn(session, [])


def test_tool_parsers():
    molt, hermes = get_parser("molt"), get_parser("hermes")
    assert hermes(CALL, [CALC_TOOL])[1][0].arguments == {"expression": "12*345"}
    assert hermes("<tool_call>12*345</tool_call>", [CALC_TOOL]) == ("<tool_call>12*345</tool_call>", [])
    content, (call,) = molt("<tool_call>12*345</tool_call>", [CALC_TOOL])
    assert content == "" and call.name == "calculate" and call.arguments == {"expression": "12*345"}
    for malformed in [
        '<tool_call>{"name": "other", "arguments": {}}</tool_call>',  # molt: never the sole tool's compact form
        '<tool_call>{"name": "calculate", "arguments": {"expression": </tool_call>',
        "<tool_call>{oops",
        CALL + "</tool_call>",
    ]:
        assert hermes(malformed, [CALC_TOOL]) == molt(malformed, [CALC_TOOL]) == (malformed, [])
    for properties in [5, ["a"]]:  # a schema the compact form cannot use: plain text, not a TypeError
        assert molt("<tool_call>x</tool_call>", [{"name": "f", "parameters": {"properties": properties}}])[1] == []
    assert hermes(CALL, []) == (CALL, [])  # no tools offered: never a call
    assert json.loads(call.arguments_json) == call.arguments
    assert get_parser("auto", TOK) is molt


class ThreadRecordingTokenizer:
    """TOK, recording which thread renders and how much text it tokenizes."""

    def __init__(self):
        self.renders, self.encoded = [], []

    def __getattr__(self, name):
        return getattr(TOK, name)

    def apply_chat_template(self, *args, **kw):
        self.renders.append(threading.get_ident())
        return TOK.apply_chat_template(*args, **kw)

    def encode(self, text, **kw):
        self.encoded.append((threading.get_ident(), len(text)))
        return TOK.encode(text, **kw)


def test_large_requests_render_off_the_loop_and_an_overlong_one_is_never_tokenized():
    big = [{"role": "user", "content": "x" * (RENDER_INLINE_BYTES + 1)}]
    tok = ThreadRecordingTokenizer()
    session = Session("sid", ScriptedEngine(["ok"]), tok, SAMPLING, max_len=1024)
    reply = asyncio.run(session.turn(ChatRequest(messages=big, size=RENDER_INLINE_BYTES + 1)))
    assert reply.finish_reason == "length" and reply.num_prompt_tokens >= 1024 and session.truncated
    assert tok.renders and threading.get_ident() not in tok.renders  # rendered in a worker thread
    assert not tok.encoded and min_tokens(TOK, RENDER_INLINE_BYTES) >= 1024  # the bound decided: not tokenized
    fits = Session("sid", ScriptedEngine(["ok"]), tok, SAMPLING, max_len=1 << 20)  # may fit: tokenized, off the loop
    reply = asyncio.run(fits.turn(ChatRequest(messages=big, size=RENDER_INLINE_BYTES + 1)))
    assert reply.content == "ok" and [t for t, n in tok.encoded if n > RENDER_INLINE_BYTES] != []
    assert threading.get_ident() not in [t for t, _ in tok.encoded]
    (segment,) = fits.close()
    assert segment.tokens[: reply.num_prompt_tokens] == apply_chat_template(TOK, big, add_generation_prompt=True)


class BurstEngine(ScriptedEngine):
    """Streams "héllo world" one token per delta: four before `gate` opens, the rest after it, all at once."""

    async def generate_streamed(self, prompt_token_ids, sampling, on_tokens, *, request_id=None, session_id=None):
        ids = TOK.encode("héllo world", add_special_tokens=False) + [TOK.eos_token_id]
        tops = [[(t, -0.5)] for t in ids]
        for k in range(len(ids)):
            if k == 4:
                try:
                    await self.gate.wait()
                except asyncio.CancelledError:  # aborted: the client went away
                    self.aborted = True
                    raise
            on_tokens(TokenDelta(0, ids[k : k + 1], [-0.5], tops[k : k + 1]))
        n = len(ids)
        return [Completion("r", ids, [-0.5] * n, [3] * n, "stop", len(prompt_token_ids), top_logprobs=tops)]


def test_stream_sends_waiting_deltas_as_one_and_the_reply_carries_what_came_last():
    async def run(hang_up: bool):
        engine = BurstEngine()
        engine.gate, engine.aborted = asyncio.Event(), False
        session = _session(engine)
        request = ChatRequest(messages=[{"role": "user", "content": "hi"}], logprobs=True, top_logprobs=1)
        events = session.stream(request)
        first = await anext(events)
        if hang_up:  # the client goes away: the generation is aborted and nothing recorded
            await events.aclose()
            await asyncio.sleep(0)
            return engine, session, first, []
        engine.gate.set()
        return engine, session, first, [e async for e in events]

    engine, session, first, rest = asyncio.run(run(hang_up=False))
    ids = TOK.encode("héllo world", add_special_tokens=False) + [TOK.eos_token_id]
    assert isinstance(first, TextDelta) and first.text == "hél"  # four deltas waited: sent as one
    assert first.tokens == [(t, -0.5) for t in ids[:4]] and first.top_logprobs == [[(t, -0.5)] for t in ids[:4]]
    (reply,) = rest  # the generation ended before the session looked again: the reply carries the rest
    assert isinstance(reply, TurnReply) and reply.content == "héllo world" and reply.token_ids == ids
    assert masked_ids(session.close()[0]) == ids
    engine, session, first, _ = asyncio.run(run(hang_up=True))
    assert first.text == "hél" and engine.aborted and session.close() == [] and session.num_turns == 0


class HeldEngine(BurstEngine):
    """Its (non-streamed) generation waits for `gate` too."""

    async def generate_group(self, prompt_token_ids, sampling=None, *, request_id=None, session_id=None):
        return await self.generate_streamed(prompt_token_ids, sampling, lambda delta: None)


def test_a_cancelled_turn_aborts_its_generation_and_records_nothing():
    async def run():
        engine = HeldEngine()
        engine.gate, engine.aborted = asyncio.Event(), False
        session = _session(engine)
        turn = asyncio.ensure_future(session.turn(ChatRequest(messages=[{"role": "user", "content": "hi"}])))
        await asyncio.sleep(0.05)  # the engine waits at its gate
        turn.cancel()
        with pytest.raises(asyncio.CancelledError):
            await turn
        return engine, session

    engine, session = asyncio.run(run())
    assert engine.aborted and session.close() == [] and session.num_turns == 0


def test_the_stop_sequence_reported_is_the_one_that_cut_the_text():
    class StopsAtL(ScriptedEngine):  # as an engine reports the first listed stop string that one token completed
        async def generate_group(self, *args, **kw):
            return [dataclasses.replace(c, stop_reason="l") for c in await super().generate_group(*args, **kw)]

    reply = _turn(_session(StopsAtL(["say <hello"])), [{"role": "user", "content": "hi"}], stop=["l", "<"])
    assert (reply.content, reply.stop_sequence) == ("say ", "<")


class TokenByToken(ScriptedEngine):
    """Streams its scripted reply one token per delta, yielding to the event loop between them."""

    async def generate_streamed(self, prompt_token_ids, sampling, on_tokens, *, request_id=None, session_id=None):
        (completion,) = await self.generate_group(prompt_token_ids, sampling)
        for k, token in enumerate(completion.token_ids):
            on_tokens(TokenDelta(0, [token], completion.logprobs[k : k + 1]))
            await asyncio.sleep(0)
        return [completion]


def test_text_before_a_tool_call_streams_as_generated_and_the_call_goes_out_parsed():
    text, messages = "  Sure, computing.\n" + CALL + "\nDone.", [{"role": "user", "content": "12*345="}]

    async def streamed():
        request = ChatRequest(messages=messages, tools=[CALC_TOOL])
        return [event async for event in session(TokenByToken([text])).stream(request)]

    sampling, parser = dataclasses.replace(SAMPLING, max_tokens=256), get_parser("auto", TOK)
    session = lambda engine: Session("sid", engine, TOK, sampling, max_len=1024, parser=parser)  # noqa: E731
    *deltas, reply = asyncio.run(streamed())
    plain = _turn(session(ScriptedEngine([text])), messages, tools=[CALC_TOOL])
    assert len(deltas) > 5 and "".join(d.text for d in deltas) == "  Sure, computing."  # up to the call's space
    assert reply.content == plain.content == "  Sure, computing.\n\nDone."  # the rest goes out with the reply
    assert [(c.name, c.arguments) for c in reply.tool_calls] == [(c.name, c.arguments) for c in plain.tool_calls]
    assert [(c.name, c.arguments) for c in plain.tool_calls] == [("calculate", {"expression": "12*345"})]


class Siblings(ScriptedEngine):
    """Answers a request for n samples with the next n scripted replies (sample k's ids are its own)."""

    async def generate_group(self, prompt_token_ids, sampling=None, *, request_id=None, session_id=None):
        out = []
        for k in range(sampling.n):
            (c,) = await super().generate_group(prompt_token_ids, dataclasses.replace(sampling, n=1))
            out.append(dataclasses.replace(c, sample_index=k))
        return out


def test_a_request_continuing_another_sample_of_an_n2_turn_extends_that_samples_segment():
    engine, messages = Siblings(["first answer", "second answer", "ok"]), [{"role": "user", "content": "hi"}]
    session = _session(engine)
    reply = _turn(session, messages, n=2)
    assert [c.content for c in reply.choices] == ["first answer", "second answer"]
    _turn(session, [*messages, _assistant(reply.siblings[0]), {"role": "user", "content": "go on"}])
    other, chosen = session.close()  # in sample order; the continued sample's segment grew, the other's did not
    assert masked_ids(chosen) == engine.emitted[1] + engine.emitted[2] and masked_ids(other) == engine.emitted[0]
    turn2 = engine.prompts[2]  # (the first turn's prompt is recorded once per sample)
    assert turn2[: len(engine.prompts[0]) + len(engine.emitted[1])] == engine.prompts[0] + engine.emitted[1]
