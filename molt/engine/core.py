"""The engine core: one synchronous step of continuous batching, plus the state it advances.

A step: schedule, apply pending cache moves, run ONE packed forward over every decoding row's token and the scheduled
prefill chunks, copy shared prompt prefixes to sibling samples, sample all rows at once, then append / stop / finish in
Python.

Single-threaded and free of asyncio: `TorchEngine` calls it from its worker thread. Requests enter as scheduler `Group`s
and leave through each group's `on_done` callback (a list of `Completion`s, or the exception that failed them). Knows
models, caches and sampling; nothing of agents or trainers."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import torch

from molt.engine.blocks import DEFAULT_BLOCK_SIZE, BlockManager, KVBudgetError
from molt.engine.cache import SlotCacheManager
from molt.engine.images import chunk_image_embeds
from molt.engine.interface import Completion, TokenDelta, Weights, find_stop_string
from molt.engine.paged import PagedRunner, PagedScheduler, PagedSlots
from molt.engine.runner import ModelRunner
from molt.engine.sampling import RowParams, TopLogprobs, sample, sample_top
from molt.engine.scheduler import Group, Scheduler
from molt.engine.scheduler import Sequence as Seq
from molt.engine.transfer import to_device
from molt.models.hf_io import load_weights
from molt.models.transformer import Transformer

log = logging.getLogger(__name__)


class EngineCore:
    """Scheduler + cache manager + model runner + sampler, advanced one step at a time."""

    def __init__(
        self,
        model: Transformer,
        *,
        tokenizer=None,
        num_slots: int,
        max_seq_len: int,
        max_num_batched_tokens: int,
        prefix_cache: bool,
        eos_token_ids: Sequence[int],
        version: int = 0,
        record_routing: bool = True,
        compile: bool = False,
        kv_blocks: int | None = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
        graphs: bool | None = None,
    ):
        self.model, self.tokenizer, self.version, self.max_seq_len = model, tokenizer, version, max_seq_len
        self.eos_token_ids = frozenset(eos_token_ids)
        if kv_blocks is not None:  # the paged KV cache (paged.py); otherwise the slot cache
            if compile:
                raise ValueError("compile=True is the slot cache's decode step; the paged cache replays CUDA graphs")
            if kv_blocks * block_size < max_seq_len:  # a lone sequence must always fit, or preemption could not help
                raise KVBudgetError(f"{kv_blocks} KV blocks of {block_size} positions hold less than one sequence "
                                    f"of {max_seq_len} positions")  # fmt: skip
            max_blocks = -(-max_seq_len // block_size)
            self.manager = PagedSlots(BlockManager(kv_blocks, block_size, prefix_cache), num_slots, max_blocks)
            self.runner = PagedRunner(model, self.manager, graphs)
            self.scheduler = PagedScheduler(self.manager, max_num_batched_tokens)
        else:
            self.runner = ModelRunner(model, num_slots, max_seq_len, record_routing, compile)
            # Molt's attention kernel takes each row's slot: no compaction moves (torch ops want rows 0..B-1)
            self.manager = SlotCacheManager(num_slots, max_seq_len, prefix_cache, compact=not self.runner.own_attention)
            self.scheduler = Scheduler(self.manager, max_num_batched_tokens)
        self.groups: dict[str, Group] = {}
        self.listeners: dict[str, Callable[[list[TokenDelta]], None]] = {}  # streamed requests
        self.tops: dict[str, list[list[TopLogprobs]]] = {}  # per sample, of requests asking for top_logprobs
        self.num_pending = 0
        counters = ("steps", "decode_steps", "decode_only_steps", "prefill_tokens", "decode_tokens", "step_errors")
        self.stats = dict.fromkeys(counters, 0) | dict(busy_s=0.0, decode_s=0.0)

    def add(self, group: Group, on_tokens: Callable[[list[TokenDelta]], None] | None = None) -> None:
        """Queue a request; `on_tokens` (streaming) gets a `TokenDelta` per sample after each step that sampled its
        next token, always before `group.on_done`."""
        if group.request_id in self.groups:
            group.on_done(ValueError(f"request_id {group.request_id!r} is already in flight"))
            return
        self.groups[group.request_id] = group
        if on_tokens is not None:
            self.listeners[group.request_id] = on_tokens
        if group.sampling.top_logprobs > 0:
            self.tops[group.request_id] = [[] for _ in range(group.sampling.n)]
        self.num_pending += group.sampling.n
        self.scheduler.add(group)

    def abort(self, request_id: str) -> bool:
        group = self.groups.get(request_id)
        if group is None:
            return False
        self.scheduler.remove_group(group, "abort")
        self._complete(group)
        return True

    def swap_weights(self, weights: Weights, version: int, recompute: bool) -> None:
        """Load weights in place and set the version; `recompute` redoes the KV of running sequences, else the
        old KV they keep is never handed to new requests (`Scheduler.forget_computed_prompts`)."""
        load_weights(self.model, weights)
        self.version = version
        if recompute:
            self.scheduler.restart_all()
        self.manager.clear_prefixes()
        self.scheduler.forget_computed_prompts()

    def step_safely(self, admit: bool = True) -> None:
        """One step; a failure fails the requests that were running, never the engine."""
        t0, decode_only = time.perf_counter(), False
        try:
            decode_only = self.step(admit)
        except Exception as e:
            log.exception("engine step failed; failing the running requests")
            self.stats["step_errors"] += 1
            for group in list(self.groups.values()):
                if any(s in self.scheduler.running for s in group.seqs):
                    self.scheduler.remove_group(group, "abort")
                    self._forget(group)
                    group.on_done(e)
        finally:
            elapsed = time.perf_counter() - t0
            self.stats["busy_s"] += elapsed
            self.stats["decode_s"] += elapsed if decode_only else 0.0
            self.stats["decode_only_steps"] += decode_only

    def step(self, admit: bool = True) -> bool:
        """Schedule, compute and sample one step; True if it only decoded (no prompt chunk)."""
        plan = self.scheduler.schedule(admit)
        self.runner.apply_moves(self.manager.take_moves())
        slot_of = self.manager.slot_of
        for seq in plan.decode:
            seq.num_computed = len(seq.tokens)
        decode = [(slot_of(s.seq_id), s.tokens[-1], s.num_computed - 1) for s in plan.decode]
        chunks = [(slot_of(c.seq.seq_id), c.seq.tokens[c.start : c.end], c.start) for c in plan.prefill]
        sampled_chunks = [i for i, c in enumerate(plan.prefill) if c.samples]
        self.stats["decode_tokens"] += len(decode)
        self.stats["decode_steps"] += bool(decode)
        self.stats["steps"] += 1
        if not decode and not chunks:
            return False
        decode_only = not chunks
        images = None
        if self.model.vision is not None:
            images = chunk_image_embeds(
                self.model, [(c.seq.tokens, c.start, c.end, c.seq.group.images) for c in plan.prefill]
            )
        logits_rv = self.runner.forward(decode, chunks, sampled_chunks, images)  # decode rows, then sampling chunks
        for seq in plan.decode:  # only now: a block this fills is then a prefix others may reuse, so it must hold KV
            self.manager.set_length(seq.seq_id, seq.num_computed)
        rows: list[Seq] = list(plan.decode)
        picks = list(range(len(rows)))  # logits row of each sampled row
        for chunk in plan.prefill:
            samplers = self.scheduler.computed(chunk)  # the leader, then the siblings sharing its prompt
            picks += [picks[-1] + 1 if picks else 0] * len(samplers)
            rows += samplers
            self.stats["prefill_tokens"] += chunk.end - chunk.start
        self.runner.apply_moves(self.manager.take_moves())  # prompt KV shared with sibling samples
        if not rows:
            return decode_only
        with torch.inference_mode():
            if len(picks) > logits_rv.shape[0]:  # n > 1: siblings sample from their leader's logits
                logits_rv = logits_rv.index_select(0, to_device(picks, torch.long, logits_rv.device))
            if self.tops:  # only while a request asks for top_logprobs
                token_ids, logprobs = self._sample_with_tops(logits_rv, rows)
            else:
                token_ids, logprobs = sample(logits_rv, self._row_params(rows))
        ends = [self._append(seq, t, lp) for seq, t, lp in zip(rows, token_ids, logprobs, strict=True)]
        done = [(seq, end) for seq, end in zip(rows, ends, strict=True) if end]
        if self.listeners:
            self._notify_tokens(rows, token_ids, logprobs)
        # highest slot first: each freed slot is then the last active one, so the cache manager moves nothing
        for seq, (reason, stop_reason) in sorted(done, key=lambda d: -self.manager.slot_of(d[0].seq_id, -1)):
            self._finish(seq, reason, stop_reason)
        return decode_only

    def _sample_with_tops(self, logits_rv: torch.Tensor, rows: list[Seq]) -> tuple[list[int], list[float]]:
        """`sample`, recording each asking row's top_logprobs (one device -> host copy, as always)."""
        ks = [s.group.sampling.top_logprobs if s.group.request_id in self.tops else 0 for s in rows]
        token_ids, logprobs, tops = sample_top(logits_rv, self._row_params(rows), max(ks))
        for seq, k, top in zip(rows, ks, tops, strict=True):
            if k:
                self.tops[seq.group.request_id][seq.sample_index].append(top[:k])
        return token_ids, logprobs

    def _notify_tokens(self, rows: list[Seq], token_ids: list[int], logprobs: list[float]) -> None:
        """One call per streamed request with the tokens this step sampled for it (and their alternatives)."""
        batches: dict[str, list[TokenDelta]] = {}
        for seq, t, lp in zip(rows, token_ids, logprobs, strict=True):
            request_id = seq.group.request_id
            if request_id in self.listeners:
                tops = self.tops.get(request_id)  # this step's alternatives are the last recorded
                top = [tops[seq.sample_index][-1]] if tops is not None else None
                batches.setdefault(request_id, []).append(TokenDelta(seq.sample_index, [t], [lp], top))
        for request_id, batch in batches.items():
            self.listeners[request_id](batch)

    def _row_params(self, rows: list[Seq]) -> RowParams:
        sps = [s.group.sampling for s in rows]
        banned = [  # stop ids before min_tokens
            (r, tuple(s.group.stop_ids))
            for r, (s, sp) in enumerate(zip(rows, sps, strict=True))
            if sp.min_tokens and len(s.tokens) - s.num_prompt < sp.min_tokens and s.group.stop_ids
        ]
        image_id = self.model.cfg.image_token_id
        if image_id is not None:  # a VLM never samples its image placeholder (a generated one would have no image)
            banned += [(r, (image_id,)) for r in range(len(rows))]
        return RowParams(
            temperature=[sp.temperature for sp in sps],
            top_p=[sp.top_p for sp in sps],
            top_k=[max(sp.top_k, 0) for sp in sps],
            seed=[s.seed for s in rows],
            position=[len(s.tokens) for s in rows],
            processed=[sp.logprob_mode == "processed" for sp in sps],
            banned=banned,
        )

    def _append(self, seq: Seq, token: int, logprob: float) -> tuple[str, int | str | None] | None:
        """Record a sampled token; returns (finish reason, stop reason) when `seq` ends with it."""
        tokens, sp = seq.tokens, seq.group.sampling
        tokens.append(token)
        seq.logprobs.append(logprob)
        seq.versions.append(self.version)
        if seq.first_token_at is None:
            seq.first_token_at = time.perf_counter()
        num_generated = len(tokens) - seq.num_prompt
        if num_generated >= sp.min_tokens:
            hit = token in seq.group.stop_ids
            reason = token if hit else find_stop_string(self.tokenizer, sp.stop, tokens, seq.num_prompt)
            if reason is not None:
                return "stop", reason
        if num_generated >= sp.max_tokens or len(tokens) >= self.max_seq_len:
            return "length", None
        return None

    def _finish(self, seq: Seq, reason: str, stop_reason: int | str | None = None) -> None:
        if self.runner.routes is not None:  # read before the slot is freed (MoE routing capture)
            self.runner.apply_moves(self.manager.take_moves())  # a finish this step may have moved it
            seq.routing = self.runner.read_routing(self.manager.slot_of(seq.seq_id), seq.num_computed, len(seq.tokens))
        self.scheduler.finish(seq, reason, stop_reason)
        if seq.group.done:
            self._complete(seq.group)

    def _forget(self, group: Group) -> list[list[TopLogprobs]] | None:
        """Drop a finished or failed request's state; returns its samples' top_logprobs (None if not asked for)."""
        self.groups.pop(group.request_id, None)
        self.listeners.pop(group.request_id, None)
        self.num_pending -= group.sampling.n
        return self.tops.pop(group.request_id, None)

    def _complete(self, group: Group) -> None:
        tops = self._forget(group)
        now = time.perf_counter()
        group.on_done([_completion(group, seq, now, tops[seq.sample_index] if tops else None) for seq in group.seqs])


def _completion(group: Group, seq: Seq, now: float, tops: list[TopLogprobs] | None) -> Completion:
    return Completion(
        request_id=group.request_id,
        token_ids=seq.tokens[seq.num_prompt :],
        logprobs=list(seq.logprobs),
        versions=list(seq.versions),
        finish_reason=seq.finish_reason,
        num_prompt_tokens=seq.num_prompt,
        sample_index=seq.sample_index,
        stop_reason=seq.stop_reason,
        num_cached_tokens=seq.num_cached,
        routing=seq.routing,
        top_logprobs=tops,
        metrics=dict(ttft_s=(seq.first_token_at or now) - group.submitted_at, latency_s=now - group.submitted_at),
    )
