"""`molt serve <checkpoint>`: the chat server over a checkpoint, with no training session.

Every request to `/v1/chat/completions` or `/v1/messages` runs in its own implicit session (nothing
is recorded); the request's `temperature` / `top_p` are honoured, unlike in training sessions.
The checkpoint is a Hugging Face model folder or a run directory (its latest checkpoint). This command
assembles the model, an engine from the one factory (32 sequences of `chat.max_len`) and the server.
"""

from __future__ import annotations

import asyncio
import contextlib

import torch

from molt.agents.chat.agent import CHAT_SERVER_OPTIONS
from molt.agents.chat.server import ChatServer
from molt.cli.build import build_model, build_tokenizer
from molt.config import Config
from molt.engine.interface import SamplingParams
from molt.runtime.factory import build_engine


def build_server(cfg: Config) -> ChatServer:
    """Model, engine and a serve-mode ChatServer (not started); `parse_command` checked the config's user code."""
    tokenizer = build_tokenizer(cfg.model)
    model = build_model(cfg.model, tokenizer, cfg.train.seed, cfg.runtime.device)
    chat = cfg.chat
    threads = cfg.runtime.threads or torch.get_num_threads()
    engine = build_engine(cfg, model, tokenizer, threads=threads, owned=True, num_slots=32, max_len=chat.max_len)
    stop = tuple(t for t in {tokenizer.eos_token_id} if t is not None)
    sampling = SamplingParams(
        temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p, max_tokens=chat.max_tokens, stop_token_ids=stop
    )
    options = {k: getattr(chat, k) for k in CHAT_SERVER_OPTIONS}  # as in training, plus serve's own settings
    return ChatServer(engine, tokenizer, api_key=chat.api_key, serve_sampling=sampling, serve_max_len=chat.max_len,
                      **options)  # fmt: skip


async def _serve(cfg: Config) -> None:
    server = build_server(cfg)
    await server.start()
    source = cfg.model.path or f"preset {cfg.model.preset!r} with random weights"
    print(f"molt serve: {source} at {server.url}  (OpenAI: {server.url}/v1, Anthropic: {server.url})", flush=True)
    try:
        await server._task  # noqa: SLF001 - serve until interrupted
    finally:
        await server.stop()
        await server.engine.close()


def run_serve(cfg: Config) -> None:
    """The `molt serve` command (Ctrl+C stops it)."""
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve(cfg))
