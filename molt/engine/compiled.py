"""The engine's compiled decode step: one `torch.compile`d graph (inductor, dynamic shapes, C++ wrapper) for
decode-only steps of a dense text model.

One compilation (cached on disk by inductor) serves every batch, length and cache size; a lone row runs padded
to two (a batch of 1 would be compiled again). The graph reads the cache and writes nothing (an in-graph write
made it copy the cache): `CompiledDecode.step` stores the new keys and values after it. On CPU the linear
layers use the packed weights (`cpu/packed.py`) and, in fp32, attention is Molt's kernel. Knows the runner's
cache layout, nothing of requests or scheduling. See docs/engine.md."""

from __future__ import annotations

import logging
from typing import Protocol

import torch

from molt.engine.cpu import kernels
from molt.engine.cpu.packed import LinearPacks
from molt.engine.transfer import to_device
from molt.models.attention import additive_mask, per_kv_head
from molt.models.transformer import Transformer

log = logging.getLogger(__name__)


class SlotRunner(Protocol):
    """What the compiled step uses of its runner (`runner.ModelRunner`, which owns it)."""

    model: Transformer
    k: torch.Tensor  # [layers, slots + 1, kv_heads, max_seq_len, head_dim]
    v: torch.Tensor
    packs: LinearPacks
    own_attention: bool
    device: torch.device
    kv_heads: int
    max_seq_len: int


class DecodeOverCache:
    """Cache backend of the compiled decode step: row b attends over cache row `slots_b[b]`'s positions before its
    own (Molt's kernel; torch ops read rows 0..B-1 as one view, so the slots must be those), then its own new key,
    which `new_k`/`new_v` collect per layer for the caller to store. `MixedStep`'s softmax, summed in another order."""

    def __init__(
        self, k: torch.Tensor, v: torch.Tensor, slots_b: torch.Tensor, key_pos_s: torch.Tensor, own_attention: bool
    ):
        self.k, self.v, self.slots_b, self.key_pos_s, self.own_attention = k, v, slots_b, key_pos_s, own_attention
        self.new_k, self.new_v = [], []  # per layer

    def prepare(self, position_ids_bt: torch.Tensor):
        pos_b = position_ids_bt[0]
        attention = self._kernel_attention(pos_b) if self.own_attention else self._torch_attention(pos_b)

        def attend(layer_idx: int, q_1hnd, k_1knd, v_1knd) -> torch.Tensor:
            q_nhd, k_nkd, v_nkd = q_1hnd[0].transpose(0, 1), k_1knd[0].transpose(0, 1), v_1knd[0].transpose(0, 1)
            self.new_k.append(k_nkd)
            self.new_v.append(v_nkd)
            return attention(layer_idx, q_nhd, k_nkd, v_nkd).transpose(0, 1)[None]

        return attend

    def _torch_attention(self, pos_b: torch.Tensor):
        """Row b over cache row b's first pos_b[b] positions, then its own key, in torch ops."""
        key_pos_s, rows = self.key_pos_s, pos_b.shape[0]
        kv_len, kv_heads, head_dim = key_pos_s.shape[0], self.k.shape[2], self.k.shape[4]
        mask_m1s = per_kv_head(additive_mask(key_pos_s[None, :] < pos_b[:, None]), kv_heads)
        scale = head_dim**-0.5

        def attention(layer_idx: int, q_nhd, k_nkd, v_nkd) -> torch.Tensor:
            keys_msd = self.k[layer_idx, :rows, :, :kv_len].reshape(rows * kv_heads, kv_len, head_dim)
            values_msd = self.v[layer_idx, :rows, :, :kv_len].reshape(rows * kv_heads, kv_len, head_dim)
            q_mgd = q_nhd.reshape(rows * kv_heads, -1, head_dim)
            # scores and softmax in fp32 whatever the cache's dtype; the products with keys and values in it
            old_mgs = torch.bmm(q_mgd, keys_msd.transpose(1, 2)).float() * scale + mask_m1s
            own_mg1 = (q_mgd.float() * k_nkd.reshape(rows * kv_heads, 1, head_dim).float()).sum(-1, keepdim=True)
            probs_mgs = torch.softmax(torch.cat([old_mgs, own_mg1 * scale], dim=-1), dim=-1)
            own_mgd = probs_mgs[..., kv_len:] * v_nkd.reshape(rows * kv_heads, 1, head_dim).float()
            out_mgd = torch.bmm(probs_mgs[..., :kv_len].to(values_msd.dtype), values_msd) + own_mgd.to(values_msd.dtype)
            return out_mgd.view(q_nhd.shape)

        return attention

    def _kernel_attention(self, pos_b: torch.Tensor):
        """The same attention by Molt's kernel: row b over its slot's first pos_b[b] positions, then its own key."""

        def attention(layer_idx: int, q_nhd, k_nkd, v_nkd) -> torch.Tensor:
            k_cache, v_cache = self.k[layer_idx], self.v[layer_idx]
            return kernels.decode_attention(q_nhd, k_cache, v_cache, self.slots_b, pos_b, k_nkd, v_nkd)

        return attention


