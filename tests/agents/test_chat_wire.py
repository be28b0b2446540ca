"""The rest of the wire through the official SDKs on a real (tiny) engine: streaming, n, logprobs, bounds, errors."""

import asyncio
import json
import logging
import random
import threading

import anthropic
import httpx
import openai
import pytest
import torch
from chat_support import TOK, ScriptedEngine, ServerThread, masked_ids
from test_chat_server import ANTHROPIC_TOOL, CALL, reassemble_calls
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from molt.agents.chat import wire_anthropic
from molt.agents.chat.agent import CHAT_SERVER_OPTIONS, ChatAgent, ChatRunner
from molt.agents.chat.clients import ClientPool
from molt.agents.chat.server import ChatServer
from molt.agents.chat.textstream import TextStream
from molt.agents.env import Result
from molt.agents.runner import EpisodeLimits
from molt.config import ChatConfig
from molt.engine import SamplingParams, TorchEngine
from molt.engine.interface import Completion, TokenDelta
from molt.models import Transformer, preset

KEY = "k"
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, seed=0)
DEEP = 200  # nesting levels of the hostile requests (the template used to raise RecursionError at ~600)


def _engine():
    arch = preset("tiny", vocab_size=len(TOK), eos_token_id=TOK.eos_token_id, pad_token_id=TOK.pad_token_id)
    model = Transformer(arch).init_weights(0.02, torch.Generator().manual_seed(0)).eval()
    return TorchEngine(model, tokenizer=TOK, num_slots=8, max_seq_len=1024, version=2)


@pytest.fixture(scope="module")
def served():
    engine = _engine()
    serve = SamplingParams(max_tokens=16, stop_token_ids=(TOK.eos_token_id,))
    server = ServerThread(engine, api_key=KEY, serve_sampling=serve, serve_max_len=128)
    yield server
    server.stop()
    asyncio.run(engine.close())


def _openai(server, session=None):
    base = server.session_url(session) if session is not None else server.server.url
    return openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0)


def _anthropic(server, session=None):
    base = server.session_url(session) if session is not None else server.server.url
    return anthropic.Anthropic(base_url=base, api_key=KEY, max_retries=0)


MESSAGES = [{"role": "user", "content": "12+7="}]


