"""The model runner: Molt's own `Transformer` over a preallocated slot KV cache.

Owns the cache `k`/`v` [layers, num_slots + 1, kv_heads, max_seq_len, head_dim] (one spare row for swaps) and
the cache backend the model calls (`MixedStep`). A step is ONE forward over a single packed row of tokens: one
decode token per decoding sequence, then the prefill chunks back to back, unpadded, so every linear layer runs
one matmul over exactly the step's tokens. Only attention knows whose token is whose:

- on CPU in fp32, every token attends over its slot's cache up to its own position through Molt's kernel;
- elsewhere, through SDPA in the model's dtype: decode tokens over a *view* of the cache when they occupy rows
  0..D-1 (the usual case: active slots are contiguous, `cache.py`), prefill tokens scattered into a padded
  [chunks, width] layout for causal attention over their slot's cache, then gathered back.

With `compile`, decode-only steps run one `torch.compile`d graph (`compiled.py`). On CPU, linear layers use
packed weights during the runner's own forward (`cpu/packed.py`). For MoE models the runner also keeps each
computed token's expert ids in `routes`, laid out and moved like the KV, so a reused prefix or a sibling's
shared prompt carries the routing its KV was computed under. Knows nothing of requests, sampling or scheduling."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from molt.engine.cache import SCRATCH, Move
from molt.engine.compiled import CompiledDecode
from molt.engine.cpu import kernels
from molt.engine.cpu.packed import LinearPacks
from molt.engine.transfer import to_device
from molt.models.moe import NO_ROUTE, Routing
from molt.models.transformer import Transformer

log = logging.getLogger(__name__)


# attention reads the cache in whole tiles of positions (masked past each row's own), as the paged cache reads
# its blocks: a bf16 / fp16 kernel then sums a query's keys in the order it does over the trainer's rows (CPU
# SDPA summed them in another order when the key count ended a few positions past the query; measured per decode
# step in bf16, mean max |log-prob diff| to the trainer's forward 1.8e-2 -> 1.3e-3, exact on most rows); low
# precision only: in fp32 the tiles made the default CPU job's rollouts ~20% slower (683 vs 475-524 tok/s)
KV_TILE = 16


def padded_attention(q_nhd: torch.Tensor, k_rksd: torch.Tensor, v_rksd: torch.Tensor, flat_n, width: int, visible_r1ts):
    """Packed queries `q_nhd` as R rows of `width` (query n at `flat_n[n]`), each over its keys where `visible_r1ts`
    (bool), with grouped kv heads (q head h uses kv head h // group); back to [N, H, D].

    Keys are not repeated per group: the group's queries are stacked along the query axis instead. SDPA in the
    inputs' dtype (fp32 accumulation in its kernels, as in the trainer's packed forward)."""
    rows, (h, d) = k_rksd.shape[0], q_nhd.shape[1:]
    group = h // k_rksd.shape[1]
    q_pad = q_nhd.new_zeros(rows * width, h, d)
    q_pad[flat_n] = q_nhd
    q_rkqd = q_pad.view(rows, width, h, d).transpose(1, 2).reshape(rows, -1, group * width, d)
    mask_r1qs = visible_r1ts.repeat(1, 1, group, 1) if group > 1 else visible_r1ts
    out_rhtd = F.scaled_dot_product_attention(q_rkqd, k_rksd, v_rksd, attn_mask=mask_r1qs).view(rows, h, width, d)
    return out_rhtd.transpose(1, 2).reshape(rows * width, h, d)[flat_n]


def writing_attend(k: torch.Tensor, v: torch.Tensor, write_n: torch.Tensor, head_stride: int, attention):
    """The model's `attend(layer_idx, q, k, v)` over caches `k`/`v` [layers, ...]: stores token n's new key and value
    of kv head h at row `write_n[n] + h * head_stride` of the layer's cache flattened to [-1, head_dim], then returns
    `attention(k_cache, v_cache, q_nhd)`."""
    head_dim = k.shape[-1]
    write_nk = (write_n[:, None] + torch.arange(k.shape[2], device=write_n.device) * head_stride).view(-1)

    def attend(layer_idx: int, q_1hnd, k_1knd, v_1knd) -> torch.Tensor:
        k_cache, v_cache = k[layer_idx], v[layer_idx]
        q_nhd, k_nkd, v_nkd = q_1hnd[0].transpose(0, 1), k_1knd[0].transpose(0, 1), v_1knd[0].transpose(0, 1)
        k_cache.view(-1, head_dim).index_copy_(0, write_nk, k_nkd.reshape(-1, head_dim))
        v_cache.view(-1, head_dim).index_copy_(0, write_nk, v_nkd.reshape(-1, head_dim))
        return attention(k_cache, v_cache, q_nhd).transpose(0, 1)[None]

    return attend


@dataclass
class Prepared:
    """A cache backend whose `attend` was built before the forward (from none of its position ids)."""

    attend: Callable

    def prepare(self, position_ids_bt: torch.Tensor) -> Callable:
        return self.attend


def joined_attention(spans: list[tuple[Callable, int, int]]):
    """`attention(k_cache, v_cache, q_nhd)` over consecutive query rows [start, end), each span by its own function."""

    def attention(k_cache, v_cache, q_nhd) -> torch.Tensor:
        outs = [att(k_cache, v_cache, q_nhd[a:b]) for att, a, b in spans]
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    return attention


def gathered_attention(rows: list[tuple[int, int, int]], tables, block_size: int, kv_heads: int, span: int, device):
    """`attention(k_cache, v_cache, q_nhd)` of packed rows (slot, start, length) padded to [R, width] queries, each
    causal over its first `span` cache positions, gathered through its block table `tables[slot]` (blocks of
    `block_size` positions; in the slot cache one block, the slot) straight into SDPA's [R, kv_heads, span, d]."""
    width, num_blocks = max(n for _, _, n in rows), -(-span // block_size)
    table_rb = to_device([(tables[slot] + [0] * num_blocks)[:num_blocks] for slot, _, _ in rows], torch.long, device)
    flat_n = to_device([i * width + j for i, (_, _, n) in enumerate(rows) for j in range(n)], torch.long, device)
    pos_rt = to_device(
        [[start + min(j, n - 1) for j in range(width)] for _, start, n in rows], torch.long, device
    )  # padding repeats the row's last query (dropped afterwards)
    key_pos_s = torch.arange(span, device=device)
    visible_r1ts = (key_pos_s[None, None, :] <= pos_rt[:, :, None])[:, None]
    # rows of the flat cache [blocks * kv_heads * block_size, head_dim] holding each row's keys, in order
    block_rs = table_rb.repeat_interleave(block_size, dim=1)[:, :span]
    heads_k = torch.arange(kv_heads, device=device)
    gather_n = (block_rs[:, None, :] * kv_heads + heads_k[None, :, None]) * block_size + key_pos_s % block_size
    gather_n = gather_n.view(-1)

    def attend(k_cache, v_cache, q_nhd) -> torch.Tensor:
        head_dim = k_cache.shape[-1]
        keys = k_cache.view(-1, head_dim).index_select(0, gather_n).view(len(rows), kv_heads, -1, head_dim)
        values = v_cache.view(-1, head_dim).index_select(0, gather_n).view(len(rows), kv_heads, -1, head_dim)
        return padded_attention(q_nhd, keys, values, flat_n, width, visible_r1ts)

    return attend


def sampled_logits(model: Transformer, hidden_nh: torch.Tensor, num_decode: int, chunks, sampled_chunks: list[int]):
    """Logits of the decode rows, then of each sampled chunk's last token: the LM head runs only where one samples."""
    if chunks:
        ends = list(itertools.accumulate((len(c) for _, c, _ in chunks), initial=num_decode))
        rows = list(range(num_decode)) + [ends[i + 1] - 1 for i in sampled_chunks]
        hidden_nh = hidden_nh.index_select(0, to_device(rows, torch.long, hidden_nh.device))
    return model.lm_head(hidden_nh)


class MixedStep:
    """Cache backend for one packed row: `num_decode` decode tokens, then prefill chunks.

    `decode_slots` are the decode rows' cache rows, `chunks` (slot, start, length) the prefill chunks, `kv_lens`
    the number of cache positions the decode rows and the chunks attend over (the longest sequence of each, not
    the capacity)."""

    def __init__(self, runner: ModelRunner, decode_slots, chunks: list[tuple[int, int, int]], kv_lens: tuple[int, int]):
        self.runner, self.decode_slots, self.chunks, self.kv_lens = runner, decode_slots, chunks, kv_lens

    def prepare(self, position_ids_bt: torch.Tensor):
        r, pos_n, num_decode = self.runner, position_ids_bt[0], len(self.decode_slots)
        chunk_rows = [slot for slot, _, n in self.chunks for _ in range(n)]
        slots_n = to_device(self.decode_slots + chunk_rows, torch.long, pos_n.device)
        # every new key/value is one row of the flattened cache [slots * kv_heads * max_seq_len, head_dim]
        write_n = slots_n * (r.kv_heads * r.max_seq_len) + pos_n
        if r.own_attention:  # Molt's kernel: every token, decode or prefill, over its slot's first pos + 1 keys
            lens_n = pos_n + 1
            attention = lambda k, v, q_nhd: kernels.decode_attention(q_nhd, k, v, slots_n, lens_n)  # noqa: E731
        else:  # torch ops (GPU, other dtypes): the decode rows' and the prefill chunks' apart, joined
            spans = [(self._decode_attention(pos_n[:num_decode]), 0, num_decode)] if num_decode else []
            if self.chunks:  # the slot cache read as one block of max_seq_len positions per slot
                tables, span = {slot: [slot] for slot, _, _ in self.chunks}, self.kv_lens[1]
                prefill = gathered_attention(self.chunks, tables, r.max_seq_len, r.kv_heads, span, pos_n.device)
                spans.append((prefill, num_decode, len(pos_n)))
            attention = joined_attention(spans)
        return writing_attend(r.k, r.v, write_n, r.max_seq_len, attention)

    def _decode_attention(self, pos_b: torch.Tensor):
        """One query per decode row over its slot's cache (SDPA batched over rows and kv heads, the head group's
        queries stacked) over a view of cache rows 0..B-1 when those are the rows (else a gather)."""
        slots, rows = self.decode_slots, len(self.decode_slots)
        r, device, kv_len = self.runner, pos_b.device, self.kv_lens[0]
        contiguous = slots[-1] == rows - 1
        slots_b = None if contiguous else to_device(slots, torch.long, device)
        visible_b11s = (torch.arange(kv_len, device=device)[None, :] <= pos_b[:, None])[:, None, None]

        def attend(k_cache, v_cache, q_bhd) -> torch.Tensor:
            keys, values = k_cache[:rows, :, :kv_len], v_cache[:rows, :, :kv_len]
            if not contiguous:
                keys = k_cache[:, :, :kv_len].index_select(0, slots_b)
                values = v_cache[:, :, :kv_len].index_select(0, slots_b)
            q_bkgd = q_bhd.reshape(rows, r.kv_heads, -1, r.head_dim)
            out_bkgd = F.scaled_dot_product_attention(q_bkgd, keys, values, attn_mask=visible_b11s)
            return out_bkgd.reshape(q_bhd.shape)

        return attend


class ModelRunner:
    """Runs one packed decode + prefill forward of `model` against the slot cache; applies cache moves.

    `compile`: decode-only steps of a dense text model run through `CompiledDecode` (one graph for every
    batch); other steps run eagerly."""

    def __init__(
        self, model: Transformer, num_slots: int, max_seq_len: int, record_routing: bool = True, compile: bool = False
    ):
        cfg = model.cfg
        self.model = model.eval()
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.num_slots, self.max_seq_len = num_slots, max_seq_len
        self.kv_heads, self.head_dim = cfg.num_kv_heads, cfg.head_dim
        shape = (cfg.num_layers, num_slots + 1, cfg.num_kv_heads, max_seq_len, cfg.head_dim)
        self.k, self.v = (torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(2))
        self.routes = None  # MoE: [num_slots + 1, max_seq_len, MoE layers, k] expert ids
        if record_routing and cfg.num_moe_layers():
            shape = (num_slots + 1, max_seq_len, cfg.num_moe_layers(), cfg.num_experts_per_tok)
            self.routes = torch.full(shape, NO_ROUTE, dtype=torch.int16, device=self.device)
        self.packs = LinearPacks(model)
        self.own_attention = kernels.usable(self.k)  # Molt's decode-attention kernel (CPU, fp32)
        self.compiled = None
        if compile and (cfg.num_moe_layers() or cfg.image_token_id is not None):
            log.warning("compile: only dense text models compile their decode step; this one decodes eagerly")
        elif compile:
            self.compiled = CompiledDecode(self)

    @torch.inference_mode()
    def forward(
        self,
        decode: list[tuple[int, int, int]],
        chunks: list[tuple[int, list[int], int]],
        sampled_chunks: list[int],
        image_embeds_nh: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits [D + S, V]: each (slot, token id, position) decode row, then each sampled chunk's last token.

        `chunks` are (slot, token ids, start position); `sampled_chunks` (increasing) indexes those
        whose last token's logits are wanted. Decode slots must be in increasing order. `image_embeds_nh`:
        one row per image placeholder token of the chunks, in order (VLMs)."""
        ids = [token for _, token, _ in decode]
        positions = [pos for _, _, pos in decode]
        if self.compiled is not None and not chunks and self.compiled.accepts(decode, positions):
            return self.compiled.step(ids, positions, [slot for slot, _, _ in decode])
        for _, chunk_ids, start in chunks:
            ids += chunk_ids
            positions += range(start, start + len(chunk_ids))
        ids_1n = to_device([ids], torch.long, self.device)
        pos_1n = to_device([positions], torch.long, self.device)
        kv_lens = (max(positions[: len(decode)], default=0) + 1, max((s + len(c) for _, c, s in chunks), default=0))
        if self.dtype != torch.float32:  # fp32 sums agree without tiles; reading them costs the CPU default ~20%
            kv_lens = tuple(min(-(-n // KV_TILE) * KV_TILE, self.max_seq_len) for n in kv_lens)
        backend = MixedStep(self, [s for s, _, _ in decode], [(s, start, len(c)) for s, c, start in chunks], kv_lens)
        routing = Routing() if self.routes is not None else None
        with self.packs.active():
            hidden_nh = self.model(
                ids_1n, pos_1n, cache=backend, return_hidden=True, routing=routing, image_embeds_nh=image_embeds_nh
            )[0]
            if routing is not None:
                slots = [s for s, _, _ in decode] + [s for s, c, _ in chunks for _ in c]
                self._record(routing, slots, positions)
            return sampled_logits(self.model, hidden_nh, len(decode), chunks, sampled_chunks)

    def warm_up(self) -> None:
        """Compile the decode step now (on the calling thread, before serving) rather than on first use."""
        if self.compiled is not None and not self.compiled.warm_up():
            self.compiled = None

    def _record(self, routing: Routing, slots: list[int], positions: list[int]) -> None:
        """Store each computed token's experts next to its KV: routes[slot, position] = [L, k] ids."""
        rows_n = to_device(
            [s * self.max_seq_len + p for s, p in zip(slots, positions, strict=True)], torch.long, self.device
        )
        flat = self.routes.view(-1, *self.routes.shape[2:])
        flat.index_copy_(0, rows_n, routing.chosen_nlk().to(flat.dtype))

    def read_routing(self, slot: int, num_computed: int, length: int) -> torch.Tensor:
        """[length, L, k] experts of a slot's computed positions (NO_ROUTE beyond `num_computed`), on CPU."""
        out = torch.full((length, *self.routes.shape[2:]), NO_ROUTE, dtype=self.routes.dtype)
        out[:num_computed] = self.routes[slot, :num_computed].cpu()
        return out

    @torch.inference_mode()
    def apply_moves(self, moves: list[Move]) -> None:
        """Apply the cache manager's relocations (in order) as one gather and one scatter per tensor.

        Each move copies positions [0, length) and makes exactly those valid in `dst`, so composing the list gives every
        changed row an (original row, valid length); rows are then copied from the pre-move cache at once. Positions
        past a row's valid length may take other rows' content: they are never read before being computed."""
        origin: dict[int, tuple[int, int]] = {}
        for move in moves:
            src, n = origin.get(move.src, (move.src, move.length))
            origin[move.dst] = (src, min(n, move.length))
        changed = [(dst, src) for dst, (src, n) in origin.items() if dst != SCRATCH and src != dst and n > 0]
        if not changed:
            return
        length = max(origin[dst][1] for dst, _ in changed)
        row = lambda slot: self.num_slots if slot == SCRATCH else slot  # noqa: E731
        dst_r = to_device([row(d) for d, _ in changed], torch.long, self.device)
        src_r = to_device([row(s) for _, s in changed], torch.long, self.device)
        for cache in (self.k, self.v):  # [L, slot, kv head, position, dim]
            cache[:, dst_r, :, :length] = cache[:, src_r, :, :length]
        if self.routes is not None:  # routing travels with the KV it produced (prefix reuse, siblings)
            self.routes[dst_r, :length] = self.routes[src_r, :length]
