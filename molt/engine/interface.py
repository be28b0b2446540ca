"""The one async rollout-engine interface: request/response types and the abstract `Engine`.

Everything above the engine (agent runners, the loop, the chat server) talks to this and only this. It is token-first:
prompts are token ids and completions are the exact ids the engine sampled, each with its log-prob and the weight
version that sampled it. Knows nothing of models, caches, agents or trainers."""

from __future__ import annotations

import abc
import asyncio
import itertools
import math
import operator
import os
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal, TypeVar

import torch

_REQUEST_PREFIX, _REQUEST_COUNTER = uuid.uuid4().hex[:12], itertools.count()


def _new_request_prefix() -> None:
    global _REQUEST_PREFIX
    _REQUEST_PREFIX = uuid.uuid4().hex[:12]


os.register_at_fork(after_in_child=_new_request_prefix)  # a forked child must not repeat its parent's ids


def new_request_id() -> str:
    """An id unique across processes: a random per-process prefix and a counter (cheaper than a uuid4 per request,
    which pays `os.urandom` on the event loop)."""
    return f"{_REQUEST_PREFIX}-{next(_REQUEST_COUNTER)}"


FinishReason = Literal["stop", "length", "abort"]
SyncMode = Literal["drain", "interrupt"]
LogprobMode = Literal["scaled", "processed"]
Weights = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]
R = TypeVar("R")
MIN_TEMPERATURE = 1e-4  # a smaller one scales logits past fp32's range (inf - inf = NaN): use 0 for greedy


