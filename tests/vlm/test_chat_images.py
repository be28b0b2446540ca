"""The chat server with a VLM policy: OpenAI `image_url` and Anthropic image blocks, recorded with their pixels."""

import base64
import sys
from pathlib import Path

import anthropic
import openai
import pytest
from vlm_support import IMAGE_ID, PER_IMAGE, TOK, image, png_bytes, small_vlm

from molt.engine import SamplingParams, TorchEngine
from molt.models.vision import pixel_hash, to_pixels

sys.path.insert(0, str(Path(__file__).parents[1] / "agents"))
from chat_support import ServerThread, in_process_and_in_a_worker  # noqa: E402

KEY = "k"
RED, BLUE = png_bytes(image((230, 20, 20))), png_bytes(image((20, 20, 230)))


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@pytest.fixture
def served():
    engine = TorchEngine(small_vlm(), num_slots=4, max_seq_len=256, eos_token_ids=(TOK.eos_token_id,))
    server = ServerThread(engine, tokenizer=TOK, api_key=KEY)
    yield server
    server.stop()


def _hashes(*images: bytes) -> list[str]:
    return [pixel_hash(to_pixels(im, 16)) for im in images]


def _recorded(server, session):
    (traj,) = server.server.close_session(session.id)
    starts = [i for i, t in enumerate(traj.tokens) if t == IMAGE_ID and traj.tokens[i - 1] != IMAGE_ID]
    assert [r["start"] for r in traj.images] == starts
    assert all(traj.tokens[s : s + PER_IMAGE] == [IMAGE_ID] * PER_IMAGE for s in starts)
    return traj


def test_openai_image_url_turns_are_recorded_with_their_pixels(served):
    session = served.open(SamplingParams(temperature=1.0, max_tokens=4, seed=0))
    client = openai.OpenAI(base_url=served.session_url(session) + "/v1", api_key=KEY, max_retries=0)
    part = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + _b64(RED)}}
    messages = [{"role": "user", "content": [{"type": "text", "text": "what?"}, part]}]
    reply = client.chat.completions.create(model="molt", messages=messages)
    messages += [{"role": "assistant", "content": reply.choices[0].message.content}]
    messages += [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:;base64," + _b64(BLUE)}}]}
    ]
    client.chat.completions.create(model="molt", messages=messages)
    traj = _recorded(served, session)
    assert [r["hash"] for r in traj.images] == _hashes(RED, BLUE) and traj.num_turns == 2
    bad = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]
    other = served.open()
    with pytest.raises(openai.BadRequestError, match="image 0: cannot decode"):
        openai.OpenAI(base_url=served.session_url(other) + "/v1", api_key=KEY, max_retries=0).chat.completions.create(
            model="molt", messages=bad
        )


def test_anthropic_image_blocks_are_recorded_with_their_pixels(served):
    session = served.open(SamplingParams(temperature=1.0, max_tokens=4, seed=0))
    client = anthropic.Anthropic(base_url=served.session_url(session), api_key=KEY, max_retries=0)
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": _b64(BLUE)}}
    client.messages.create(model="molt", max_tokens=4, messages=[{"role": "user", "content": [block]}])
    traj = _recorded(served, session)
    assert [r["hash"] for r in traj.images] == _hashes(BLUE)


def test_an_image_in_an_anthropic_tool_result_is_rendered_and_recorded(served):
    """A screenshot tool's result: the image inside the `tool_result` block reaches the policy (it was dropped)."""
    session = served.open(SamplingParams(temperature=1.0, max_tokens=4, seed=0))
    client = anthropic.Anthropic(base_url=served.session_url(session), api_key=KEY, max_retries=0)
    shot = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": _b64(RED)}}
    messages = [
        {"role": "user", "content": "look"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "screenshot", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [shot]}]},
    ]
    counted = client.messages.count_tokens(model="molt", messages=messages).input_tokens
    reply = client.messages.create(model="molt", max_tokens=4, messages=messages)
    traj = _recorded(served, session)
    assert [r["hash"] for r in traj.images] == _hashes(RED)
    assert reply.usage.input_tokens == counted  # count_tokens counts the image's tokens too


