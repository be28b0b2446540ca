"""Continuous batching: which sequences run this step, how much of each prompt is prefilled, when one stops.

A sequence is `tokens` (prompt + generated) and `num_computed` (positions whose KV is in its cache slot). Each
step computes `tokens[num_computed:]` (or a chunk of it) and, at the end, samples from the last logits: a decode
is one uncomputed token, a prefill many, and recomputing after a weight swap is `num_computed = 0`.

`schedule()` admits waiting groups (all n samples at once, when n slots are free) in FIFO order and splits the
token budget: each decoding sequence gets its token first, prefills share the rest (long prompts are chunked).
The n samples of a request share one prefill, and so do requests for the same prompt (a GRPO group sent as n
episodes): one admitted while that prompt is prefilled waits for it, one admitted while a sequence holding it
runs copies its KV and computes only the last token. Plain Python: knows the cache manager, not tensors."""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from molt.engine.cache import SlotCacheManager
from molt.engine.interface import SamplingParams


@dataclass(eq=False)
class Group:
    """One request: n sequences sampling from one prompt; resolved when all have finished."""

    request_id: str
    prompt: list[int]
    sampling: SamplingParams
    seeds: list[int]
    on_done: Callable[[Group], None]
    stop_ids: frozenset[int] = frozenset()  # stop token ids in force (request's + eos unless ignored)
    submitted_at: float = 0.0
    seqs: list[Sequence] = field(default_factory=list)
    images: list | None = None  # uint8 pixel tensors of the prompt's images (VLM), in placeholder order

    @property
    def done(self) -> bool:
        return all(s.finish_reason is not None for s in self.seqs)


@dataclass(eq=False)
class Sequence:
    """One sample's evolving state."""

    seq_id: int
    group: Group
    sample_index: int
    tokens: list[int]
    num_prompt: int
    seed: int
    num_computed: int = 0
    num_cached: int = 0
    waits_for: Sequence | None = None  # a sequence whose first `wait_len` computed positions this one copies
    wait_len: int = 0
    stale: bool = False  # holds KV computed under replaced weights ("keep" swap): never shared with new requests
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    first_token_at: float | None = None
    routing: Any = None  # MoE: [len(tokens), layers, k] expert ids, read from the runner when it finishes


@dataclass
class Chunk:
    """Compute tokens[start:end] of `seq` this step; `samples` when end reaches the last token."""

    seq: Sequence
    start: int
    end: int

    @property
    def samples(self) -> bool:
        return self.end == len(self.seq.tokens)


@dataclass
class Plan:
    prefill: list[Chunk]
    decode: list[Sequence]  # ordered by slot


