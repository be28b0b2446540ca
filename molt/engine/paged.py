"""The paged KV cache in the engine: block-table bookkeeping behind the scheduler, preemption, a paged runner.

Opt-in (`TorchEngine(kv_blocks=...)`, a byte budget or a fraction of free CUDA memory): the cache is
`[layers, num_blocks, kv_heads, block_size, head_dim]` and each sequence's positions live in the blocks of its
block table (`blocks.BlockManager`), so memory follows the tokens in flight.

- `PagedSlots`: the slot cache manager's interface over a `BlockManager`. A "slot" is only a handle (it caps
  concurrency and orders decode rows); `share` is a `fork`, whose block copies are the step's moves.
- `PagedScheduler` reserves every running sequence's positions before each step; out of blocks, it preempts
  the latest admitted sequence (blocks freed, tokens kept) and readmits it first, recomputing what prefix
  hits do not cover. Admission waits for blocks as well as slots.
- `PagedRunner` writes each new key/value at (block, offset) and attends over a row's blocks gathered through
  its block table (SDPA); on CUDA, decode-only steps replay captured graphs that attend through the tables
  with a Triton kernel (`graphs.py`, `paged_attention.py`).

Dense text models only (MoE routing capture and images keep the slot cache). Knows the model, the block
manager and the scheduler; nothing of sampling or agents."""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections import deque

import numpy as np
import torch

from molt.engine.blocks import (
    BlockCopy,
    BlockManager,
    OutOfBlocks,
    bytes_per_block,
    kv_budget_bytes,
    num_blocks_for_budget,
)
from molt.engine.cpu.packed import LinearPacks
from molt.engine.graphs import GraphDecode
from molt.engine.runner import Prepared, gathered_attention, joined_attention, sampled_logits, writing_attend
from molt.engine.scheduler import Group, Plan, Scheduler, Sequence
from molt.engine.transfer import to_device
from molt.models.transformer import Transformer

log = logging.getLogger(__name__)


def num_kv_blocks(
    model: Transformer,
    block_size: int,
    kv_blocks: int | None = None,
    kv_bytes: int | None = None,
    kv_memory_fraction: float | None = None,
) -> int | None:
    """Blocks of the paged cache: given, or from a byte budget, or from a fraction of free CUDA memory (None: none
    asked, the engine keeps its slot cache)."""
    if kv_blocks is not None:
        return kv_blocks
    param, cfg = next(model.parameters()), model.cfg
    block_bytes = bytes_per_block(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, param.element_size(), block_size)
    if kv_bytes is not None:
        return num_blocks_for_budget(kv_bytes, block_bytes)
    if kv_memory_fraction is not None:
        if param.device.type != "cuda":
            raise ValueError("kv_memory_fraction sizes the cache from free CUDA memory; on CPU pass kv_bytes")
        free, _ = torch.cuda.mem_get_info(param.device)
        return num_blocks_for_budget(kv_budget_bytes(free, kv_memory_fraction), block_bytes)
    return None