def test_streamed_text_equals_plain_text_and_the_captured_tokens(served):
    plain_session, stream_session = served.open(GREEDY), served.open(GREEDY)
    plain = _openai(served, plain_session).chat.completions.create(model="molt", messages=MESSAGES, logprobs=True)
    chunks = list(_openai(served, stream_session).chat.completions.create(model="molt", messages=MESSAGES, stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == plain.choices[0].message.content
    assert sum(bool(c.choices and c.choices[0].delta.content) for c in chunks) > 1  # sent in pieces
    (segment,) = served.server.close_session(stream_session.id)
    assert TOK.decode(masked_ids(segment), skip_special_tokens=True) == streamed
    (plain_segment,) = served.server.close_session(plain_session.id)
    logprobs = [t.logprob for t in plain.choices[0].logprobs.content]
    captured = [lp for lp, m in zip(plain_segment.rollout_logprobs, plain_segment.loss_mask, strict=True) if m]
    assert logprobs == pytest.approx(captured, abs=1e-6) and len(logprobs) == plain.usage.completion_tokens


def test_top_logprobs_are_the_engines_alternatives(served):
    session = served.open(GREEDY)
    client = _openai(served, session)
    reply = client.chat.completions.create(model="molt", messages=MESSAGES, logprobs=True, top_logprobs=3)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens > 0
    for token in content:
        assert len(token.top_logprobs) == 3
        assert [t.logprob for t in token.top_logprobs] == sorted((t.logprob for t in token.top_logprobs), reverse=True)
        assert token.top_logprobs[0].logprob == token.logprob  # greedy: the sampled token is the most likely
        assert token.top_logprobs[0].token == token.token
    (segment,) = served.server.close_session(session.id)
    captured = [lp for lp, m in zip(segment.rollout_logprobs, segment.loss_mask, strict=True) if m]
    assert [t.logprob for t in content] == pytest.approx(captured, abs=1e-6)
    serve = _openai(served)
    sampled = serve.chat.completions.create(
        model="molt", messages=MESSAGES, temperature=1.0, n=2, logprobs=True, top_logprobs=5, max_tokens=8
    )
    for choice in sampled.choices:
        assert choice.logprobs.content and all(len(t.top_logprobs) == 5 for t in choice.logprobs.content)
        for token in choice.logprobs.content:  # a sampled token is never likelier than the most likely one
            assert token.logprob <= token.top_logprobs[0].logprob + 1e-6
    with pytest.raises(openai.BadRequestError):
        serve.chat.completions.create(model="molt", messages=MESSAGES, top_logprobs=2)  # needs logprobs


def test_streamed_logprobs_equal_the_plain_ones_and_the_captured_ones(served):
    sessions = [served.open(GREEDY) for _ in range(3)]
    plain = _openai(served, sessions[0]).chat.completions.create(
        model="molt", messages=MESSAGES, logprobs=True, top_logprobs=2
    )

    def streamed(session, **options) -> list[list]:
        client = _openai(served, session)
        chunks = client.chat.completions.create(model="molt", messages=MESSAGES, stream=True, logprobs=True, **options)
        return [c.choices[0].logprobs.content for c in chunks if c.choices and c.choices[0].logprobs]

    live, with_tops = streamed(sessions[1]), streamed(sessions[2], top_logprobs=2)
    assert len(live) > 1 and len(with_tops) > 1  # sent as generated, alternatives too, not at the end
    assert all(len(t.top_logprobs) == 2 for piece in with_tops for t in piece)  # each chunk: its tokens' own
    expected = plain.choices[0].logprobs.content
    for pieces in (live, with_tops):
        entries = [t for piece in pieces for t in piece]
        assert [t.token for t in entries] == [t.token for t in expected]
        assert [t.logprob for t in entries] == pytest.approx([t.logprob for t in expected], abs=1e-5)
    tops = [[(a.token, a.logprob) for a in t.top_logprobs] for piece in with_tops for t in piece]
    assert tops == [[(a.token, pytest.approx(a.logprob, abs=1e-5)) for a in t.top_logprobs] for t in expected]
    (segment,) = served.server.close_session(sessions[1].id)
    captured = [lp for lp, m in zip(segment.rollout_logprobs, segment.loss_mask, strict=True) if m]
    assert [t.logprob for piece in live for t in piece] == pytest.approx(captured, abs=1e-6)


def test_engine_streams_each_tokens_alternatives(served):
    engine, sampling = served.server.engine, SamplingParams(temperature=1.0, n=2, max_tokens=6, seed=1, top_logprobs=3)
    deltas = []
    completions = served.call(engine.generate_streamed(TOK.encode("12+7="), sampling, deltas.append))
    for c in completions:
        mine = [d for d in deltas if d.sample_index == c.sample_index]
        assert len(mine) > 1 and [t for d in mine for t in d.token_ids] == c.token_ids
        assert [t for d in mine for t in d.top_logprobs] == c.top_logprobs and len(c.top_logprobs[0]) == 3
    served.call(engine.generate_streamed(TOK.encode("12+7="), GREEDY, deltas.append))
    assert deltas[-1].top_logprobs is None  # not asked for


class GatedEngine(ScriptedEngine):
    """Streams the first tokens of its reply, then waits for `gate` before generating the rest."""

    async def generate_streamed(self, prompt_token_ids, sampling, on_tokens, *, request_id=None, session_id=None):
        ids = TOK.encode("hello world", add_special_tokens=False) + [TOK.eos_token_id]
        on_tokens(TokenDelta(0, ids[:3], [-0.5] * 3))
        try:
            await self.gate.wait()
        except asyncio.CancelledError:  # aborted: the client went away
            self.aborted += 1
            raise
        on_tokens(TokenDelta(0, ids[3:], [-0.5] * (len(ids) - 3)))
        return [Completion("r", ids, [-0.5] * len(ids), [self.version] * len(ids), "stop", len(prompt_token_ids))]


def test_first_chunk_arrives_before_the_generation_ends():
    """Ordering, no clock: the engine holds the rest of the reply until the client has the first chunk."""

    async def first_then_rest(client) -> tuple[str, str]:
        engine.gate = asyncio.Event()
        stream = await client.chat.completions.create(model="molt", messages=MESSAGES, stream=True)
        pieces = [c.choices[0].delta.content async for c in _until_content(stream)]
        assert not engine.gate.is_set()  # the generation has not finished: the chunk was streamed
        engine.gate.set()
        rest = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        return "".join(pieces), rest

    async def run():
        server = await ChatServer(engine, TOK, api_key=KEY).start()
        pools = {"direct": ClientPool(server), "asgi": ClientPool(server.app)}  # ctx.openai()'s in-process paths
        aborted = engine.aborted = 0
        try:
            for path in ("direct", "asgi", "http"):
                session = server.open_session(GREEDY, max_len=256)
                base = f"{server.url}/s/{session.id}/v1"
                client = (
                    pools[path].client("openai", base, KEY, max_retries=0)
                    if path in pools
                    else openai.AsyncOpenAI(base_url=base, api_key=KEY, max_retries=0)
                )
                first, rest = await asyncio.wait_for(first_then_rest(client), 30)
                assert first == "hel" and first + rest == "hello world"
                assert server.close_session(session.id)
                session = server.open_session(GREEDY, max_len=256)  # a client that hangs up after one chunk
                client = client.with_options(base_url=f"{server.url}/s/{session.id}/v1")
                engine.gate = asyncio.Event()
                stream = await client.chat.completions.create(model="molt", messages=MESSAGES, stream=True)
                assert [c async for c in _until_content(stream)]
                await stream.close()
                await asyncio.sleep(0.05)  # the server sees the disconnect
                assert server.close_session(session.id) == [] and engine.aborted == aborted + 1, path
                aborted += 1
                session = server.open_session(GREEDY, max_len=256)  # one that stops reading, never closing
                client = client.with_options(base_url=f"{server.url}/s/{session.id}/v1")
                engine.gate = asyncio.Event()
                stream = await client.chat.completions.create(model="molt", messages=MESSAGES, stream=True)
                assert [c async for c in _until_content(stream)]
                engine.gate.set()  # the reply ends on the server; the next request on the session is answered
                reply = await asyncio.wait_for(client.chat.completions.create(model="molt", messages=MESSAGES), 30)
                assert reply.choices[0].message.content and server.close_session(session.id), path
        finally:
            for pool in pools.values():
                await pool.close()
            await server.stop()

    engine = GatedEngine()
    asyncio.run(run())


class HeldEngine(GatedEngine):
    """Its non-streamed generation waits for `gate` too."""

    async def generate_group(self, prompt_token_ids, sampling=None, *, request_id=None, session_id=None):
        return await self.generate_streamed(prompt_token_ids, sampling, lambda delta: None)


def test_in_process_clients_time_out_as_socket_clients_do():
    """The SDKs' `timeout` (httpx's read timeout) bounds the wait for the response and for each chunk of a stream,
    in process as over a socket (in process it was ignored: a 1 ms timeout waited out the whole generation). The
    request then ends as a client that hangs up: its generation is aborted and nothing recorded."""

    async def aborted(count: int) -> bool:
        for _ in range(200):  # over a socket the server sees the disconnect a little later
            if engine.aborted > count:
                return True
            await asyncio.sleep(0.01)
        return False

    async def run() -> None:
        server = await ChatServer(engine, TOK, api_key=KEY).start()
        pools = {"direct": ClientPool(server), "asgi": ClientPool(server.app)}
        try:
            for path in ("direct", "asgi", "http"):
                session = server.open_session(GREEDY, max_len=256)
                base, options = f"{server.url}/s/{session.id}/v1", {"max_retries": 0, "timeout": 0.2}
                pool = pools.get(path)
                client = (
                    pool.client("openai", base, KEY, **options)
                    if pool
                    else openai.AsyncOpenAI(base_url=base, api_key=KEY, **options)
                )
                engine.gate, count = asyncio.Event(), engine.aborted
                with pytest.raises(openai.APITimeoutError):
                    await asyncio.wait_for(client.chat.completions.create(model="molt", messages=MESSAGES), 10)
                assert await aborted(count), path
                stream = await client.chat.completions.create(model="molt", messages=MESSAGES, stream=True)
                assert [c async for c in _until_content(stream)]  # then the engine holds the rest
                with pytest.raises(openai.APITimeoutError):  # as the SDK reports a socket's read timeout
                    await asyncio.wait_for(_drain(stream), 10)
                assert await aborted(count + 1) and server.close_session(session.id) == [], path
            session = server.open_session(GREEDY, max_len=256)  # the Anthropic SDK, per-request timeout
            client = pools["direct"].client("anthropic", f"{server.url}/s/{session.id}", KEY, max_retries=0)
            with pytest.raises(anthropic.APITimeoutError):
                await client.messages.create(model="molt", max_tokens=8, messages=MESSAGES, timeout=0.2)
            assert await aborted(count + 2) and server.close_session(session.id) == []
        finally:
            for pool in pools.values():
                await pool.close()
            await server.stop()

    engine = HeldEngine()
    engine.aborted = 0
    asyncio.run(run())


async def _drain(stream) -> None:
    async for _ in stream:
        pass


async def _until_content(stream):
    """The stream's chunks up to and including its first one with content."""
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            yield chunk
            return


def test_anthropic_stream_equals_plain(served):
    plain_session, stream_session = served.open(GREEDY), served.open(GREEDY)
    plain = _anthropic(served, plain_session).messages.create(model="molt", max_tokens=24, messages=MESSAGES)
    with _anthropic(served, stream_session).messages.stream(model="molt", max_tokens=24, messages=MESSAGES) as s:
        pieces = list(s.text_stream)
        final = s.get_final_message()
    assert "".join(pieces) == plain.content[0].text == final.content[0].text
    served.server.close_session(plain_session.id)
    (segment,) = served.server.close_session(stream_session.id)
    assert masked_ids(segment) and final.usage.output_tokens == segment.num_action_tokens


def test_n2_returns_two_independent_samples_captured_as_siblings(served):
    session = served.open(SamplingParams(temperature=1.0, max_tokens=24, stop_token_ids=(TOK.eos_token_id,), seed=3))
    reply = _openai(served, session).chat.completions.create(model="molt", messages=MESSAGES, n=2)
    assert [c.index for c in reply.choices] == [0, 1]
    first, second = served.server.close_session(session.id)
    assert first.tokens[: first.actions[0][0]] == second.tokens[: second.actions[0][0]]  # one shared prompt
    assert masked_ids(first) != masked_ids(second)  # independent samples
    texts = {TOK.decode(masked_ids(s), skip_special_tokens=True) for s in (first, second)}
    assert texts == {c.message.content for c in reply.choices}


def test_serve_mode_context_seed_stop_and_max_tokens(served):
    client = _openai(served)
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model="molt", messages=[{"role": "user", "content": "x " * 200}])
    assert (error.value.body["code"], error.value.param) == ("context_length_exceeded", "messages")  # as OpenAI's
    kw = {"model": "molt", "messages": MESSAGES, "temperature": 1.0, "max_tokens": 40}
    a, b = (client.chat.completions.create(seed=7, **kw) for _ in range(2))
    assert a.choices[0].message.content == b.choices[0].message.content  # seeded
    assert a.usage.completion_tokens > 16  # max_tokens above the serve default is honoured
    text = a.choices[0].message.content
    if len(text) > 4:
        stop = text[2:4]
        cut = client.chat.completions.create(seed=7, stop=[stop], **kw).choices[0].message.content
        assert cut == text[: text.index(stop)]  # the stop string is trimmed from the text


def test_deep_nesting_is_a_400_on_both_wires_without_a_traceback(served, caplog):
    deep: dict = {"type": "string"}
    for _ in range(DEEP):
        deep = {"type": "object", "properties": {"x": deep}}
    tool = {"type": "function", "function": {"name": "f", "parameters": deep}}
    session = served.open(GREEDY)
    url, auth = served.session_url(session), {"authorization": f"Bearer {KEY}"}
    arguments = "[" * DEEP + "]" * DEEP
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}
    bodies = [
        ("/v1/chat/completions", {"model": "molt", "messages": MESSAGES, "tools": [tool]}),
        (
            "/v1/messages",
            {"model": "molt", "max_tokens": 4, "messages": MESSAGES, "tools": [{"name": "f", "input_schema": deep}]},
        ),  # fmt: skip
        (
            "/v1/chat/completions",
            {"model": "molt", "messages": [*MESSAGES, {"role": "assistant", "tool_calls": [call]}]},
        ),
    ]
    with caplog.at_level(logging.WARNING):
        for path, body in bodies:
            response = httpx.post(url + path, content=json.dumps(body), headers=auth, timeout=30)
            assert response.status_code == 400 and "nest" in response.text, response.text
    assert not [r for r in caplog.records if r.exc_info]
    assert served.server.close_session(session.id) == []


