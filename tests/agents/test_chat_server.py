"""The chat server through the real `openai` and `anthropic` SDKs: plain, streaming, tools, usage, errors."""

import json
import logging

import anthropic
import httpx
import openai
import pytest
from chat_support import CALC_TOOL, SAMPLING, TOK, ScriptedEngine, ServerThread, masked_ids
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from molt.agents.chat.prompt_tokens import OverContext, encode_within
from molt.agents.chat.server import template_renders_tools
from molt.models.tokenizer import build_builtin_tokenizer

KEY = "test-key"
CALL = '<tool_call>\n{"name": "calculate", "arguments": {"expression": "12*345"}}\n</tool_call>'
ANTHROPIC_TOOL = {"name": "calculate", "description": "calc", "input_schema": CALC_TOOL["function"]["parameters"]}


@pytest.fixture
def served(request):
    engine = ScriptedEngine(getattr(request, "param", ["hello there"]))
    server = ServerThread(engine, api_key=KEY, max_body_bytes=20_000)
    yield server, engine
    server.stop()


def reassemble_calls(chunks) -> list[dict]:
    """OpenAI streamed `tool_calls` deltas -> the calls (id and name first, arguments in pieces)."""
    calls: dict[int, dict] = {}
    for chunk in chunks:
        for delta in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            call = calls.setdefault(
                delta.index, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}}
            )
            call["id"] += delta.id or ""
            call["function"]["name"] += delta.function.name or ""
            call["function"]["arguments"] += delta.function.arguments or ""
    return [calls[i] for i in sorted(calls)]


def _openai(server, session, key=KEY):
    return openai.OpenAI(base_url=server.session_url(session) + "/v1", api_key=key, max_retries=0)


def _anthropic(server, session, key=KEY):
    return anthropic.Anthropic(base_url=server.session_url(session), api_key=key, max_retries=0)