def decode_logits(model: Transformer, ids_1n, pos_1n, k, v, slots_b, key_pos_s, own_attention: bool):
    """(logits [B, V], new keys and values [L, B, kv_heads, D]) of one decode step over cache rows `slots_b`
    and cached positions `key_pos_s` (0..S-1)."""
    backend = DecodeOverCache(k, v, slots_b, key_pos_s, own_attention)
    hidden_nh = model(ids_1n, pos_1n, cache=backend, return_hidden=True)[0]
    return model.lm_head(hidden_nh), torch.stack(backend.new_k), torch.stack(backend.new_v)


class CompiledDecode:
    """The compiled step of a `ModelRunner` (its model, cache, packs and attention choice)."""

    def __init__(self, runner: SlotRunner):
        self.runner = runner
        # no guards on the model's modules (its weights load in place; shapes and types never change); in bf16 /
        # fp16, fused ops round where the eager (trainer's) model rounds (docs/engine.md)
        options = {
            "cpp_wrapper": True,
            "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe,
            "emulate_precision_casts": True,
        }
        self.fn = torch.compile(decode_logits, fullgraph=True, options=options)

    def accepts(self, decode: list[tuple[int, int, int]], positions: list[int]) -> bool:
        """A cached length >= 2 (a length of 0 or 1 would be compiled again), and slots 0..B-1 unless Molt's
        kernel attends (it takes each row's slot)."""
        if not decode or max(positions) < 2:
            return False
        return self.runner.own_attention or decode[-1][0] == len(decode) - 1

    def step(self, ids: list[int], positions: list[int], slots: list[int]) -> torch.Tensor:
        """Logits [B, V] of decode rows (token id, position, slot), their new keys and values stored. One row
        runs as two: the copy reads the same slot (or, over a view of rows 0..1, cache row 1: a slot or the
        scratch row); its logits and new keys are dropped."""
        r, rows = self.runner, len(ids)
        if rows == 1:
            ids, positions, slots = ids * 2, positions * 2, slots * 2
        pos_1n = to_device([positions], torch.long, r.device)
        ids_1n = to_device([ids], torch.long, r.device)
        slots_n = to_device(slots, torch.long, r.device)
        key_pos_s = torch.arange(max(positions), device=r.device)
        inputs = [(ids_1n, 1), (pos_1n, 1), (slots_n, 0), (key_pos_s, 0)]
        for x, dim in [*inputs, (r.k, 1), (r.k, 3), (r.v, 1), (r.v, 3)]:  # one graph for all sizes
            torch._dynamo.mark_dynamic(x, dim)
        with r.packs.active(tracing=True):
            logits_nv, k_lnkd, v_lnkd = self.fn(r.model, ids_1n, pos_1n, r.k, r.v, slots_n, key_pos_s, r.own_attention)
        pos_n1, slots_n1 = pos_1n[0, :rows, None], slots_n[:rows, None]
        heads_1k = torch.arange(r.kv_heads, device=r.device)[None, :]
        r.k[:, slots_n1, heads_1k, pos_n1] = k_lnkd[:, :rows]
        r.v[:, slots_n1, heads_1k, pos_n1] = v_lnkd[:, :rows]
        return logits_nv[:rows]

    def warm_up(self) -> bool:
        """Compile now (on the calling thread, before serving) rather than on first use; False if it failed."""
        if self.runner.max_seq_len < 4:
            return True
        log.info("compiling the engine's decode step (torch.compile)")
        try:
            with torch.inference_mode():
                self.step([0, 0], [3, 2], [0, 1])  # 2 rows, 3 positions: sizes that equal nothing else
        except Exception:  # noqa: BLE001 - e.g. no C++ compiler: decode stays eager
            log.exception("torch.compile of the decode step failed; decoding eagerly")
            return False
        return True