def test_client_disconnect_mid_stream_records_nothing(served):
    session = served.open(SamplingParams(temperature=1.0, max_tokens=64, ignore_eos=True, seed=1))
    url, auth = served.session_url(session) + "/v1/chat/completions", {"authorization": f"Bearer {KEY}"}
    with httpx.stream("POST", url, json={"model": "molt", "messages": MESSAGES, "stream": True}, headers=auth) as r:
        assert r.status_code == 200
        next(r.iter_lines())  # the first chunk, then hang up
    assert served.server.close_session(session.id) == []


def test_count_tokens_and_anthropic_tool_choice(served):
    session = served.open(GREEDY)
    client = _anthropic(served, session)
    count = client.messages.count_tokens(model="molt", messages=MESSAGES)
    reply = client.messages.create(model="molt", max_tokens=4, messages=MESSAGES)
    assert count.input_tokens == reply.usage.input_tokens
    forced = client.messages.create(
        model="molt", max_tokens=4, messages=MESSAGES, tools=[ANTHROPIC_TOOL], tool_choice={"type": "any"}
    )
    assert forced.usage.output_tokens <= 4  # the tool-call opening is prompt, not counted as generated
    for choice in ({"type": "any"}, {"type": "tool", "name": "calculate"}):  # the opening counted as input
        ask = {"model": "molt", "messages": MESSAGES, "tools": [ANTHROPIC_TOOL], "tool_choice": choice}
        counted = client.messages.count_tokens(**ask).input_tokens
        assert counted == client.messages.create(max_tokens=4, **ask).usage.input_tokens, choice
    segments = served.server.close_session(session.id)
    assert len(segments) == 4, len(segments)  # the second `any` request, an SDK's first try too, sampled anew
    assert "<tool_call>" in TOK.decode(segments[-1].tokens)