class ContextLengthError(ValueError):
    """The request cannot fit the engine's context (prompt too long, or no room for one token)."""


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request.

    Log-probs (`logprob_mode`) of each sampled token are reported under:

    - `"scaled"` (default): `log_softmax(logits / temperature)` over the whole vocabulary, i.e. the
      exact function the trainer computes (temperature 0 counts as 1). top-k / top-p / min_tokens
      restrict where the token is drawn from but do not renormalise this number.
    - `"processed"`: the distribution actually sampled from: temperature applied, tokens outside
      top-k / top-p (and stop tokens banned by min_tokens) removed, renormalised. Greedy gives 0.

    `top_logprobs` > 0 also reports, per generated token, that many most likely tokens with their log-probs
    under the "scaled" distribution (`Completion.top_logprobs`); 0 (default) computes none."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1): off
    max_tokens: int = 256
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()  # stop strings, matched on the decoded completion (needs a tokenizer)
    ignore_eos: bool = False
    seed: int | None = None
    logprob_mode: LogprobMode = "scaled"
    top_logprobs: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        object.__setattr__(self, "stop", (self.stop,) if isinstance(self.stop, str) else tuple(self.stop))
        problems = [
            msg
            for bad, msg in [
                (self.n < 1, f"n must be >= 1, got {self.n}"),
                (
                    not (self.temperature == 0 or MIN_TEMPERATURE <= self.temperature < math.inf),
                    f"temperature must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE}, got {self.temperature}",
                ),
                (not 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
                (self.top_k < -1, f"top_k must be >= 0 (0 or -1: off), got {self.top_k}"),
                (self.max_tokens < 1, f"max_tokens must be >= 1, got {self.max_tokens}"),
                (not 0 <= self.min_tokens <= self.max_tokens, "min_tokens must be in [0, max_tokens]"),
                (self.logprob_mode not in ("scaled", "processed"), f"unknown logprob_mode {self.logprob_mode!r}"),
                (any(not s for s in self.stop), "stop strings must be non-empty"),
                (self.top_logprobs < 0, f"top_logprobs must be >= 0, got {self.top_logprobs}"),
            ]
            if bad
        ]
        if problems:
            raise ValueError("SamplingParams: " + "; ".join(problems))


@dataclass
class Completion:
    """One sample: the exact generated ids, their log-probs and the versions that sampled them."""

    request_id: str
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: FinishReason
    num_prompt_tokens: int
    sample_index: int = 0
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    num_cached_tokens: int = 0  # prompt positions whose KV was reused rather than computed
    metrics: dict[str, float] = field(default_factory=dict)
    # MoE engines that capture routing: int tensor [num_prompt + num_generated, MoE layers, k] of the
    # experts each position was computed with, by absolute position; -1 where none was recorded
    routing: torch.Tensor | None = None
    # sampling.top_logprobs > 0: per generated token, the most likely (token id, log-prob) pairs, best first
    top_logprobs: list[list[tuple[int, float]]] | None = None


@dataclass
class TokenDelta:
    """Tokens one sample appended since its previous delta (`Engine.generate_streamed`)."""

    sample_index: int
    token_ids: list[int]
    logprobs: list[float]
    # sampling.top_logprobs > 0: per token, as `Completion.top_logprobs`; None from engines that stream none
    top_logprobs: list[list[tuple[int, float]]] | None = None


def work_since(now: Mapping[str, float], last: Mapping[str, float]) -> dict[str, float]:
    """Engine work between two snapshots of `Engine.stats`: seconds in model steps (`busy_s`), of which in
    decode-only steps (`decode_s`: no prompt or observation token computed), and mean rows per decoding step
    (`decode_batch_mean`, 0 without decoding). A restarted engine's counts start again."""
    if not last or now["steps"] < last["steps"]:
        last = dict.fromkeys(now, 0)
    decode_steps = now["decode_steps"] - last["decode_steps"]
    return {
        "busy_s": now["busy_s"] - last["busy_s"],
        "decode_s": now["decode_s"] - last["decode_s"],
        "decode_batch_mean": (now["decode_tokens"] - last["decode_tokens"]) / max(decode_steps, 1),
    }


def check_prompt(
    prompt_token_ids: Sequence[int], sampling: SamplingParams, max_len: int, limit_name: str, tokenizer
) -> list[int]:
    """The prompt as ints, checked for what every engine needs: not empty, room for one generated token within
    `max_len` (else a `ContextLengthError` naming the engine's `limit_name`), a tokenizer for stop strings."""
    try:
        prompt = [operator.index(t) for t in prompt_token_ids]  # ints (numpy's and torch's too); 1.5 is no token id
    except TypeError:
        kinds = sorted({type(t).__name__ for t in prompt_token_ids})
        mapping = isinstance(prompt_token_ids, Mapping)  # `apply_chat_template`'s BatchEncoding
        hint = "; a tokenizer's output (a mapping): pass its ['input_ids']" if mapping else ""
        raise ValueError(f"prompt_token_ids must be integers, got {', '.join(kinds)}{hint}") from None
    if not prompt:
        raise ValueError("prompt_token_ids is empty")
    if len(prompt) >= max_len:
        raise ContextLengthError(
            f"prompt has {len(prompt)} tokens but the engine's context is {limit_name}={max_len} "
            "tokens, and at least one generated token must fit"
        )
    if sampling.stop and tokenizer is None:
        raise ValueError("stop strings need a tokenizer: pass tokenizer= to the engine")
    return prompt


def find_stop_string(tokenizer, stops: Sequence[str], tokens: Sequence[int], start: int = 0) -> str | None:
    """The first of `stops` that ends in the text of the newest token of `tokens[start:]`, decoded over a tail
    window long enough for any, else None. Called after each token: an occurrence ending earlier was seen then
    (or ignored there, before min_tokens)."""
    if not stops or len(tokens) <= start:
        return None
    window = 2 * max(len(s.encode()) for s in stops) + 4  # in tokens: one holds one UTF-8 byte at least
    ids = tokens[max(start, len(tokens) - window) :]
    text = tokenizer.decode(ids)
    new = len(os.path.commonprefix([text, tokenizer.decode(ids[:-1])]))  # text[new:] came with the newest token
    return next((s for s in stops if s in text[max(0, new - len(s) + 1) :]), None)


def eos_ids(stop_ids: Sequence[int], tokenizer) -> list[int]:
    """A model config's stop ids (`TransformerConfig.stop_ids()`) and the tokenizer's eos id, if any."""
    eos = list(stop_ids)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        eos.append(tokenizer.eos_token_id)
    return eos


class Engine(abc.ABC):
    """An asynchronous, versioned rollout engine shared by many concurrent callers."""

    version: int = 0
    vision = None  # the policy's VisionConfig (VLMs): image size and tokens per image
    image_token_id: int | None = None
    # What an engine can report, with defaults: cumulative work counters (`busy_s`, `decode_s`, `steps`,
    # `decode_steps`, `decode_tokens`; differences by `work_since`) for engines that count their work
    stats: Mapping[str, float] = MappingProxyType({})

    async def run_on_engine_thread(self, fn: Callable[..., R], *args) -> R:
        """`fn(*args)` where this engine wants the process's other model compute (the trainer step) to run.

        The built-in engine runs it on its own thread between two steps (one OpenMP pool per process); the
        default is a worker thread."""
        return await asyncio.to_thread(fn, *args)

    async def generate(
        self,
        prompt_token_ids: Sequence[int],
        sampling: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        session_id: str | None = None,
        images: Sequence[torch.Tensor] | None = None,
    ) -> Completion:
        """One completion of `prompt_token_ids` (sampling.n must be 1; see `generate_group`)."""
        sampling = sampling or SamplingParams()
        if sampling.n != 1:
            raise ValueError(f"generate() returns one completion; use generate_group() for n={sampling.n}")
        kw = {"images": images} if images else {}  # engines without image support need not take the argument
        (completion,) = await self.generate_group(
            prompt_token_ids, sampling, request_id=request_id, session_id=session_id, **kw
        )
        return completion

    @abc.abstractmethod
    async def generate_group(
        self,
        prompt_token_ids: Sequence[int],
        sampling: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        session_id: str | None = None,
        images: Sequence[torch.Tensor] | None = None,
    ) -> list[Completion]:
        """`sampling.n` completions of one prompt, sharing its prefill; in sample order.

        `images` (VLMs): uint8 pixel tensors [3, S, S], one per image placeholder run in the prompt, in order."""

    async def generate_streamed(
        self,
        prompt_token_ids: Sequence[int],
        sampling: SamplingParams | None,
        on_tokens: Callable[[TokenDelta], None],
        *,
        request_id: str | None = None,
        session_id: str | None = None,
        images: Sequence[torch.Tensor] | None = None,
    ) -> list[Completion]:
        """`generate_group`, calling `on_tokens` (on the caller's event loop) as samples grow; every delta arrives
        before the call returns, and a sample's deltas concatenate to its completion's ids. Cancelling the call aborts
        the request. Default, for engines that cannot stream: one delta per sample once the whole group is done."""
        kw = {"images": images} if images else {}
        completions = await self.generate_group(
            prompt_token_ids, sampling, request_id=request_id, session_id=session_id, **kw
        )
        for c in completions:
            on_tokens(TokenDelta(c.sample_index, list(c.token_ids), list(c.logprobs), c.top_logprobs))
        return completions

    @abc.abstractmethod
    async def abort(self, request_id: str) -> bool:
        """Stop a request; its completions finish with reason "abort". False if it was not found."""

    @abc.abstractmethod
    async def update_weights(self, weights: Weights, version: int, mode: SyncMode = "interrupt") -> None:
        """Load new weights (Molt or HF names) in place and set `version`.

        `drain`: finish the requests already running (new ones wait), then swap. `interrupt`: stop at
        a token boundary, swap, continue the same requests; later tokens carry `version`."""

    @abc.abstractmethod
    async def pause(self) -> None:
        """Stop generating at the next token boundary; requests stay queued and cached."""

    @abc.abstractmethod
    async def resume(self) -> None:
        """Continue after `pause`."""

    @abc.abstractmethod
    def num_pending(self) -> int:
        """Sequences running or waiting (the router's load measure)."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources; pending requests are aborted."""
