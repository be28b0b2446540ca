"""Overhead of the chat server: OpenAI SDK -> HTTP -> session capture -> engine, vs calling the engine directly.

Baseline (measured in the same run, same engine): each session runs a 3-turn conversation by
calling `TorchEngine.generate` on the accumulated ids itself (first prompt rendered with the chat
template, each later turn appending the template delta, as `run_episode` does). HTTP path: the
same conversations through `AsyncOpenAI` clients against `ChatServer` on the same event loop,
one session per conversation. Every turn generates exactly `--tokens` tokens (ignore_eos), so both
paths do the same engine work. Reported: generated tokens/s of all sessions together, the ratio
HTTP / direct and the throughput loss, at 1, 16 and 64 concurrent sessions (best of `--repeats`,
paths interleaved).

Run: `.venv/bin/python benchmarks/chat_server.py [--quick] [--out FILE]` (writes benchmarks/results/chat_server.md,
or FILE; `--quick` writes only with `--out`).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import sys
import time
from pathlib import Path

import torch
from openai import AsyncOpenAI

from molt.agents.chat.server import ChatServer
from molt.agents.runner import emitted_markup, observation_ids
from molt.engine import SamplingParams, TorchEngine
from molt.models import Transformer, preset
from molt.models.tokenizer import apply_chat_template, build_builtin_tokenizer

TURNS = 3


def question(i: int, turn: int) -> list[dict]:
    return [{"role": "user", "content": f"Session {i}, turn {turn}: what is {17 * i + turn} times 3?"}]


async def direct_conversation(engine, tok, sampling: SamplingParams, i: int) -> int:
    messages = question(i, 0)
    ids = apply_chat_template(tok, messages, add_generation_prompt=True)
    generated = 0
    for turn in range(TURNS):
        completion = await engine.generate(ids, sampling)
        generated += len(completion.token_ids)
        ids = ids + list(completion.token_ids)
        if turn + 1 < TURNS:
            new = question(i, turn + 1)
            ids += observation_ids(tok, messages, new, emitted_markup(tok, completion.token_ids))
            messages = messages + [{"role": "assistant", "content": tok.decode(completion.token_ids)}] + new
    return generated


async def http_conversation(client: AsyncOpenAI, i: int) -> int:
    messages, generated = question(i, 0), 0
    for turn in range(TURNS):
        reply = await client.chat.completions.create(model="molt", messages=messages)
        generated += reply.usage.completion_tokens
        messages = messages + [{"role": "assistant", "content": reply.choices[0].message.content}]
        messages += question(i, turn + 1)
    return generated


async def measure(engine, tok, server: ChatServer, sampling: SamplingParams, n: int, repeats: int) -> tuple:
    best = {"direct": 0.0, "http": 0.0}
    # untimed: the conversations' prefixes are cached before either side is timed (the first timed pass filled the
    # cache for the other: a one-repeat run favoured HTTP, up to 1.57x at one session)
    await asyncio.gather(*(direct_conversation(engine, tok, sampling, i) for i in range(n)))
    for _ in range(repeats):
        t0 = time.perf_counter()
        tokens = sum(await asyncio.gather(*(direct_conversation(engine, tok, sampling, i) for i in range(n))))
        best["direct"] = max(best["direct"], tokens / (time.perf_counter() - t0))
        sessions = [server.open_session(sampling, max_len=4096) for _ in range(n)]
        clients = [AsyncOpenAI(base_url=f"{server.url}/s/{s.id}/v1", api_key="bench", max_retries=0) for s in sessions]
        t0 = time.perf_counter()
        tokens = sum(await asyncio.gather(*(http_conversation(c, i) for i, c in enumerate(clients))))
        best["http"] = max(best["http"], tokens / (time.perf_counter() - t0))
        for session, client in zip(sessions, clients, strict=True):
            server.close_session(session.id)
            await client.close()
    return best["direct"], best["http"]


async def main(args) -> list[tuple]:
    tok = build_builtin_tokenizer()
    arch = preset(args.preset, vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model = Transformer(arch).init_weights(0.02, torch.Generator().manual_seed(0)).eval()
    engine = TorchEngine(model, tokenizer=tok, num_slots=max(args.sessions), max_seq_len=1024)
    sampling = SamplingParams(temperature=1.0, max_tokens=args.tokens, ignore_eos=True, seed=0)
    server = await ChatServer(engine, tok, api_key="bench").start()
    rows = []
    try:
        await measure(engine, tok, server, sampling, 4, 1)  # warm up both paths
        for n in args.sessions:
            direct, http = await measure(engine, tok, server, sampling, n, args.repeats)
            rows.append((n, direct, http))
            print(f"{n:>3} sessions: direct {direct:8.0f} tok/s  http {http:8.0f} tok/s  ratio {http / direct:.3f}")
    finally:
        await server.stop()
        await engine.close()
    return rows


def report(rows: list[tuple], args) -> str:
    lines = [
        "# Chat server overhead: OpenAI SDK over HTTP vs the engine called directly",
        "",
        f"`benchmarks/chat_server.py{' --quick' if args.quick else ''}`: `{args.preset}` preset (random weights, fp32, "
        f"built-in byte tokenizer), {TURNS}-turn conversations, {args.tokens} generated tokens per turn (ignore_eos), "
        f"one session per conversation, best of {args.repeats}. Machine: {platform.machine()}, "
        f"{os.cpu_count()} CPUs, torch {torch.__version__}, {torch.get_num_threads()} threads.",
        "",
        "| sessions | direct tok/s | HTTP tok/s | HTTP / direct | throughput loss |",
        "|---:|---:|---:|---:|---:|",
    ]
    for n, direct, http in rows:
        lines.append(f"| {n} | {direct:.0f} | {http:.0f} | {http / direct:.3f} | {max(0.0, 1 - http / direct):.1%} |")
    lines += [
        "",
        "Goal: <= 15% throughput loss at 16 sessions. Both paths share one event loop and engine; on a small shared",
        "machine single rows vary by ~10% run to run (a ratio above 1 is such noise), so compare repeated runs.",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 repeat, 16 tokens per turn")
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--sessions", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--out", default="", help="report file (default results/chat_server.md; --quick: only here)")
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.tokens = 1, 16
    rows = asyncio.run(main(args))
    text = report(rows, args)
    print(text)
    if args.out or not args.quick:  # a quick run leaves the committed results alone
        out = Path(args.out or Path(__file__).parent / "results" / "chat_server.md")
        out.write_text(text)
        print(f"wrote {out}", file=sys.stderr)
