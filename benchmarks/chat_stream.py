"""Chat server latency: time to the first streamed chunk, and `/health` while a huge prompt is rendered.

(a) A 64-token OpenAI stream (`tiny` preset, random weights, greedy, ignore_eos) through the official
`AsyncOpenAI` SDK over loopback HTTP: arrival time of the first content chunk vs the last one and the whole
request. Measured per chunk arrival, not per character (a byte-level vocabulary may hold back a partial
character). Baseline in the same run: the same request not streamed (its total time).
(b) `/health` polled every 10 ms by a second client while a request with a 4 MiB user message is read,
validated, rendered and (when it could fit) tokenized, `--health-repeats` times: median, p99 and max over
all polls, and the event loop's worst lag (a task sleeping 5 ms in a loop: its largest overrun). Two
training sessions (both answer an empty "length" reply, as the prompt exceeds the context): one whose context
the text certainly overflows (not tokenized) and one with a 131,072-token context (the text is tokenized in
full to know), the latter also through the previous path (transformers' `encode`, which converts every id,
type id and mask entry to Python holding the GIL). Baseline in the same run: `/health` on an idle server.
Goal (issue #25): first chunk before half the total; `/health` within 100 ms during the render.

Run: `.venv/bin/python benchmarks/chat_stream.py` (prints numbers; writes benchmarks/results/chat_stream.md).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import statistics
import time
from pathlib import Path

import httpx
import openai
import torch

from molt.agents.chat import session as chat_session
from molt.agents.chat.server import ChatServer
from molt.engine import SamplingParams, TorchEngine
from molt.models import Transformer, preset
from molt.models.tokenizer import build_builtin_tokenizer

KEY = "k"
MESSAGES = [{"role": "user", "content": "12+7="}]


async def stream_timing(server: ChatServer, tokens: int) -> dict[str, float]:
    """Seconds from sending to the first content chunk, to the last chunk, and to the end of the stream."""
    sampling = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, seed=0)
    session = server.open_session(sampling, max_len=1024)
    client = openai.AsyncOpenAI(base_url=f"{server.url}/s/{session.id}/v1", api_key=KEY, max_retries=0)
    arrivals, t0 = [], time.perf_counter()
    stream = await client.chat.completions.create(model="molt", messages=MESSAGES, stream=True)
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            arrivals.append(time.perf_counter() - t0)
    total = time.perf_counter() - t0
    (segment,) = server.close_session(session.id)
    plain_session = server.open_session(sampling, max_len=1024)
    plain_client = openai.AsyncOpenAI(base_url=f"{server.url}/s/{plain_session.id}/v1", api_key=KEY, max_retries=0)
    t1 = time.perf_counter()
    await plain_client.chat.completions.create(model="molt", messages=MESSAGES)
    plain = time.perf_counter() - t1
    server.close_session(plain_session.id)
    await client.close()
    await plain_client.close()
    return {
        "first": arrivals[0] if arrivals else total,
        "last": arrivals[-1] if arrivals else total,
        "total": total,
        "plain": plain,
        "chunks": len(arrivals),
        "tokens": segment.num_action_tokens,
    }


def _quantiles(latencies: list[float]) -> dict[str, float]:
    ordered = sorted(latencies)
    return {"median": statistics.median(ordered), "p99": ordered[int(0.99 * (len(ordered) - 1))], "max": ordered[-1]}


def _plain_encode(tokenizer, text: str, max_tokens: int) -> list[int]:
    """The previous large-prompt tokenization: transformers' `encode` (every list converted, then counted)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) >= max_tokens:
        raise chat_session.OverContext(len(ids))
    return ids


@contextlib.asynccontextmanager
async def loop_lag(every: float = 0.005):
    """The event loop's worst lag (s) while the block runs: the largest overrun of a `every`-second sleep."""
    overruns, done = [0.0], asyncio.Event()

    async def probe():
        while not done.is_set():
            t0 = time.perf_counter()
            await asyncio.sleep(every)
            overruns.append(time.perf_counter() - t0 - every)

    task = asyncio.ensure_future(probe())
    try:
        yield overruns
    finally:
        done.set()
        await task


