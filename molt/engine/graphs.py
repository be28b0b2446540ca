"""Decode steps of the paged engine as captured CUDA graphs: no per-step Python or kernel-launch overhead.

A decode-only step of B rows runs the graph of the smallest batch bucket >= B (1, 2, 4, 8, then multiples of
16 up to the engine's slots). Each graph was captured once, at start-up, over static input buffers: token
ids, positions, each row's block table (padded to the longest table a sequence can have) and length, and
where each row's new key/value goes. A step fills those buffers with ONE host -> device copy, replays the
graph (the model's forward, the paged attention kernel reading block tables on the device, the LM head) and
returns a view of the bucket's logits; sampling then runs on them as for any step. Rows past B are padding:
they read and write one scratch block that no sequence owns, so padding never touches a sequence's cache.

All buckets share one memory pool and one logits buffer (captured largest first). Weights load in place and the
cache never moves, so a weight sync needs no recapture. Off CUDA the same buffers and forward run eagerly
(`capture=False`): the tests check the whole path, padding included, on CPU. Knows the paged runner's cache
layout and the model's cache protocol; nothing of requests, sampling or scheduling.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import torch

from molt.engine.paged_attention import paged_decode
from molt.engine.transfer import to_device
from molt.models.transformer import Transformer

log = logging.getLogger(__name__)


class PagedRunner(Protocol):
    """What graphed decode uses of its runner (`paged.PagedRunner`, which owns it)."""

    model: Transformer
    k: torch.Tensor  # [layers, blocks (+ scratch), kv_heads, block_size, head_dim]
    v: torch.Tensor
    manager: Any  # paged.PagedSlots: `table_at(slot)` gives a slot's block table
    device: torch.device
    kv_heads: int
    head_dim: int
    block_size: int


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16, up to the first bucket >= `max_batch`."""
    candidates = [1, 2, 4, 8, *range(16, max_batch + 16, 16)]
    return [b for b in candidates if b < max_batch] + [next(b for b in candidates if b >= max_batch)]


class GraphStep:
    """Cache backend of a graphed decode step: row n writes its new key/value at flat cache row `write_n[n]`
    (+ head x block_size) and attends over its first `lens_n[n]` positions through `table_nm[n]`."""

    def __init__(self, runner: PagedRunner, table_nm, lens_n, write_n):
        self.runner, self.table_nm, self.lens_n, self.write_n = runner, table_nm, lens_n, write_n

    def prepare(self, position_ids_bt: torch.Tensor):
        r = self.runner
        heads_k = torch.arange(r.kv_heads, device=self.write_n.device) * r.block_size
        write_nk = (self.write_n[:, None] + heads_k).view(-1)
        scale = r.head_dim**-0.5

        def attend(layer_idx: int, q_1hnd, k_1knd, v_1knd) -> torch.Tensor:
            k_cache, v_cache = r.k[layer_idx], r.v[layer_idx]
            q_nhd, k_nkd, v_nkd = q_1hnd[0].transpose(0, 1), k_1knd[0].transpose(0, 1), v_1knd[0].transpose(0, 1)
            k_cache.view(-1, r.head_dim).index_copy_(0, write_nk, k_nkd.reshape(-1, r.head_dim))
            v_cache.view(-1, r.head_dim).index_copy_(0, write_nk, v_nkd.reshape(-1, r.head_dim))
            out_nhd = paged_decode(q_nhd, k_cache, v_cache, self.table_nm, self.lens_n, scale)
            return out_nhd.transpose(0, 1)[None]

        return attend


class GraphDecode:
    """Static buffers, one captured graph per batch bucket, and the replay of a decode step (module docstring).

    `scratch` is the cache block padding rows use; `max_blocks` the widest block table."""

    def __init__(self, runner: PagedRunner, max_batch: int, max_blocks: int, scratch: int, capture: bool):
        self.runner, self.scratch, self.capture = runner, scratch, capture
        self.buckets = batch_buckets(max_batch)
        self.max_blocks, device = max_blocks, runner.device
        top = self.buckets[-1]
        # per row: id, position, length, write row, then the block table (one int64 buffer, one copy per step)
        self.inputs = torch.zeros(top, 4 + max_blocks, dtype=torch.long, device=device)
        self.ids = torch.zeros(top, dtype=torch.long, device=device)
        self.pos, self.write = torch.zeros_like(self.ids), torch.zeros_like(self.ids)
        self.lens = torch.ones(top, dtype=torch.int32, device=device)
        self.table = torch.full((top, max_blocks), scratch, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: torch.Tensor | None = None  # [top, V], every bucket's output (captured graphs only)

    def fits(self, num_rows: int) -> bool:
        return 0 < num_rows <= self.buckets[-1]

    def _forward(self, bucket: int) -> torch.Tensor:
        """Logits [bucket, V] of the rows in the static buffers (their new keys/values written to the cache)."""
        r = self.runner
        ids, pos = self.ids[:bucket], self.pos[:bucket]
        backend = GraphStep(r, self.table[:bucket], self.lens[:bucket], self.write[:bucket])
        hidden_nh = r.model(ids[None], pos[None], cache=backend, return_hidden=True)[0]
        return r.model.lm_head(hidden_nh)

    def _unpack(self, bucket: int) -> None:
        """Device-side: the packed input rows into the typed static buffers (part of the graph)."""
        rows = self.inputs[:bucket]
        self.ids[:bucket].copy_(rows[:, 0])
        self.pos[:bucket].copy_(rows[:, 1])
        self.lens[:bucket].copy_(rows[:, 2])
        self.write[:bucket].copy_(rows[:, 3])
        self.table[:bucket].copy_(rows[:, 4:])

    def _run(self, bucket: int) -> torch.Tensor:
        self._unpack(bucket)
        return self._forward(bucket)

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture every bucket's graph, largest first, into one memory pool (CUDA only)."""
        if not self.capture:
            return
        self._fill([], self.buckets[-1])
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

    def _fill(self, rows: list[list[int]], bucket: int) -> None:
        """One host -> device copy of `rows` ([id, pos, len, write, table...]) padded to `bucket` rows."""
        pad = [0, 0, 1, self.scratch * self.runner.kv_heads * self.runner.block_size] + [self.scratch] * self.max_blocks
        self.inputs[:bucket].copy_(to_device(rows + [pad] * (bucket - len(rows)), torch.long, self.runner.device))

    def step(self, decode: list[tuple[int, int, int]]) -> torch.Tensor:
        """Logits [B, V] of decode rows (slot, token id, position), their new keys and values in the cache."""
        r, bs = self.runner, self.runner.block_size
        bucket = next(b for b in self.buckets if b >= len(decode))
        rows = []
        for slot, token, pos in decode:
            table = r.manager.table_at(slot)
            write = (table[pos // bs] * r.kv_heads) * bs + pos % bs
            rows.append([token, pos, pos + 1, write, *table, *[self.scratch] * (self.max_blocks - len(table))])
        self._fill(rows, bucket)
        if bucket in self.graphs:
            self.graphs[bucket].replay()
            return self.logits[: len(decode)]
        return self._run(bucket)[: len(decode)]
