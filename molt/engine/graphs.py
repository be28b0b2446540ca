"""Decode steps of the paged engine as captured CUDA graphs: no per-step Python or kernel-launch overhead.

A decode-only step of B rows replays the graph of the smallest batch bucket >= B, captured at start-up over static
buffers (ids, positions, block tables padded to the longest, lengths, write rows). A step fills them with ONE host ->
device copy of a (pinned) host buffer written by a few numpy ops from the manager's per-slot table mirror
(`PagedSlots.tables_sm`), so no Python runs per row or block. Padding rows read and write a scratch block that no
sequence owns.

All buckets share one memory pool and one logits buffer (captured largest first); weights load in place and the cache
never moves, so a weight sync needs no recapture. Off CUDA the same path runs eagerly (`capture=False`), which the tests
check on CPU. Knows the paged runner's cache layout; nothing of requests, sampling or scheduling."""

from __future__ import annotations

import itertools
import logging
from typing import Any, Protocol

import numpy as np
import torch

from molt.engine.paged_attention import paged_decode
from molt.engine.runner import Prepared, writing_attend
from molt.models.transformer import Transformer

log = logging.getLogger(__name__)


class PagedRunner(Protocol):
    """What graphed decode uses of its runner (`paged.PagedRunner`, which owns it)."""

    model: Transformer
    k: torch.Tensor  # [layers, blocks (+ scratch), kv_heads, block_size, head_dim]
    v: torch.Tensor
    manager: Any  # paged.PagedSlots: `tables_sm[slot]` is a slot's block table, padded
    device: torch.device
    kv_heads: int
    head_dim: int
    block_size: int


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16, up to the first bucket >= `max_batch`."""
    candidates = [1, 2, 4, 8, *range(16, max_batch + 16, 16)]
    return [b for b in candidates if b < max_batch] + [next(b for b in candidates if b >= max_batch)]


class GraphDecode:
    """Static buffers, one captured graph per batch bucket, and the replay of a decode step (module docstring).

    `scratch` is the cache block padding rows use (the manager pads its block-table rows with it too)."""

    def __init__(self, runner: PagedRunner, max_batch: int, scratch: int, capture: bool):
        self.runner, self.scratch, self.capture = runner, scratch, capture
        self.buckets = batch_buckets(max_batch)
        max_blocks, device = runner.manager.tables_sm.shape[1], runner.device
        top = self.buckets[-1]
        # per row: id, position, length, write row, then the block table (one int64 buffer, one copy per step)
        self.inputs = torch.zeros(top, 4 + max_blocks, dtype=torch.long, device=device)
        self.host = torch.zeros(self.inputs.shape, dtype=torch.long, pin_memory=device.type == "cuda")
        self.host_np = self.host.numpy()
        self.pad_row = np.array([0, 0, 1, scratch * runner.kv_heads * runner.block_size] + [scratch] * max_blocks)
        self.copied = torch.cuda.Event() if device.type == "cuda" else None  # the last host -> device copy
        self.ids = torch.zeros(top, dtype=torch.long, device=device)
        self.pos, self.write = torch.zeros_like(self.ids), torch.zeros_like(self.ids)
        self.lens = torch.ones(top, dtype=torch.int32, device=device)
        self.table = torch.full((top, max_blocks), scratch, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: torch.Tensor | None = None  # [top, V], every bucket's output (captured graphs only)

    def _run(self, bucket: int) -> torch.Tensor:
        """Logits [bucket, V] of the packed input rows: unpacked into the typed static buffers (device-side, part of
        the graph); row n writes its new key/value at flat cache row `write[n]` (+ head x block_size) and attends
        over its first `lens[n]` positions through `table[n]`."""
        r, rows, scale = self.runner, self.inputs[:bucket], self.runner.head_dim**-0.5
        for column, buffer in enumerate((self.ids, self.pos, self.lens, self.write)):
            buffer[:bucket].copy_(rows[:, column])
        self.table[:bucket].copy_(rows[:, 4:])
        table, lens = self.table[:bucket], self.lens[:bucket]
        attention = lambda k_cache, v_cache, q_nhd: paged_decode(q_nhd, k_cache, v_cache, table, lens, scale)  # noqa: E731
        backend = Prepared(writing_attend(r.k, r.v, self.write[:bucket], r.block_size, attention))
        hidden_nh = r.model(self.ids[None, :bucket], self.pos[None, :bucket], cache=backend, return_hidden=True)[0]
        return r.model.lm_head(hidden_nh)

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture every bucket's graph, largest first, into one memory pool (CUDA only)."""
        if not self.capture:
            return
        self._fill(np.zeros((0, 3), dtype=np.int64), self.buckets[-1])
        pool = None
        for bucket in reversed(self.buckets):
            self._run(bucket)  # warm-up outside the graph: kernels compiled, workspaces allocated
            torch.cuda.synchronize(self.runner.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):  # other threads may run
                logits = self._run(bucket)
                if self.logits is None:  # the largest bucket's output: the others write into its first rows
                    self.logits = logits
                else:
                    self.logits[:bucket].copy_(logits)
            pool = pool or graph.pool()
            self.graphs[bucket] = graph
        torch.cuda.synchronize(self.runner.device)
        log.info("captured %d decode graphs (batch buckets up to %d)", len(self.graphs), self.buckets[-1])

    def _fill(self, decode_n3: np.ndarray, bucket: int) -> None:
        """The input rows [id, pos, len, write, table...] of the decode rows (slot, token id, position), then
        padding up to `bucket` rows: written into the host buffer at once, then ONE host -> device copy."""
        r, n = self.runner, len(decode_n3)
        if self.copied is not None:  # the previous step's copy may still be reading the host buffer
            self.copied.synchronize()
        slot_n, pos_n = decode_n3[:, 0], decode_n3[:, 2]
        host = self.host_np
        host[:n, 0], host[:n, 1], host[:n, 2] = decode_n3[:, 1], pos_n, pos_n + 1
        block_n = r.manager.tables_sm[slot_n, pos_n // r.block_size]
        host[:n, 3] = block_n * r.kv_heads * r.block_size + pos_n % r.block_size
        host[:n, 4:] = r.manager.tables_sm[slot_n]
        host[n:bucket] = self.pad_row
        self.inputs[:bucket].copy_(self.host[:bucket], non_blocking=True)
        if self.copied is not None:
            self.copied.record()

    def step(self, decode: list[tuple[int, int, int]]) -> torch.Tensor:
        """Logits [B, V] of decode rows (slot, token id, position), their new keys and values in the cache."""
        bucket = next(b for b in self.buckets if b >= len(decode))
        flat = np.fromiter(itertools.chain.from_iterable(decode), dtype=np.int64, count=3 * len(decode))
        self._fill(flat.reshape(-1, 3), bucket)
        if bucket in self.graphs:
            self.graphs[bucket].replay()
            return self.logits[: len(decode)]
        return self._run(bucket)[: len(decode)]