def test_openai_plain_and_streaming_with_usage(served):
    server, engine = served
    session = server.open()
    client = _openai(server, session)
    messages = [{"role": "user", "content": "hi"}]
    reply = client.chat.completions.create(model="molt", messages=messages)
    assert reply.choices[0].message.content == "hello there" and reply.choices[0].finish_reason == "stop"
    assert reply.usage.prompt_tokens == len(engine.prompts[0]) and reply.usage.completion_tokens == 12
    messages += [{"role": "assistant", "content": "hello there"}, {"role": "user", "content": "more"}]
    chunks = list(
        client.chat.completions.create(
            model="molt", messages=messages, stream=True, stream_options={"include_usage": True}
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "hello there" and [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage.completion_tokens == 12 and chunks[-1].usage.prompt_tokens == len(engine.prompts[1])
    assert [m.id for m in client.models.list()] == ["molt"]
    (segment,) = server.server.close_session(session.id)
    assert masked_ids(segment) == engine.emitted[0] + engine.emitted[1]


@pytest.mark.parametrize("served", [[CALL, CALL, "4140"]], indirect=True)
def test_openai_three_turn_tool_conversation_is_token_exact(served):
    server, engine = served
    session = server.open()
    client = _openai(server, session)
    messages = [{"role": "user", "content": "12*345="}]
    for turn in range(3):
        reply = client.chat.completions.create(model="molt", messages=messages, tools=[CALC_TOOL], stream=turn == 1)
        if turn == 1:  # rebuild the message from the stream, as SDK users do
            chunks = list(reply)
            assert chunks[-1].choices[0].finish_reason == "tool_calls"
            message = {"role": "assistant", "tool_calls": reassemble_calls(chunks)}
        else:
            message = reply.choices[0].message.model_dump(exclude_none=True)
            assert reply.choices[0].finish_reason == ("tool_calls" if turn == 0 else "stop")
        messages.append(message)
        for call in message.get("tool_calls", []):
            assert json.loads(call["function"]["arguments"]) == {"expression": "12*345"}
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": "4140"})
    assert messages[-1] == {"role": "assistant", "content": "4140"}
    (segment,) = server.server.close_session(session.id)
    assert masked_ids(segment) == engine.emitted[0] + engine.emitted[1] + engine.emitted[2]
    starts = [start for start, _, _, _ in segment.actions]
    assert [segment.tokens[:s] for s in starts] == engine.prompts  # each context: exact previous ids + delta


@pytest.mark.parametrize("served", [[CALL, "4140"]], indirect=True)
def test_anthropic_tool_use_plain_and_streaming(served):
    server, engine = served
    session = server.open()
    client = _anthropic(server, session)
    messages = [{"role": "user", "content": "12*345="}]
    reply = client.messages.create(
        model="molt", max_tokens=100, system="be exact", messages=messages, tools=[ANTHROPIC_TOOL]
    )
    assert reply.stop_reason == "tool_use" and reply.usage.output_tokens == len(engine.emitted[0])
    (block,) = reply.content
    assert block.type == "tool_use" and block.input == {"expression": "12*345"} and block.id.startswith("toolu_")
    messages += [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": block.id, "content": "4140"}]},
    ]
    with client.messages.stream(
        model="molt", max_tokens=100, system="be exact", messages=messages, tools=[ANTHROPIC_TOOL]
    ) as stream:
        final = stream.get_final_message()
    assert final.content[0].text == "4140" and final.stop_reason == "end_turn"
    assert final.usage.input_tokens == len(engine.prompts[1]) and final.usage.output_tokens == 5
    (segment,) = server.server.close_session(session.id)
    assert masked_ids(segment) == engine.emitted[0] + engine.emitted[1]
    assert "<tool_response>\n4140\n</tool_response>" in TOK.decode(segment.tokens)  # the tool_result matched
    client = _anthropic(server, server.open())
    with client.messages.stream(model="molt", max_tokens=100, messages=messages[:1], tools=[ANTHROPIC_TOOL]) as stream:
        (streamed,) = stream.get_final_message().content
    assert streamed.type == "tool_use" and streamed.id.startswith("toolu_")  # as Anthropic's ids (were call_...)


def test_anthropic_empty_reply_is_one_empty_text_block_plain_and_streamed(served):
    """A stop sequence cutting the reply at its start: the plain reply holds one empty text block, and so does the
    streamed one (it had no content block at all: `content=[]`)."""
    server, _ = served
    client = _anthropic(server, server.open())
    kw = {"model": "molt", "max_tokens": 20, "messages": [{"role": "user", "content": "hi"}], "stop_sequences": ["he"]}
    plain = client.messages.create(**kw)
    with client.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    events = [event.type for event in client.messages.create(stream=True, **kw)]
    assert [(b.type, b.text) for b in plain.content] == [(b.type, b.text) for b in final.content] == [("text", "")]
    assert plain.stop_reason == final.stop_reason == "stop_sequence"
    assert events == ["message_start", "content_block_start", "content_block_stop", "message_delta", "message_stop"]


def test_idempotent_retry_does_not_duplicate_tokens(served):
    """A retry (an SDK's x-stainless-retry-count > 0, or a client that counts none) gets the cached reply; an SDK's
    first try of an identical request (best-of-k by repeated calls) samples anew."""
    server, engine = served
    session = server.open()
    client = _openai(server, session)
    messages = [{"role": "user", "content": "hi"}]
    first = client.chat.completions.create(model="molt", messages=messages)
    retry = client.chat.completions.create(
        model="molt", messages=messages, extra_headers={"x-stainless-retry-count": "1"}
    )
    url = server.session_url(session) + "/v1/chat/completions"
    raw = httpx.post(url, json={"model": "molt", "messages": messages}, headers={"authorization": f"Bearer {KEY}"})
    assert (
        retry.choices[0].message.content
        == first.choices[0].message.content
        == raw.json()["choices"][0]["message"]["content"]
    )
    assert len(engine.emitted) == 1
    (segment,) = server.server.close_session(session.id)
    assert masked_ids(segment) == engine.emitted[0] and segment.num_turns == 1
    session = server.open()
    for _ in range(2):
        _openai(server, session).chat.completions.create(model="molt", messages=messages)
    assert len(engine.emitted) == 3 and len(server.server.close_session(session.id)) == 2


def test_error_codes(served):
    server, engine = served
    session, other = server.open(), server.open()
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.AuthenticationError) as wrong_key:
        _openai(server, session, key="wrong").chat.completions.create(model="molt", messages=messages)
    assert wrong_key.value.code == "invalid_api_key"
    with pytest.raises(anthropic.AuthenticationError):
        _anthropic(server, session, key="wrong").messages.create(model="molt", max_tokens=8, messages=messages)
    with pytest.raises(openai.NotFoundError):
        openai.OpenAI(base_url=f"{server.server.url}/s/nosuchsession/v1", api_key=KEY, max_retries=0).models.list()
    with pytest.raises(openai.NotFoundError, match="does not exist") as unknown:
        _openai(server, session).chat.completions.create(model="gpt-5", messages=messages)
    assert (unknown.value.type, unknown.value.code) == ("invalid_request_error", "model_not_found")  # as OpenAI's
    with pytest.raises(openai.BadRequestError, match="response_format"):
        _openai(server, session).chat.completions.create(
            model="molt", messages=messages, response_format={"type": "json_object"}
        )
    with pytest.raises(anthropic.BadRequestError):
        _anthropic(server, session).messages.create(
            model="molt", max_tokens=8, messages=[{"role": "robot", "content": "x"}]
        )
    url, auth = server.session_url(session) + "/v1/chat/completions", {"authorization": f"Bearer {KEY}"}
    assert httpx.post(url, content=b"{not json", headers=auth).status_code == 400
    assert httpx.post(url, content=b"NaN", headers=auth).status_code == 400
    bad = httpx.post(url, json={"model": "molt", "messages": messages, "temperature": 9}, headers=auth)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "temperature"  # as OpenAI answers
    assert httpx.get(f"{server.server.url}/v1/nope", headers=auth).json()["error"]["type"] == "invalid_request_error"
    assert (
        httpx.post(url, json={"messages": [{"role": "user", "content": "x" * 30_000}]}, headers=auth).status_code == 413
    )
    assert httpx.post(url, json={"messages": messages}).status_code == 401
    assert httpx.get(f"{server.server.url}/health").json()["status"] == "ok"
    assert engine.emitted == []  # no failed request generated anything
    _openai(server, other).chat.completions.create(model="molt", messages=messages)
    assert server.server.close_session(session.id) == []  # a request on `other` never touches `session`
    with pytest.raises(openai.NotFoundError):  # finished session
        _openai(server, session).chat.completions.create(model="molt", messages=messages)
    (segment,) = server.server.close_session(other.id)
    assert masked_ids(segment) == engine.emitted[0]


def test_requests_the_apis_refuse_are_400s_naming_the_field(served):
    server, engine = served
    session = server.open()
    oa, an = _openai(server, session), _anthropic(server, session)
    messages = [{"role": "user", "content": "hi"}]
    openai_refused = {
        "nope": {"tools": [CALC_TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "no tools": {"tool_choice": "required"},
        "logit_bias": {"logit_bias": {"5": 10}},
        "presence_penalty": {"presence_penalty": 1},
        "chat_template_kwargs": {"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}},  # was ignored
        "image_url.url": {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        "parallel_tool_calls=false is not supported by Molt's server; omit it or send true": {
            "tools": [CALC_TOOL],
            "parallel_tool_calls": False,
        },
    }
    anthropic_refused = {
        "nope": {"tools": [ANTHROPIC_TOOL], "tool_choice": {"type": "tool", "name": "nope"}},
        "no tools": {"tool_choice": {"type": "any"}},
        "thinking": {"thinking": {"type": "enabled", "budget_tokens": 1024}},
        "output_config": {"output_config": {"effort": "low"}},
        "disable_parallel_tool_use": {
            "tools": [ANTHROPIC_TOOL],
            "tool_choice": {"type": "auto", "disable_parallel_tool_use": True},
        },
        "prefill": {"messages": [*messages, {"role": "assistant", "content": "The answer is"}]},
    }
    for name, options in openai_refused.items():
        with pytest.raises(openai.BadRequestError, match=name):
            oa.chat.completions.create(**{"model": "molt", "messages": messages} | options)
    for name, options in anthropic_refused.items():
        with pytest.raises(anthropic.BadRequestError, match=name):
            an.messages.create(**{"model": "molt", "max_tokens": 8, "messages": messages} | options)
        if name not in ("thinking", "output_config"):  # count_tokens refuses the same request the same way
            with pytest.raises(anthropic.BadRequestError, match=name):
                an.messages.count_tokens(**{"model": "molt", "messages": messages} | options)
    url, auth = server.session_url(session), {"authorization": f"Bearer {KEY}"}
    missing = [
        ("/v1/chat/completions", {"messages": messages}, "model"),
        ("/v1/messages", {"messages": messages, "max_tokens": 8}, "model"),
        ("/v1/messages", {"model": "molt", "messages": messages}, "max_tokens"),
    ]
    for path, body, name in missing:
        response = httpx.post(url + path, json=body, headers=auth)
        assert response.status_code == 400 and name in response.text, response.text
    lone = json.dumps({"model": "molt", "messages": [*messages, {"role": "user", "content": "a\ud800"}]})
    response = httpx.post(url + "/v1/chat/completions", content=lone, headers=auth)
    assert response.status_code == 400 and "messages[1].content" in response.json()["error"]["message"]
    assert engine.emitted == []
    restated = {"chat_template_kwargs": {}}  # the server's own options (none here), as a vLLM agent may send them
    assert oa.chat.completions.create(model="molt", messages=messages, max_tokens=2, extra_body=restated).choices
    defaults = oa.chat.completions.create(model="molt", messages=messages, presence_penalty=0, logit_bias={})
    assert defaults.choices[0].message.content == "hello there"


def test_tool_definitions_the_apis_refuse_are_400s_naming_the_field(served):
    """Tool names with whitespace or over 128 characters, a name given twice, a schema that is not an object's: a 400
    naming the field (Molt rendered and generated them); names and tools real agent frameworks send still pass."""
    server, engine = served
    session = server.open()
    oa, an = _openai(server, session), _anthropic(server, session)
    messages, schema = [{"role": "user", "content": "hi"}], CALC_TOOL["function"]["parameters"]

    def tool(name: str = "calculate", parameters: dict = schema) -> dict:
        return {"type": "function", "function": {"name": name, "parameters": parameters}}

    openai_refused = [
        ([tool("bad name!")], "tools.0.function.name"),
        ([tool("")], "tools.0.function.name"),
        ([tool("x" * 129)], "tools.0.function.name"),
        ([CALC_TOOL, CALC_TOOL], "tools"),
        ([tool(parameters={"type": "banana"})], "tools.0.function.parameters"),
        ([CALC_TOOL, tool("listing", {"type": "array", "items": {"type": "string"}})], "tools.1.function.parameters"),
    ]
    for tools, field in openai_refused:
        with pytest.raises(openai.BadRequestError, match=f"invalid request: {field}: ") as refused:
            oa.chat.completions.create(model="molt", messages=messages, tools=tools)
        assert refused.value.param == field
    anthropic_refused = [
        ([{"name": "calculate", "description": "calc"}], "tools.0"),  # a custom tool needs its schema
        ([ANTHROPIC_TOOL | {"name": "bad name!"}], "tools.0.name"),
        ([ANTHROPIC_TOOL, ANTHROPIC_TOOL], "tools"),
        ([ANTHROPIC_TOOL | {"input_schema": {"type": "banana"}}], "tools.0.input_schema"),
    ]
    for tools, field in anthropic_refused:
        with pytest.raises(anthropic.BadRequestError, match=f"invalid request: {field}: "):
            an.messages.create(model="molt", max_tokens=8, messages=messages, tools=tools)
    assert engine.emitted == []
    with pytest.raises(openai.BadRequestError) as refused:  # RequestErrors name their field too
        oa.chat.completions.create(model="molt", messages=messages, tools=[CALC_TOOL], tool_choice="nope")
    assert refused.value.param == "tool_choice"
    with pytest.raises(openai.BadRequestError) as refused:
        oa.chat.completions.create(model="molt", messages=messages, tool_choice="required")
    assert refused.value.param == "tool_choice"
    with pytest.raises(openai.BadRequestError, match=r"messages\.0\.content: Input should be") as refused:
        oa.chat.completions.create(model="molt", messages=[{"role": "user", "content": 5}])
    assert refused.value.param == "messages.0.content"  # not messages.0.content.str, pydantic's union branch
    valid = [tool("calc-2_B", {}), tool("noparams", None), tool("github.create_issue", {"type": ["object"]})]
    assert oa.chat.completions.create(model="molt", messages=messages, tools=valid).choices  # MCP's dotted names too
    typed = [{"type": "bash_20250124", "name": "bash"}, ANTHROPIC_TOOL | {"name": "fs.read"}]  # client tools
    assert an.messages.create(model="molt", max_tokens=8, messages=messages, tools=typed).content


def test_models_retrieve_knows_the_name_and_its_aliases():
    server = ServerThread(ScriptedEngine(), api_key=KEY, model_aliases=("Org/base",))
    try:
        for base in (server.server.url, server.session_url(server.open())):
            client = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0)
            assert client.models.retrieve("molt").id == "molt" and client.models.retrieve("Org/base").id == "Org/base"
            with pytest.raises(openai.NotFoundError, match="does not exist"):
                client.models.retrieve("gpt-5")
    finally:
        server.stop()


def test_engine_failure_is_503_and_a_retry_succeeds(served):
    server, engine = served
    engine.fail_next = 1
    session = server.open()
    client = _openai(server, session)
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.InternalServerError):
        client.chat.completions.create(model="molt", messages=messages)
    assert client.chat.completions.create(model="molt", messages=messages).choices[0].message.content == "hello there"
    (segment,) = server.server.close_session(session.id)
    assert masked_ids(segment) == engine.emitted[0] and segment.num_turns == 1


def _trained_bpe() -> PreTrainedTokenizerFast:
    """A byte-level BPE with merges and the regex pre-tokenizer (as GPT-2/Qwen), trained in milliseconds."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<|im_end|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    backend.train_from_iterator(["hello world, the chat server tokenizes the text  \n\n"] * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>")


def test_large_prompts_are_counted_before_their_ids_are_converted():
    """`encode_within` (large prompts, in a worker thread) gives `encode`'s ids, or the exact count when over."""
    text = "hello world<|im_end|> héllo\n\n  the  chat<tool_call>server 🙂 tokenizes" * 50
    for tokenizer in (TOK, _trained_bpe()):
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert encode_within(tokenizer, text, len(ids) + 1) == ids
        with pytest.raises(OverContext) as over:
            encode_within(tokenizer, text, len(ids))  # no room left to generate
        assert over.value.num_tokens == len(ids)
    truncating = _trained_bpe()  # a backend set to truncate: transformers' own `encode`, which undoes that
    full = truncating.encode(text, add_special_tokens=False)
    truncating.backend_tokenizer.enable_truncation(8)
    assert encode_within(truncating, text, 1 << 20) == full


@pytest.mark.parametrize("served", [["こんにちは"]], indirect=True)
def test_logprob_bytes_are_each_tokens_own_and_rebuild_the_text(served):
    """Byte tokens hold parts of a character: `bytes` are theirs (joined: the text's UTF-8), `token` escapes them."""
    server, _ = served
    client = _openai(server, server.open())
    reply = client.chat.completions.create(model="molt", messages=[{"role": "user", "content": "hi"}], logprobs=True)
    tokens = reply.choices[0].logprobs.content
    assert b"".join(bytes(t.bytes) for t in tokens[:-1]) == "こんにちは".encode()  # the last one: <|im_end|>
    assert [t.token for t in tokens[:3]] == ["\\xe3", "\\x81", "\\x93"] and tokens[-1].token == "<|im_end|>"


IGNORES_TOOLS = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"


def test_a_template_that_ignores_tools_is_warned_about_once(caplog):
    """SmolLM2-like templates drop `tools`: `molt serve` warns at start-up, training at the first tools; once."""
    blind = build_builtin_tokenizer()
    blind.chat_template = IGNORES_TOOLS
    assert template_renders_tools(TOK) and not template_renders_tools(blind)
    for serve in (SAMPLING, None):
        with caplog.at_level(logging.WARNING, "molt.chat"):
            server = ServerThread(ScriptedEngine(), blind, api_key=KEY, serve_sampling=serve)
            warned_at_start = len(caplog.records)
            for _ in range(2):  # answered normally, warned about once
                reply = _openai(server, server.open()).chat.completions.create(
                    model="molt", messages=[{"role": "user", "content": "hi"}], tools=[CALC_TOOL]
                )
                assert reply.choices[0].message.content == "ok"
            server.stop()
        assert warned_at_start == (serve is not None) and len(caplog.records) == 1
        assert "--chat.no_render_tools" in caplog.text and "--chat.tool_parser" in caplog.text
        caplog.clear()
    quiet = ServerThread(ScriptedEngine(), blind, render_tools=False)  # the policy knows its tools: no warning
    _openai(quiet, quiet.open()).chat.completions.create(model="molt", messages=[{"role": "user", "content": "hi"}])
    quiet.stop()
    assert not caplog.records