class Scheduler:
    """FIFO admission under slot capacity and a per-step token budget."""

    def __init__(self, manager: SlotCacheManager, max_num_batched_tokens: int = 2048):
        if max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
        self.manager, self.max_num_batched_tokens = manager, max_num_batched_tokens
        self.waiting: deque[Group] = deque()
        self.running: list[Sequence] = []  # sequences holding a slot
        self.owners: dict[tuple[int, ...], Sequence] = {}  # prompt -> a running sequence that computes/holds it
        self._ids = itertools.count()

    def add(self, group: Group) -> None:
        """Queue a request: creates its n sequences (they get slots when admitted)."""
        for i, seed in enumerate(group.seeds):
            group.seqs.append(Sequence(next(self._ids), group, i, list(group.prompt), len(group.prompt), seed))
        self.waiting.append(group)

    def has_work(self, admit: bool) -> bool:
        return bool(self.running) or (admit and bool(self.waiting))

    def schedule(self, admit: bool = True) -> Plan:
        """This step's chunks and decodes; admits waiting groups when `admit`."""
        decode, prefilling, prefill = [], [], []
        for seq in self.running:
            if seq.waits_for is None and (left := len(seq.tokens) - seq.num_computed):
                (decode if left == 1 else prefilling).append(seq)
        budget = self.max_num_batched_tokens - len(decode)
        for seq in prefilling:
            if budget <= 0:
                break
            prefill.append(self._chunk(seq, budget))
            budget -= prefill[-1].end - prefill[-1].start
        while admit and budget > 0 and self.waiting and self._fits(self.waiting[0]):
            leader = self._admit(self.waiting.popleft())
            if leader is not None:
                prefill.append(self._chunk(leader, budget))
                budget -= prefill[-1].end - prefill[-1].start
        decode.sort(key=lambda s: self.manager.slot_of(s.seq_id))
        return Plan(prefill, decode)

    def _fits(self, group: Group) -> bool:
        """Whether the cache can take the group now (a slot per sample; the paged scheduler also asks blocks)."""
        return self.manager.num_free() >= len(group.seqs)

    def _chunk(self, seq: Sequence, budget: int) -> Chunk:
        return Chunk(seq, seq.num_computed, min(len(seq.tokens), seq.num_computed + budget))

    def _admit(self, group: Group) -> Sequence | None:
        """Give the group's sequences slots; returns the one to prefill (None: it joins a pending prefill)."""
        # prefix reuse is keyed by token ids alone, so requests with images neither reuse nor leave KV
        key = None if group.images else tuple(group.prompt)
        owner = self.owners.get(key)
        leader, *siblings = group.seqs
        if owner is not None and owner.num_computed < len(owner.group.prompt):
            leader, siblings = owner, group.seqs  # wait for the pending prefill of the same prompt
        else:
            _, reused = self.manager.allocate(leader.seq_id, () if group.images else leader.tokens)
            live = len(leader.tokens) - 1 if owner is not None else 0
            if live > reused and self.manager.length_of(owner.seq_id) >= live:
                self.manager.share(owner.seq_id, leader.seq_id, live)  # a running copy of the prompt
                reused = live
            leader.num_computed = leader.num_cached = reused
            if key is not None:
                self.owners[key] = leader
        for seq in siblings:
            self.manager.allocate(seq.seq_id)
            seq.waits_for, seq.wait_len = leader, len(seq.tokens)
        self.running += group.seqs
        return None if leader not in group.seqs else leader

    def computed(self, chunk: Chunk) -> list[Sequence]:
        """Record a computed chunk; returns the sequences that sample from its last logits (leader first)."""
        seq = chunk.seq
        seq.num_computed = chunk.end
        self.manager.set_length(seq.seq_id, chunk.end)
        samplers = [seq] if chunk.samples else []
        for s in [s for s in self.running if s.waits_for is seq and s.wait_len <= chunk.end]:
            if s.wait_len == len(s.tokens):  # nothing left to compute: sample from these logits, if they are its own
                if chunk.samples and chunk.end == s.wait_len:
                    samplers.append(s)
                else:
                    s.wait_len -= 1  # the leader is past it: compute its last token itself
            self.manager.share(seq.seq_id, s.seq_id, s.wait_len)
            s.num_computed, s.num_cached, s.waits_for, s.stale = s.wait_len, s.wait_len, None, seq.stale
        return samplers

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None, cache: bool = True) -> None:
        """Mark `seq` finished and free its slot (keeping its KV as a cached prefix when `cache`)."""
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        self._disown(seq)
        if seq in self.running:
            self.running.remove(seq)
            self.manager.free(seq.seq_id, seq.tokens if cache and not seq.group.images and not seq.stale else None)

    def _disown(self, seq: Sequence) -> None:
        """`seq` stops: it no longer holds its prompt for others; if it was aborted while others waited
        for its prefill, the first of them prefills itself and leads the rest."""
        key = tuple(seq.group.prompt)
        if self.owners.get(key) is seq:
            del self.owners[key]
        waiting = [s for s in self.running if s.waits_for is seq and s.finish_reason is None]
        if waiting:
            heir = waiting[0]
            heir.waits_for, heir.num_computed, heir.stale = None, 0, False
            for s in waiting[1:]:
                s.waits_for = heir
            if not seq.group.images:
                self.owners[key] = heir

    def forget_computed_prompts(self) -> None:
        """New weights: KV computed under the old ones is never shared with new requests. A running sequence that
        keeps some (no recompute) is stale: it holds no prompt for others and leaves no cached prefix; so are the
        samples that copy its prompt later."""
        for seq in self.running:
            seq.stale |= seq.num_computed > 0
        self.owners = {k: s for k, s in self.owners.items() if not s.stale}  # a computed prompt is stale

    def remove_group(self, group: Group, reason: str) -> None:
        """Finish every unfinished sequence of `group` (abort / failure), waiting or running."""
        if group in self.waiting:
            self.waiting.remove(group)
        for seq in group.seqs:
            if seq.finish_reason is None:
                self.finish(seq, reason, cache=False)

    def restart_all(self) -> None:
        """Forget all computed KV (weights changed): every running sequence recomputes from position 0,
        the prompt once per distinct prompt (the others copy it, then compute their own tokens)."""
        self.manager.reset_lengths()
        self.manager.clear_prefixes()
        leaders: dict[tuple[int, ...], Sequence] = {}
        for seq in self.running:
            seq.num_computed, seq.stale = 0, False
            if seq.waits_for is not None or seq.group.images:
                continue
            leader = leaders.setdefault(tuple(seq.group.prompt), seq)
            if leader is not seq:
                seq.waits_for, seq.wait_len = leader, min(len(seq.group.prompt), len(seq.tokens) - 1)
