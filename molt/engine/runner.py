"""The model runner: Molt's own `Transformer` over a preallocated slot KV cache.

Owns the physical cache `k`/`v` [layers, num_slots + 1, kv_heads, max_seq_len + 1, head_dim]
(one spare row for swaps, one spare position where padding tokens write) and two cache backends
implementing the model's `prepare` / `attend` protocol:

- `DecodeStep`: one token for each of rows 0..B-1 (the active slots are contiguous, see
  `cache.py`), so every layer attends over a strided *view* of the cache with two batched
  matmuls; the hot path has no gathers and no per-request Python.
- `PrefillStep`: chunks of several tokens for arbitrary slots (gather, write, causal mask).

The model is the trainer's model; the runner only decides where keys and values live. Knows
nothing of requests, sampling or scheduling.
"""

from __future__ import annotations

import torch

from molt.engine.cache import SCRATCH, Move
from molt.models.transformer import Transformer


def gqa_attention(q_bhtd: torch.Tensor, k_bksd: torch.Tensor, v_bksd: torch.Tensor, mask_b1ts: torch.Tensor):
    """Softmax attention with grouped kv heads (q head h uses kv head h // group), additive mask.

    Keys are not repeated per group: the group's queries are stacked along the query axis instead.
    """
    b, h, t, d = q_bhtd.shape
    kv_heads, s = k_bksd.shape[1], k_bksd.shape[2]
    group = h // kv_heads
    q_bkqd = (q_bhtd * d**-0.5).reshape(b, kv_heads, group * t, d)
    scores_bkgts = torch.matmul(q_bkqd, k_bksd.transpose(-1, -2)).view(b, kv_heads, group, t, s)
    probs_bkqs = torch.softmax(scores_bkgts + mask_b1ts[:, :, None], dim=-1).view(b, kv_heads, group * t, s)
    return torch.matmul(probs_bkqs, v_bksd).view(b, h, t, d)


def _additive_mask(visible: torch.Tensor) -> torch.Tensor:
    return torch.zeros(visible.shape, dtype=torch.float32, device=visible.device).masked_fill_(~visible, float("-inf"))


class DecodeStep:
    """Cache backend for one decode token per row of rows [0, B); position -1 marks a filler row."""

    def __init__(self, runner: ModelRunner, kv_len: int):
        self.runner, self.kv_len = runner, kv_len

    def prepare(self, position_ids_bt: torch.Tensor):
        r = self.runner
        pos_b = position_ids_bt[:, 0]
        rows, kv_len = pos_b.shape[0], self.kv_len
        write_b = torch.where(pos_b < 0, r.max_seq_len, pos_b)  # filler rows write the spare position
        index_bk1d = write_b.view(rows, 1, 1, 1).expand(rows, r.kv_heads, 1, r.head_dim)
        key_pos_s = torch.arange(kv_len, device=pos_b.device)
        mask_b11s = _additive_mask(key_pos_s[None, :] <= pos_b.clamp(min=0)[:, None])[:, None, None]

        def attend(layer_idx: int, q_bhtd, k_bhtd, v_bhtd) -> torch.Tensor:
            k_cache, v_cache = r.k[layer_idx, :rows], r.v[layer_idx, :rows]
            k_cache.scatter_(2, index_bk1d, k_bhtd)
            v_cache.scatter_(2, index_bk1d, v_bhtd)
            return gqa_attention(q_bhtd, k_cache[:, :, :kv_len], v_cache[:, :, :kv_len], mask_b11s)

        return attend