class PagedSlots:
    """The slot cache manager's interface over a `BlockManager` (see the module docstring).

    `tables_sm` mirrors each slot's block table as a row of block ids padded with `num_blocks` (the runner's
    scratch block), for the graphed decode step to gather its rows from at once; a row is written only where its
    table changed (a new block, a new table, a release), never rebuilt per step."""

    def __init__(self, blocks: BlockManager, num_slots: int, max_blocks: int):
        self.blocks, self.num_slots = blocks, num_slots
        self._free_slots = list(range(num_slots - 1, -1, -1))
        self._slot_of: dict[int, int] = {}
        self._seq_at: dict[int, int] = {}
        self.tables_sm = np.full((num_slots, max_blocks), blocks.num_blocks, dtype=np.int64)
        self._num_mirrored = [0] * num_slots  # blocks of each row that are not padding

    @property
    def num_active(self) -> int:
        return len(self._slot_of)

    def slot_of(self, seq_id: int, default: int | None = None) -> int:
        return self._slot_of[seq_id] if default is None else self._slot_of.get(seq_id, default)

    def table_at(self, slot: int) -> list[int]:
        return self.blocks.block_table(self._seq_at[slot])

    def length_of(self, seq_id: int) -> int:
        return self.blocks.num_computed(seq_id) if self.blocks.has(seq_id) else 0

    def num_free(self) -> int:
        return len(self._free_slots)

    def allocate(self, seq_id: int, prompt=()) -> tuple[int, int]:
        """A slot, and blocks for `prompt` when given: (slot, positions already cached)."""
        slot = self._free_slots.pop()
        self._slot_of[seq_id], self._seq_at[slot] = slot, seq_id
        return slot, self._allocate_blocks(seq_id, prompt) if prompt else 0

    def _allocate_blocks(self, seq_id: int, prompt) -> int:
        cached = self.blocks.allocate(seq_id, prompt)
        self._mirror(seq_id)
        return cached

    def reserve(self, seq_id: int, tokens: list[int]) -> int | None:
        """Blocks for every position of `tokens`: the positions already cached when it had none, else its
        computed count; None when blocks ran out (those reserved so far are kept)."""
        blocks = self.blocks
        if not blocks.has(seq_id):
            return self._allocate_blocks(seq_id, tokens) if blocks.can_allocate(len(tokens)) else None
        added = blocks.extend(seq_id, tokens)
        if added != 0:
            self._mirror(seq_id)
        return None if added is None else blocks.num_computed(seq_id)

    def _mirror(self, seq_id: int) -> None:
        """Bring the slot's row of `tables_sm` up to the sequence's block table: a table only ever grows by
        appended blocks, and a new one starts from a row its released predecessor left all padding."""
        slot = self._slot_of[seq_id]
        table = self.blocks.block_table(seq_id) if self.blocks.has(seq_id) else ()
        row, held = self.tables_sm[slot], self._num_mirrored[slot]
        if len(table) >= held:
            row[held : len(table)] = table[held:]
        else:
            row[:held] = self.blocks.num_blocks
        self._num_mirrored[slot] = len(table)

    def share(self, src_seq: int, dst_seq: int, length: int) -> None:
        """`dst_seq` forks `src_seq`'s first `length` positions; out of blocks, it is left without any and
        `PagedScheduler` gives it blocks (and a prefill) later."""
        self.release_blocks(dst_seq)
        with contextlib.suppress(OutOfBlocks):
            self.blocks.fork(src_seq, dst_seq, length)
            self._mirror(dst_seq)

    def set_length(self, seq_id: int, length: int) -> None:
        self.blocks.set_computed(seq_id, length)

    def release_blocks(self, seq_id: int) -> None:
        if self.blocks.has(seq_id):
            self.blocks.free(seq_id)
            self._mirror(seq_id)

    def free(self, seq_id: int, tokens=None) -> None:
        """Release blocks (registered ones stay cached as prefixes) and slot; `tokens` is not needed."""
        self.release_blocks(seq_id)
        slot = self._slot_of.pop(seq_id)
        del self._seq_at[slot]
        self._free_slots.append(slot)

    def take_moves(self) -> list[BlockCopy]:
        return self.blocks.take_copies()

    def clear_prefixes(self) -> None:
        self.blocks.clear_prefixes()

    def reset_lengths(self) -> None:
        """Nothing to do: `PagedScheduler.restart_all` releases the blocks instead."""


