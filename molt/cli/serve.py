"""`molt serve <checkpoint>`: the chat server over a checkpoint, with no training session.

Every request to `/v1/chat/completions` or `/v1/messages` runs in its own implicit session (nothing
is recorded); the request's `temperature` / `top_p` are honoured, unlike in training sessions.
The checkpoint is a Hugging Face model folder or a run directory (its latest checkpoint). This command
assembles the model, an engine from the one factory (32 sequences of `chat.max_len`) and the server."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import signal
import sys

import torch

from molt.agents.chat.server import ChatServer
from molt.cli.build import build_policy
from molt.config import Config, check
from molt.config.base import changed
from molt.engine.interface import SamplingParams
from molt.loop.evaluate import chat_options
from molt.runtime.factory import build_engine

GRACE_S = 3.0  # after SIGINT / SIGTERM: how long requests in flight have to finish before their generations end
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def build_server(cfg: Config) -> ChatServer:
    """Model, engine and a serve-mode ChatServer (not started); `parse_command` checked the config's user code."""
    chat, context = cfg.chat, cfg.model.architecture().context_length()
    if not changed(chat, "max_len"):  # the default: within the model's context
        chat = dataclasses.replace(chat, max_len=min(chat.max_len, context))
    check(chat.max_len <= context, "chat.max_len", f"({chat.max_len}) is over the model's context ({context} "
          "positions: max_position_embeddings, with RoPE scaling)")  # fmt: skip
    tokenizer, model = build_policy(cfg)
    threads = cfg.runtime.threads or torch.get_num_threads()
    engine = build_engine(cfg, model, tokenizer, threads=threads, owned=True, num_slots=32, max_len=chat.max_len)
    stop = tuple(t for t in {tokenizer.eos_token_id} if t is not None)
    ro = cfg.rollout  # a request's own temperature / top_p / top_k override these
    sampling = SamplingParams(temperature=ro.temperature, top_p=ro.top_p, top_k=ro.top_k, max_tokens=chat.max_tokens,
                              stop_token_ids=stop)  # fmt: skip
    options = chat_options(cfg)  # as in training, plus serve's own settings
    return ChatServer(engine, tokenizer, serve_sampling=sampling, serve_max_len=chat.max_len, **options)


async def _serve(cfg: Config) -> signal.Signals | None:
    """Serve until SIGINT or SIGTERM, then stop gracefully: no new connections, `GRACE_S` for the requests in
    flight, then the engine is closed, which ends the rest (a second signal: at once; a third is not caught).
    Returns the signal."""
    server = build_server(cfg)
    await server.start()
    source = cfg.model.path or f"preset {cfg.model.preset!r} with random weights"
    print(f"molt serve: {source} at {server.url}  (OpenAI: {server.url}/v1, Anthropic: {server.url})", flush=True)
    loop, signalled = asyncio.get_running_loop(), asyncio.get_running_loop().create_future()
    close_engine = functools.cache(lambda: asyncio.ensure_future(server.engine.close()))  # once, however asked

    def on_signal(sig: signal.Signals) -> None:
        if not signalled.done():
            signalled.set_result(sig)
            return
        close_engine()
        for each in STOP_SIGNALS:
            loop.remove_signal_handler(each)

    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        await asyncio.wait([server._task, signalled], return_when=asyncio.FIRST_COMPLETED)  # noqa: SLF001
        if not signalled.done():
            server._task.result()  # noqa: SLF001 - uvicorn stopped on its own: its error
    finally:
        await server.stop(GRACE_S, abort=close_engine)
    return signalled.result() if signalled.done() else None


def run_serve(cfg: Config) -> None:
    """The `molt serve` command. SIGINT (Ctrl+C) and SIGTERM stop it gracefully with one line; exit code 130 after
    SIGINT (as `molt train`), 0 after SIGTERM (a service manager's normal stop). Before serving starts (or a third
    Ctrl+C) they stop it as they stop any command (`molt.cli.main`)."""
    sig = asyncio.run(_serve(cfg))
    print(f"molt serve: stopped ({sig.name if sig else 'server exited'})", file=sys.stderr, flush=True)
    if sig == signal.SIGINT:
        raise SystemExit(130)
