"""`molt serve CHECKPOINT` as a user runs it: a real process, a real port, the real OpenAI SDK."""

import contextlib
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest
import torch

from molt.models import Transformer, build_builtin_tokenizer, preset, save_pretrained


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_molt_serve_checkpoint_answers_openai_sdk(tmp_path):
    tokenizer = build_builtin_tokenizer()
    cfg = preset("tiny", vocab_size=len(tokenizer), num_layers=1, eos_token_id=tokenizer.eos_token_id)
    save_pretrained(Transformer(cfg).init_weights(0.02, torch.Generator().manual_seed(0)), tmp_path / "ckpt", tokenizer)
    port = _free_port()
    cmd = [sys.executable, "-m", "molt.cli.main", "serve", str(tmp_path / "ckpt"), "--chat.port", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        base = _healthy(port)
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)
        reply = client.chat.completions.create(
            model="molt", messages=[{"role": "user", "content": "1+2="}], max_tokens=5, temperature=0
        )
        assert reply.choices[0].finish_reason in ("stop", "length")
        assert reply.usage.completion_tokens >= 1 and reply.usage.prompt_tokens > 0
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _healthy(port: int) -> str:
    """The base URL of the `molt serve` starting on `port`, once its /health answers (a bounded wait)."""
    base = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            time.sleep(0.1)
    return base


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGTERM, 0), (signal.SIGINT, 130)])
def test_a_signal_stops_molt_serve_gracefully_with_streams_in_flight(sig, code):
    """Streams in flight end (after a short grace, as an error event), one line and no traceback, the port freed."""
    port = _free_port()
    cmd = [sys.executable, "-m", "molt.cli.main", "serve", "--model.preset", "tiny", "--chat.port", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        base = _healthy(port)
        body = {"model": "molt", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2000,
                "temperature": 0, "stream": True}  # fmt: skip
        with contextlib.ExitStack() as stack:
            url = f"{base}/v1/chat/completions"
            lines = [stack.enter_context(httpx.stream("POST", url, json=body, timeout=60)).iter_lines() for _ in "abc"]
            firsts = [next(line) for line in lines]  # each stream is under way
            proc.send_signal(sig)
            lasts = [[text for text in line if text][-1] for line in lines]  # each ends with an event, no client error
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert all(first.startswith("data: ") for first in firsts)
    assert all(last == "data: [DONE]" or '"error"' in last for last in lasts)
    assert proc.returncode == code and err.splitlines() == [f"molt serve: stopped ({sig.name})"]  # no traceback
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind(("127.0.0.1", port))  # the port is free again