class PagedScheduler(Scheduler):
    """`Scheduler` with block reservation, admission by free blocks, and preemption by recompute."""

    manager: PagedSlots

    def __init__(self, manager: PagedSlots, max_num_batched_tokens: int = 2048):
        super().__init__(manager, max_num_batched_tokens)
        self.preempted: deque[Sequence] = deque()
        self.num_preemptions = 0

    def has_work(self, admit: bool) -> bool:
        return super().has_work(admit) or bool(self.preempted)

    def schedule(self, admit: bool = True) -> Plan:
        preempted = len(self.preempted)
        for seq in list(self.running):  # a reservation may preempt sequences later in the list: skip those
            if seq.waits_for is None and (len(self.preempted) == preempted or seq in self.running):
                self._reserve(seq)
        self._readmit()
        return super().schedule(admit and not self.preempted)

    def _fits(self, group: Group) -> bool:
        reserve = len(group.seqs) if self.running else 0  # room for each sample's next block
        return super()._fits(group) and self.manager.blocks.can_allocate(len(group.prompt), reserve)

    def _admit(self, group: Group) -> Sequence | None:
        leader = super()._admit(group)
        if leader is not None:  # its prompt's blocks: allocated, or a fork of a running copy (+ its last token)
            computed = self.manager.reserve(leader.seq_id, leader.tokens)
            if computed is None:
                raise RuntimeError("paged KV cache: an admitted prompt found no block (admission checks it)")
            leader.num_computed = leader.num_cached = computed
        return leader

    def _reserve(self, seq: Sequence) -> None:
        """Blocks for all of `seq`'s tokens, preempting the latest admitted sequences (maybe `seq`) until they fit."""
        fresh = not self.manager.blocks.has(seq.seq_id)  # no blocks (its fork or its leader failed): prefix hits only
        while (computed := self.manager.reserve(seq.seq_id, seq.tokens)) is None:
            victim = self._victim()
            if victim is None:
                raise RuntimeError("paged KV cache: out of blocks with no sequence to preempt")
            self._preempt(victim)
            if victim is seq:
                return
        if fresh:
            seq.num_computed = seq.num_cached = computed

    def _victim(self) -> Sequence | None:
        """The latest admitted running sequence that no other waits for (vLLM's recompute policy)."""
        waited_for = {id(s.waits_for) for s in self.running if s.waits_for is not None}
        return next((s for s in reversed(self.running) if s.waits_for is None and id(s) not in waited_for), None)

    def _preempt(self, seq: Sequence) -> None:
        self._disown(seq)
        self.running.remove(seq)
        self.manager.free(seq.seq_id)
        seq.num_computed = 0
        self.preempted.append(seq)
        self.num_preemptions += 1

    def _readmit(self) -> None:
        """Preempted sequences first, oldest first, as blocks allow: prefix hits, then a prefill of the rest."""
        while self.preempted and self.manager.num_free():
            reserve = 1 if self.running else 0  # room for its next token, unless alone (it always fits then)
            if not self.manager.blocks.can_allocate(len(self.preempted[0].tokens), reserve):
                return
            seq = self.preempted.popleft()
            _, seq.num_computed = self.manager.allocate(seq.seq_id, seq.tokens)
            self.running.append(seq)

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None, cache: bool = True) -> None:
        if seq in self.preempted:
            self.preempted.remove(seq)
        super().finish(seq, reason, stop_reason, cache)

    def restart_all(self) -> None:
        """New weights: release every running sequence's blocks; they are taken again (no stale prefix can hit)
        when each recomputes, as in `Scheduler.restart_all`."""
        for seq in self.running:
            self.manager.release_blocks(seq.seq_id)
        super().restart_all()