def test_an_image_request_from_an_agent_worker_is_recorded_as_in_process():
    """`rollout.agent_workers`: the image's pixels travel to the main process's engine and back into the segment."""
    from vlm_support import looking_agent, looking_kit

    from molt.agents.runner import EpisodeLimits

    row = {"messages": [], "png": RED}
    sampling, limits = SamplingParams(temperature=1.0, max_tokens=4, seed=3), EpisodeLimits(max_turns=1, max_len=256)
    engine = TorchEngine(small_vlm(), num_slots=4, max_seq_len=256, eos_token_ids=(TOK.eos_token_id,))
    (local,), (remote,) = in_process_and_in_a_worker(engine, TOK, looking_agent(), looking_kit, row, sampling, limits)
    assert remote.tokens == local.tokens and remote.loss_mask == local.loss_mask
    assert remote.rollout_logprobs == local.rollout_logprobs and remote.versions == local.versions
    assert [(r["start"], r["hash"]) for r in remote.images] == [(r["start"], r["hash"]) for r in local.images]
    assert [r["hash"] for r in remote.images] == _hashes(RED)


def test_image_urls_paths_and_file_ids_are_never_read(served, tmp_path):
    """Only base64 images are taken: a server-side path or a URL is a 400 that reveals nothing of the file."""
    (tmp_path / "secret.png").write_bytes(RED)
    session = served.open()
    client = openai.OpenAI(base_url=served.session_url(session) + "/v1", api_key=KEY, max_retries=0)
    for url in (str(tmp_path / "secret.png"), "/etc/shadow", "https://example.com/a.png"):
        part = {"type": "image_url", "image_url": {"url": url}}
        with pytest.raises(openai.BadRequestError, match="image URLs and paths are not fetched") as err:
            client.chat.completions.create(model="molt", messages=[{"role": "user", "content": [part]}])
        assert "bytes" not in str(err.value)
    claude = anthropic.Anthropic(base_url=served.session_url(session), api_key=KEY, max_retries=0)
    for source, message in [({"type": "url", "url": str(tmp_path / "secret.png")}, "image URLs are not fetched"),
                            ({"type": "file", "file_id": "file_1"}, "file_id sources are not supported")]:  # fmt: skip
        with pytest.raises(anthropic.BadRequestError, match=message):
            block = {"type": "image", "source": source}
            claude.messages.create(model="molt", max_tokens=4, messages=[{"role": "user", "content": [block]}])


@pytest.mark.parametrize("example", ["openai_agent.py", "anthropic_agent.py"])
def test_the_sdk_examples_run_on_image_rows(example):
    """`ctx.messages` of a `shape_colour` row hold OpenAI image parts (data URIs) that both SDKs' wires take."""
    import asyncio
    import random

    from molt.agents.chat import ChatRunner
    from molt.agents.chat.agent import load_agent_class
    from molt.agents.runner import EpisodeLimits
    from molt.data.tasks import get_task

    row = get_task("shape_colour").row(random.Random(0))
    row["messages"][0]["content"][0]["image"] = image((230, 20, 20))  # a PIL image in the row: sent as a data URI
    agent = load_agent_class(str(Path(__file__).parents[2] / "examples" / example))()
    engine = TorchEngine(small_vlm(), num_slots=2, max_seq_len=256, eos_token_ids=(TOK.eos_token_id,))

    async def main():
        runner = ChatRunner(engine, TOK)
        try:
            return await runner.run(agent, row, SamplingParams(temperature=1.0, max_tokens=4, seed=0), EpisodeLimits())
        finally:
            await runner.close()
            await engine.close()

    (traj,) = asyncio.run(main())
    assert [r["hash"] for r in traj.images] == _hashes(png_bytes(image((230, 20, 20))))
