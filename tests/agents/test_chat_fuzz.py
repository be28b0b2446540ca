"""Fuzzing the chat server: random JSON bodies and message lists never give a 500 or corrupt a session."""

import json

import httpx
import pytest
from chat_support import ScriptedEngine, ServerThread, masked_ids
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

KEY = "fuzz"
OK = {200, 400, 404, 413}

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)
roles = st.sampled_from(["system", "developer", "user", "assistant", "tool", "robot"])
text = st.text(max_size=40) | st.sampled_from(["<tool_call>", "</tool_call>", "<|im_end|>", "\x00", "\ud800"])
content = st.none() | text | st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image"]), "text": text}))
tool_call = st.fixed_dictionaries(
    {"id": st.text(max_size=5), "function": st.fixed_dictionaries({"name": text, "arguments": text | json_values})}
)
openai_message = st.fixed_dictionaries(
    {"role": roles, "content": content},
    optional={"tool_calls": st.lists(tool_call, max_size=2), "tool_call_id": text},
)
openai_body = st.fixed_dictionaries(
    {"messages": st.lists(openai_message, max_size=4), "model": st.just("molt") | text},  # no model: a 400
    optional={
        "max_tokens": st.integers(-2, 50),
        "temperature": st.floats(-1, 3),
        "stop": st.none() | text | st.lists(text, max_size=5),
        "stream": st.booleans(),
        "tools": st.lists(st.fixed_dictionaries({"type": st.just("function"), "function": json_values}), max_size=2),
        "n": st.integers(0, 2),
    },
)
anthropic_block = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "tool_use", "tool_result", "image", "thinking"])},
    optional={"text": text, "id": text, "name": text, "input": json_values, "tool_use_id": text, "content": content},
)
anthropic_body = st.fixed_dictionaries(
    {
        "messages": st.lists(
            st.fixed_dictionaries({"role": roles, "content": text | st.lists(anthropic_block)}), max_size=4
        ),
        "model": st.just("molt"),
        "max_tokens": st.integers(-1, 50),
    },
    optional={"system": content, "stream": st.booleans(), "tools": json_values},
)


@pytest.fixture(scope="module")
def fuzz_server():
    engine = ScriptedEngine(["fine", '<tool_call>{"name": "f", "arguments": {}}</tool_call>'])
    server = ServerThread(engine, api_key=KEY, max_body_bytes=4000)
    session = server.open(max_len=256)
    with httpx.Client(base_url=server.session_url(session), headers={"x-api-key": KEY}, timeout=30) as client:
        yield server, engine, session, client
    server.stop()


def _post(client, path, **kw):
    response = client.post(path, **kw)
    assert response.status_code in OK, (response.status_code, response.text)
    return response


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=json_values | openai_body, anthropic=json_values | anthropic_body, raw=st.binary(max_size=64))
def test_random_bodies_never_500_nor_corrupt_the_session(fuzz_server, body, anthropic, raw):
    server, engine, session, client = fuzz_server
    _post(client, "/v1/chat/completions", content=json.dumps(body))  # ascii escapes: lone surrogates travel
    _post(client, "/v1/messages", content=json.dumps(anthropic))
    _post(client, "/v1/chat/completions", content=raw)
    # the session stays consistent: every segment is exactly the engine's emitted ids under mask 1
    segments = session.sealed + ([session.current] if session.current else [])
    assert [i for s in segments for i in masked_ids(s)] == [i for ids in engine.emitted for i in ids]
    for s in segments:
        s.check()


CALL = '<tool_call>{{"name": {}, "arguments": {}}}</tool_call>'
BAD_CALLS = [  # tool-call text a policy can write that is not a valid call: the reply is plain text, never a 500
    CALL.format('["f"]', "{}"),
    CALL.format('{"a": 1}', "{}"),
    CALL.format('"f"', '{"x": "\\ud800"}'),
    CALL.format('"f"', '"{\\"x\\": \\"\\\\udfff\\"}"'),  # a lone surrogate inside JSON-string arguments
    CALL.format('"f"', '{"x": NaN}'),
    CALL.format('"f"', '{"x": -Infinity}'),
    CALL.format('"f"', '{"x": 1e999}'),
]


@pytest.mark.parametrize("reply", BAD_CALLS)
def test_a_malformed_tool_call_comes_back_as_text_on_every_wire(reply):
    server = ServerThread(ScriptedEngine([reply]), api_key=KEY)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"properties": {"x": {}}}}}]
    anthropic_tools = [{"name": "f", "input_schema": {"properties": {"x": {}}}}]
    try:
        url = server.session_url(server.open(max_len=512))
        with httpx.Client(base_url=url, headers={"x-api-key": KEY}, timeout=30) as client:
            messages = [{"role": "user", "content": "hi"}]
            body = {"model": "molt", "messages": messages, "tools": tools}
            message = client.post("/v1/chat/completions", json=body).raise_for_status().json()["choices"][0]["message"]
            assert message["content"] == reply and not message.get("tool_calls")
            streamed = client.post("/v1/chat/completions", json={**body, "stream": True}).raise_for_status().text
            assert "tool_calls" not in streamed and "[DONE]" in streamed
            body = {"model": "molt", "messages": messages, "max_tokens": 64, "tools": anthropic_tools}
            blocks = client.post("/v1/messages", json=body).raise_for_status().json()["content"]
            assert [b["type"] for b in blocks] == ["text"]
    finally:
        server.stop()