class PagedRunner:
    """Runs one packed decode + prefill forward of `model` against the paged cache; applies block copies."""

    routes = None  # no MoE routing capture

    def __init__(self, model: Transformer, manager: PagedSlots, graphs: bool | None = None):
        cfg = model.cfg
        if cfg.num_moe_layers() or cfg.image_token_id is not None:
            raise ValueError("the paged KV cache serves dense text models (MoE and VLMs keep the slot cache)")
        self.model, self.manager = model.eval(), manager
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.block_size, self.kv_heads, self.head_dim = manager.blocks.block_size, cfg.num_kv_heads, cfg.head_dim
        on_cuda = self.device.type == "cuda"
        graphs = on_cuda if graphs is None else graphs
        # with graphs, one block past the manager's: the scratch block that padding rows read and write
        scratch = manager.blocks.num_blocks
        shape = (cfg.num_layers, scratch + graphs, cfg.num_kv_heads, self.block_size, cfg.head_dim)
        self.k, self.v = (torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(2))
        self.packs = LinearPacks(model)  # Molt's GEMM kernel for the linear layers on CPU in fp32, as ModelRunner
        self.graphs = GraphDecode(self, manager.num_slots, scratch, capture=on_cuda) if graphs else None

    def cache_bytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def warm_up(self) -> None:
        """Capture the decode graphs (CUDA) on the calling thread, before serving; decode stays eager if it fails."""
        if self.graphs is None:
            return
        try:
            self.graphs.capture_all()
        except Exception:  # noqa: BLE001 - e.g. a kernel that cannot be captured: the eager path still serves
            log.exception("capturing the decode CUDA graphs failed; decoding eagerly")
            self.graphs = None

    @torch.inference_mode()
    def forward(self, decode, chunks, sampled_chunks, image_embeds_nh=None) -> torch.Tensor:
        """Logits [D + S, V], as `ModelRunner.forward` (same arguments; no images). Decode-only steps run the
        captured graph of their batch bucket (`graphs.py`)."""
        if self.graphs is not None and not chunks:  # every decode row has a slot: a bucket fits them
            return self.graphs.step(decode)
        ids = [token for _, token, _ in decode] + [t for _, c, _ in chunks for t in c]
        positions = [pos for _, _, pos in decode] + [p for _, c, s in chunks for p in range(s, s + len(c))]
        rows = [(slot, pos, 1) for slot, _, pos in decode] + [(slot, s, len(c)) for slot, c, s in chunks]
        ids_1n = to_device([ids], torch.long, self.device)
        pos_1n = to_device([positions], torch.long, self.device)
        with self.packs.active():
            hidden_nh = self.model(ids_1n, pos_1n, cache=self._backend(rows, len(decode)), return_hidden=True)[0]
            return sampled_logits(self.model, hidden_nh, len(decode), chunks, sampled_chunks)

    def _backend(self, rows: list[tuple[int, int, int]], num_decode: int) -> Prepared:
        """Cache backend of one packed row: `rows` are (slot, start position, length), the decode rows (length 1)
        first, then the prefill chunks."""
        device, bs = self.device, self.block_size
        tables = {slot: self.manager.table_at(slot) for slot, _, _ in rows}
        # each new key/value is one row of the flat cache [blocks * kv_heads * block_size, head_dim] (first_n: head 0's)
        first_n = [tables[slot][p // bs] * self.kv_heads * bs + p % bs for slot, s, n in rows for p in range(s, s + n)]
        groups = [g for g in (rows[:num_decode], rows[num_decode:]) if g]
        attentions = [
            gathered_attention(g, tables, bs, self.kv_heads, bs * max(-(-(s + n) // bs) for _, s, n in g), device)
            for g in groups
        ]
        bounds = list(itertools.accumulate((sum(n for _, _, n in g) for g in groups), initial=0))
        attention = joined_attention(list(zip(attentions, bounds, bounds[1:], strict=False)))
        return Prepared(writing_attend(self.k, self.v, to_device(first_n, torch.long, device), bs, attention))

    @torch.inference_mode()
    def apply_moves(self, copies: list[BlockCopy]) -> None:
        """Copy each forked sample's partial last block (positions [0, length) of `src` into `dst`)."""
        for c in copies:
            for cache in (self.k, self.v):  # [L, block, kv head, offset, dim]
                cache[:, c.dst, :, : c.length] = cache[:, c.src, :, : c.length]