def test_text_stream_holds_back_stop_prefixes_and_stops():
    stream = TextStream(TOK, stops=("END",))
    pieces = [stream.push(TOK.encode(t, add_special_tokens=False)) for t in ("ab", "cE", "N", "Dxyz")]
    assert pieces == ["ab", "c", "", ""] and stream.sent == "abc"


def _metaspace_tokenizer() -> PreTrainedTokenizerFast:
    """A sentencepiece-style tokenizer from constants: metaspace pieces, byte fallback, a leading-space strip."""
    pieces = ["<unk>", *(f"<0x{b:02X}>" for b in range(256)), "\u2581", "\u2581the", "\u2581wor", "ld", "é", "你好"]
    pieces += [chr(c) for c in range(ord("a"), ord("z") + 1)]
    backend = Tokenizer(models.BPE({p: i for i, p in enumerate(pieces)}, [], unk_token="<unk>", byte_fallback=True))
    backend.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", clean_up_tokenization_spaces=False)


@pytest.mark.parametrize("tokenizer", [TOK, _metaspace_tokenizer()], ids=["byte-level", "metaspace"])
def test_text_stream_decodes_a_window_yet_sends_the_full_decodes_text(tokenizer):
    """Random ids (partial characters, special tokens, leading spaces) pushed in random pieces: after every push
    the sent text is what decoding all ids so far gives, less a trailing partial character (the reference)."""
    rng, windowed = random.Random(0), 0
    for _ in range(30):
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randint(1, 300))]
        stream, sent, at = TextStream(tokenizer), "", 0
        while at < len(ids):
            k = rng.choice([1, 1, 2, 5])
            piece, at = stream.push(ids[at : at + k]), min(at + k, len(ids))
            text = tokenizer.decode(ids[:at], skip_special_tokens=True)
            if text.endswith("\ufffd"):
                text = tokenizer.decode(ids[: max(at - 3, 0)], skip_special_tokens=True)
            sent = text if text.startswith(sent) else sent
            assert stream.sent == sent and piece == sent[len(sent) - len(piece) :]
        windowed += stream.start > 0  # the later pushes decoded a window, not everything
    assert windowed >= 10