async def health_during_render(server: ChatServer, prompt_bytes: int, max_len: int, repeats: int) -> dict:
    """`/health` latencies (s) while a request carrying `prompt_bytes` of text is processed by a session of
    `max_len` tokens, `repeats` times: median, p99 and max over all polls, the loop's worst lag, and the big
    request's median time."""
    async with httpx.AsyncClient(timeout=60) as poller, httpx.AsyncClient(timeout=120) as sender, loop_lag() as lags:

        async def health() -> float:
            t0 = time.perf_counter()
            (await poller.get(f"{server.url}/health")).raise_for_status()
            return time.perf_counter() - t0

        if max_len == 0:
            idle = _quantiles([await health() for _ in range(20 * repeats)])
            return idle | {"polls": 20 * repeats, "request_s": 0, "lag": max(lags)}
        busy, request_s = [], []
        body = json.dumps({"model": "molt", "messages": [{"role": "user", "content": "a" * prompt_bytes}]}).encode()
        headers = {"authorization": f"Bearer {KEY}", "content-type": "application/json"}
        for _ in range(repeats):  # the body is encoded once, beforehand: the sender shares the server's loop
            session = server.open_session(SamplingParams(temperature=0.0, max_tokens=4), max_len=max_len)
            url = f"{server.url}/s/{session.id}/v1/chat/completions"
            t0 = time.perf_counter()
            big = asyncio.ensure_future(sender.post(url, content=body, headers=headers))
            while not big.done():
                busy.append(await health())
                await asyncio.sleep(0.01)
            response = await big
            request_s.append(time.perf_counter() - t0)
            server.close_session(session.id)
            assert response.status_code == 200, response.text[:200]
    return _quantiles(busy) | {"polls": len(busy), "request_s": statistics.median(request_s), "lag": max(lags)}


HEALTH_CASES = {  # row -> the session's context (tokens; 0: no request, idle), the previous tokenization path
    "idle server": (0, False),
    "prompt over the session's context (1,024 tokens): not tokenized": (1024, False),
    "session context 131,072 tokens: rendered and tokenized in full": (1 << 17, False),
    "the same, tokenized by transformers' `encode` (the previous path)": (1 << 17, True),
}


async def measure(args) -> tuple[dict, dict]:
    tok = build_builtin_tokenizer()
    arch = preset("tiny", vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model = Transformer(arch).init_weights(0.02, torch.Generator().manual_seed(0)).eval()
    engine = TorchEngine(model, tokenizer=tok, num_slots=8, max_seq_len=1024)
    server = await ChatServer(engine, tok, api_key=KEY, max_body_bytes=2 * args.prompt_bytes).start()
    try:
        await stream_timing(server, args.tokens)  # warm-up
        streams = [await stream_timing(server, args.tokens) for _ in range(args.repeats)]
        health = {}
        for name, (max_len, previous) in HEALTH_CASES.items():
            encode_within = chat_session.encode_within
            chat_session.encode_within = _plain_encode if previous else encode_within
            try:
                health[name] = await health_during_render(server, args.prompt_bytes, max_len, args.health_repeats)
            finally:
                chat_session.encode_within = encode_within
    finally:
        await server.stop()
        await engine.close()
    stream = {k: statistics.median(s[k] for s in streams) for k in streams[0]}
    return stream, health


def report(stream: dict, health: dict, args) -> str:
    ms = lambda s: f"{s * 1000:.1f} ms"  # noqa: E731
    full, prev = list(health.values())[-2:]  # tokenized in full: now, and by the previous path
    return "\n".join([
        "# Chat server latency: streaming and responsiveness",
        "",
        f"`benchmarks/chat_stream.py`: `tiny` preset (random weights, fp32, built-in byte tokenizer), official "
        f"`AsyncOpenAI` SDK over loopback HTTP. Machine: {platform.machine()}, {os.cpu_count()} CPUs, torch "
        f"{torch.__version__}, {torch.get_num_threads()} threads; load average {os.getloadavg()[0]:.1f}.",
        "",
        f"## (a) A {args.tokens}-token stream (greedy, median of {args.repeats})",
        "",
        "| first content chunk | last content chunk | whole stream | same request, not streamed | chunks |",
        "|---:|---:|---:|---:|---:|",
        f"| {ms(stream['first'])} ({stream['first'] / stream['total']:.0%} of total) | {ms(stream['last'])} | "
        f"{ms(stream['total'])} | {ms(stream['plain'])} | {stream['chunks']:.0f} |",
        "",
        f"## (b) `/health` while a {args.prompt_bytes / (1 << 20):.0f} MiB prompt is processed "
        f"({args.health_repeats} requests per row, polled every 10 ms)",
        "",
        "| while | median | p99 | max | worst event-loop lag | polls | the big request (median) |",
        "|---|---:|---:|---:|---:|---:|---:|",
        *(f"| {name} | {ms(h['median'])} | {ms(h['p99'])} | {ms(h['max'])} | {ms(h['lag'])} | {h['polls']} | "
          f"{ms(h['request_s'])} |" for name, h in health.items()),
        "",
        f"Tokenized in full vs the previous path: worst `/health` {ms(full['max'])} vs {ms(prev['max'])}, worst "
        f"event-loop lag {ms(full['lag'])} vs {ms(prev['lag'])} ({prev['lag'] / full['lag']:.1f}x less), the "
        f"request {ms(full['request_s'])} vs {ms(prev['request_s'])}.",
        "",
        "Goals (issue #25): the first chunk before half the total; `/health` within 100 ms during the render.",
    ]) + "\n"  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--prompt-bytes", type=int, default=4 << 20)
    parser.add_argument("--health-repeats", type=int, default=5)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "chat_stream.md"))
    args = parser.parse_args()
    stream, health = asyncio.run(measure(args))
    text = report(stream, health, args)
    print(text)
    Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