class PrefillStep:
    """Cache backend for token chunks of arbitrary slots; padding positions are -1."""

    def __init__(self, runner: ModelRunner, slots_r: torch.Tensor, kv_len: int):
        self.runner, self.slots_r, self.kv_len = runner, slots_r, kv_len

    def prepare(self, position_ids_bt: torch.Tensor):
        r, slots_r, kv_len = self.runner, self.slots_r, self.kv_len
        valid_bt = position_ids_bt >= 0
        slots_n = slots_r[:, None].expand_as(position_ids_bt)[valid_bt]
        pos_n = position_ids_bt[valid_bt]
        key_pos_s = torch.arange(kv_len, device=position_ids_bt.device)
        mask_b1ts = _additive_mask(key_pos_s[None, None, :] <= position_ids_bt.clamp(min=0)[:, :, None])[:, None]

        def attend(layer_idx: int, q_bhtd, k_bhtd, v_bhtd) -> torch.Tensor:
            k_cache, v_cache = r.k[layer_idx], r.v[layer_idx]
            k_cache[slots_n, :, pos_n] = k_bhtd.transpose(1, 2)[valid_bt]
            v_cache[slots_n, :, pos_n] = v_bhtd.transpose(1, 2)[valid_bt]
            keys_bksd = k_cache[:, :, :kv_len].index_select(0, slots_r)
            values_bksd = v_cache[:, :, :kv_len].index_select(0, slots_r)
            return gqa_attention(q_bhtd, keys_bksd, values_bksd, mask_b1ts)

        return attend


class ModelRunner:
    """Runs decode and prefill forwards of `model` against the slot cache; applies cache moves."""

    def __init__(self, model: Transformer, num_slots: int, max_seq_len: int):
        cfg = model.cfg
        self.model = model.eval()
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.num_slots, self.max_seq_len = num_slots, max_seq_len
        self.kv_heads, self.head_dim = cfg.num_kv_heads, cfg.head_dim
        shape = (cfg.num_layers, num_slots + 1, cfg.num_kv_heads, max_seq_len + 1, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.v = torch.zeros(shape, dtype=self.dtype, device=self.device)

    def cache_bytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    @torch.inference_mode()
    def decode(self, token_ids: list[int], positions: list[int]) -> torch.Tensor:
        """Logits [B, V] for one token per row 0..B-1 (position -1: filler row, output unused)."""
        ids_b1 = torch.tensor(token_ids, dtype=torch.long, device=self.device)[:, None]
        pos_b1 = torch.tensor(positions, dtype=torch.long, device=self.device)[:, None]
        logits_b1v = self.model(ids_b1, pos_b1, cache=DecodeStep(self, max(positions) + 1))
        return logits_b1v[:, 0]

    @torch.inference_mode()
    def prefill(self, chunks: list[tuple[int, list[int], int]]) -> torch.Tensor:
        """Logits [R, V] at the last token of each (slot, token ids, start position) chunk."""
        width = max(len(ids) for _, ids, _ in chunks)
        ids_rt = torch.zeros(len(chunks), width, dtype=torch.long)
        pos_rt = torch.full((len(chunks), width), -1, dtype=torch.long)
        for row, (_, ids, start) in enumerate(chunks):
            ids_rt[row, : len(ids)] = torch.tensor(ids)
            pos_rt[row, : len(ids)] = torch.arange(start, start + len(ids))
        slots_r = torch.tensor([slot for slot, _, _ in chunks], dtype=torch.long, device=self.device)
        kv_len = max(start + len(ids) for _, ids, start in chunks)
        backend = PrefillStep(self, slots_r, kv_len)
        hidden_rth = self.model(ids_rt.to(self.device), pos_rt.to(self.device), cache=backend, return_hidden=True)
        last_r = torch.tensor([len(ids) - 1 for _, ids, _ in chunks], device=self.device)
        hidden_rh = hidden_rth[torch.arange(len(chunks), device=self.device), last_r]
        return self.model.lm_head(hidden_rh)

    @torch.inference_mode()
    def apply_moves(self, moves: list[Move]) -> None:
        """Copy cache rows as the cache manager relocated them (in order)."""
        for move in moves:
            if move.length == 0:
                continue
            src = self.num_slots if move.src == SCRATCH else move.src
            dst = self.num_slots if move.dst == SCRATCH else move.dst
            self.k[:, dst, :, : move.length].copy_(self.k[:, src, :, : move.length])
            self.v[:, dst, :, : move.length].copy_(self.v[:, src, :, : move.length])