def _japanese_bpe() -> PreTrainedTokenizerFast:
    """A byte-level BPE (GPT-2's byte alphabet) whose few merges split characters: 'ãģ' = E3 81, '«ãģ' = AB E3 81."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer, backend.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=260, initial_alphabet=alphabet, show_progress=False)
    backend.train_from_iterator(["こんにちは、世界"] * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, clean_up_tokenization_spaces=False)


@pytest.mark.parametrize(
    ("tokenizer", "text"),
    [(_japanese_bpe(), "こんにちは、世界"), (_metaspace_tokenizer(), "ü你好é")],
    ids=["byte-level", "byte-fallback"],
)
def test_logprob_token_bytes_rebuild_the_text(tokenizer, text):
    """A token's OpenAI `bytes` are its own (joined: the text's UTF-8, partial characters included); its `token`
    escapes the bytes that do not decode, as OpenAI's does."""
    tokens = [ChatServer(None, tokenizer)._decode_token(i) for i in tokenizer.encode(text, add_special_tokens=False)]
    assert b"".join(raw for _, raw in tokens) == text.encode()
    assert all(token == raw.decode(errors="backslashreplace") for token, raw in tokens)
    assert ("\\xab\\xe3\\x81", b"\xab\xe3\x81") in tokens or ("\\xc3", b"\xc3") in tokens  # split characters


def test_anthropic_text_delta_template_writes_the_events_bytes():
    for text in ["12", 'a "quote", a \\ and a\nnewline', "é🎉你好", "\x00\x1f", ""]:
        delta = {"index": 0, "delta": {"type": "text_delta", "text": text}}
        assert wire_anthropic._text_delta(text) == wire_anthropic._event("content_block_delta", delta)


def test_anthropic_streamed_tool_use_reassembles_to_the_plain_one():
    server = ServerThread(ScriptedEngine(["Sure.\n" + CALL]), api_key=KEY)
    try:
        sampling = SamplingParams(max_tokens=128, stop_token_ids=(TOK.eos_token_id,))
        plain_session, stream_session = server.open(sampling), server.open(sampling)
        ask = {"model": "molt", "max_tokens": 100, "messages": MESSAGES, "tools": [ANTHROPIC_TOOL]}
        plain = _anthropic(server, plain_session).messages.create(**ask)
        with _anthropic(server, stream_session).messages.stream(**ask) as stream:
            events = list(stream)
            final = stream.get_final_message()
    finally:
        server.stop()
    pieces = [
        e.delta.partial_json for e in events if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
    ]
    assert len(pieces) > 1 and json.loads("".join(pieces)) == {"expression": "12*345"}  # sent in pieces

    def blocks(message):
        return [(b.type, b.text) if b.type == "text" else (b.type, b.name, b.input) for b in message.content]

    expected = [("text", "Sure."), ("tool_use", "calculate", {"expression": "12*345"})]
    assert blocks(final) == blocks(plain) == expected
    assert (final.stop_reason, final.usage.output_tokens) == (plain.stop_reason, plain.usage.output_tokens)
    assert events[0].type == "message_start" and events[0].message.usage.input_tokens == plain.usage.input_tokens > 0


def test_reassemble_calls_helper_matches_plain_tool_calls():
    class Delta:  # the shape of the SDK's streamed tool-call delta
        def __init__(self, index, id=None, name=None, arguments=None):
            self.index, self.id = index, id
            self.function = type("F", (), {"name": name, "arguments": arguments})()

    chunk = lambda d: type("C", (), {"choices": [type("Ch", (), {"delta": type("D", (), {"tool_calls": d})()})()]})()  # noqa: E731
    chunks = [
        chunk([Delta(0, "c1", "f", "")]),
        chunk([Delta(0, arguments='{"a"')]),
        chunk([Delta(0, arguments=": 1}")]),
    ]
    assert reassemble_calls(chunks) == [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    ]


def test_model_aliases_from_the_config_reach_the_training_server():
    """`chat.model_aliases` passes through CHAT_SERVER_OPTIONS; other names are a 404 on `ctx.openai()` too."""

    class NamedModels(ChatAgent):
        async def run(self, ctx):
            client = ctx.openai(max_retries=0)
            with pytest.raises(openai.NotFoundError):
                await client.chat.completions.create(model="gpt-4o", messages=ctx.messages)
            reply = await client.chat.completions.create(model="my-agent-model", messages=ctx.messages)
            return Result(reward=float(bool(reply.choices)))

    chat = ChatConfig(model_aliases=("my-agent-model",))
    runner = ChatRunner(ScriptedEngine(["19"]), TOK, **{k: getattr(chat, k) for k in CHAT_SERVER_OPTIONS})

    async def main():
        try:
            return await runner.run(NamedModels(), {"messages": MESSAGES}, GREEDY, EpisodeLimits(max_len=256))
        finally:
            await runner.close()

    (segment,) = asyncio.run(main())
    assert segment.reward == 1.0 and TOK.decode(masked_ids(segment), skip_special_tokens=True) == "19"


def test_session_clients_are_copies_with_their_own_url_and_resources():
    async def check():
        pool = ClientPool()
        a, b = (pool.client(sdk, f"http://127.0.0.1:9/s/{s}/v1", KEY) for sdk, s in (("openai", "a"), ("openai", "b")))
        assert str(a.base_url).endswith("/s/a/v1/") and str(b.base_url).endswith("/s/b/v1/")
        assert a.chat.completions._client is a and b.chat.completions._client is b
        assert a._client is b._client  # one shared HTTP client
        c = pool.client("anthropic", "http://127.0.0.1:9/s/c", KEY)
        assert str(c.base_url).endswith("/s/c/") and c.messages._client is c
        await pool.close()

    asyncio.run(check())


def test_in_process_session_clients_share_one_url_and_name_their_session_in_a_header():
    async def check():
        engine = ScriptedEngine(["hi"])
        server = await ChatServer(engine, TOK, api_key=KEY).start()
        pool = ClientPool(server)
        try:
            a, b = (server.open_session(GREEDY, max_len=256) for _ in range(2))
            clients = [pool.client("openai", f"{server.url}/s/{s.id}/v1", KEY, s.id) for s in (a, b)]
            assert str(clients[0].base_url) == str(clients[1].base_url) == f"{server.url}/v1/"
            for client in clients:
                reply = await client.chat.completions.create(model="molt", messages=MESSAGES)
                assert reply.choices[0].message.content == "hi"
            claude = pool.client("anthropic", f"{server.url}/s/{a.id}", KEY, a.id)  # routes FastAPI serves too
            counted = await claude.messages.count_tokens(model="molt", messages=MESSAGES)
            assert str(claude.base_url).rstrip("/") == server.url and counted.input_tokens > 0
            moved = clients[0].with_options(base_url=f"{server.url}/s/{b.id}/v1")  # a path names b: it wins
            await moved.chat.completions.create(model="molt", messages=MESSAGES + [{"role": "user", "content": "x"}])
            assert len(server.close_session(a.id)) == 1 and len(server.close_session(b.id)) == 2
            with pytest.raises(openai.NotFoundError):  # a finished session's header: 404, as its path would be
                await clients[0].with_options(max_retries=0).chat.completions.create(model="molt", messages=MESSAGES)
        finally:
            await pool.close()
            await server.stop()

    asyncio.run(check())


def test_top_k_is_honoured_in_serve_mode_on_both_wires(served):
    kw = {"model": "molt", "messages": MESSAGES, "max_tokens": 8}
    greedy = _openai(served).chat.completions.create(temperature=0, **kw).choices[0].message.content
    top1 = _openai(served).chat.completions.create(temperature=1, extra_body={"top_k": 1}, **kw)
    assert top1.choices[0].message.content == greedy  # only the most likely token can be drawn
    top1 = _anthropic(served).messages.create(extra_body={"temperature": 1, "top_k": 1}, **kw)
    assert top1.content[0].text == greedy


def test_a_non_streamed_request_whose_client_hangs_up_is_cancelled():
    """A client timing out on a non-streamed request (the SDKs' `timeout`) aborts its generation, as a streamed
    one's disconnect does: the engine does not decode on for nobody (the audit measured 194 more tokens)."""

    class Hanging(ScriptedEngine):
        started: threading.Event = threading.Event()
        cancelled: threading.Event = threading.Event()

        async def generate_group(self, *args, **kwargs):
            self.started.set()
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.cancelled.set()
                raise

    engine = Hanging()
    server = ServerThread(engine, api_key=KEY, serve_sampling=SamplingParams(max_tokens=16), serve_max_len=128)
    try:
        with pytest.raises(openai.APITimeoutError):
            _openai(server).with_options(timeout=1.0).chat.completions.create(model="molt", messages=MESSAGES)
        assert engine.started.is_set() and engine.cancelled.wait(30)
    finally:
        server.stop()


def test_tools_reach_the_template_as_sent():
    """Re-serialised tool specs reordered their keys, so a template rendering `tools | tojson` (Qwen's) gave another
    prompt than `apply_chat_template(tools=...)` on the request's own tools (93 tokens against 94)."""
    import json

    from molt.agents.chat.wire_openai import decode

    tool = {"function": {"name": "calc", "strict": True, "parameters": {"type": "object"}}, "type": "function"}
    request = decode({"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [tool]})
    assert json.dumps(request.tools) == json.dumps([tool])
