"""Attention backends: where the model's keys and values go and whom each query may see.

The model computes q/k/v and hands them to a backend, `attend(layer_idx, q, k, v) -> out`, prepared
once per forward from the explicit positions:

- `PackedCausal` (training / scoring): several samples may share one row ("packing"); a token sees only
  earlier tokens of its own sample (`doc_ids`) and of the shared prefix it continues (`parent_ids`).
  SDPA with a [B, 1, T, T] mask.
- `FlexPacked`: the same through FlexAttention's block mask (no T x T tensor, masked blocks skipped);
  `packed_attention` picks it on CUDA and `PackedCausal` elsewhere (FlexAttention has no CPU backward).
- `KVCache`: a contiguous per-row cache for incremental decoding (slot = position). The engine may
  bring its own (block-based) cache implementing the same `prepare` / `attend` protocol.

Nothing here knows about parallelism or RL."""

from __future__ import annotations

import functools
import warnings
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from molt.models.config import TransformerConfig


class Attend(Protocol):
    def __call__(self, layer_idx: int, q_bhtd: Tensor, k_bhtd: Tensor, v_bhtd: Tensor) -> Tensor: ...


class Cache(Protocol):
    def prepare(self, position_ids_bt: Tensor) -> Attend: ...


def sdpa(q_bhtd: Tensor, k_bhsd: Tensor, v_bhsd: Tensor, mask_btts: Tensor | None, causal: bool) -> Tensor:
    """Scaled dot-product attention with grouped-query heads (each kv head serves q_heads/kv_heads)."""
    gqa = q_bhtd.shape[1] != k_bhsd.shape[1]
    return F.scaled_dot_product_attention(q_bhtd, k_bhsd, v_bhsd, attn_mask=mask_btts, is_causal=causal, enable_gqa=gqa)


def additive_mask(visible: Tensor) -> Tensor:
    """0 where `visible`, -inf elsewhere (fp32), to add to attention scores."""
    return torch.zeros(visible.shape, dtype=torch.float32, device=visible.device).masked_fill_(~visible, float("-inf"))


def per_kv_head(mask_bs: Tensor, kv_heads: int) -> Tensor:
    """One-query rows' [B, S] mask repeated per kv head, as `bmm`s over (row, kv head) take it: [B * kv_heads, 1, S]."""
    rows, kv_len = mask_bs.shape
    return mask_bs[:, None].expand(rows, kv_heads, kv_len).reshape(rows * kv_heads, 1, kv_len)


class PackedCausal:
    """Causal attention within each packed sample; plain causal when `doc_ids_bt` is None.

    `parent_ids_bt`: per token, a doc id whose (earlier) tokens it also sees, e.g. a prompt shared by a
    group's samples; a token's own doc id means none."""

    def __init__(self, doc_ids_bt: Tensor | None = None, parent_ids_bt: Tensor | None = None):
        self.mask_b1tt, self.width = None, None
        if doc_ids_bt is not None and not bool((doc_ids_bt == 0).all()):  # one sample per row: plain causal
            t = doc_ids_bt.shape[1]
            causal_tt = torch.ones(t, t, dtype=torch.bool, device=doc_ids_bt.device).tril()
            visible_btt = doc_ids_bt[:, :, None] == doc_ids_bt[:, None, :]
            if parent_ids_bt is not None:
                visible_btt |= parent_ids_bt[:, :, None] == doc_ids_bt[:, None, :]
            self.mask_b1tt = (visible_btt & causal_tt)[:, None]

    def __call__(self, layer_idx: int, q_bhtd: Tensor, k_bhtd: Tensor, v_bhtd: Tensor) -> Tensor:
        if self.width is not None:  # selected queries of a plain causal forward: keys past the last query unused
            k_bhtd, v_bhtd = k_bhtd[:, :, : self.width], v_bhtd[:, :, : self.width]
        return sdpa(q_bhtd, k_bhtd, v_bhtd, self.mask_b1tt, causal=self.mask_b1tt is None)

    def select_queries(self, cols_bq: Tensor) -> PackedCausal:
        """The same attention for queries at columns `cols_bq` [B, Q] only (keys: every column)."""
        out = PackedCausal()
        if self.mask_b1tt is not None:
            out.mask_b1tt = take_columns(self.mask_b1tt[:, 0], cols_bq)[:, None]
        else:  # plain causal (one sample per row): a query at column c sees columns <= c
            out.width = width = int(cols_bq.max()) + 1
            out.mask_b1tt = (torch.arange(width, device=cols_bq.device) <= cols_bq[:, :, None])[:, None]
        return out


PACKED_BACKENDS = ("auto", "sdpa", "flex")


def packed_attention(
    doc_ids_bt: Tensor | None, parent_ids_bt: Tensor | None, backend: str = "auto"
) -> PackedCausal | FlexPacked:
    """The packed-attention backend: `flex` on CUDA for packed rows (`auto`), SDPA otherwise.

    One sample per row (`doc_ids_bt` all 0 or None) stays on SDPA's causal kernel under `auto`: it needs no
    mask, and `select_queries` then switches to FlexAttention on CUDA."""
    if backend not in PACKED_BACKENDS:
        raise ValueError(f"unknown packed attention backend {backend!r}; use one of {PACKED_BACKENDS}")
    if doc_ids_bt is not None and (backend == "flex" or (backend == "auto" and doc_ids_bt.device.type == "cuda")):
        return FlexPacked(doc_ids_bt, parent_ids_bt)
    return PackedCausal(doc_ids_bt, parent_ids_bt)


class FlexPacked:
    """`PackedCausal`'s visibility through FlexAttention: a block mask from the doc ids, no T x T tensor."""

    def __init__(self, doc_ids_bt: Tensor, parent_ids_bt: Tensor | None = None, cols_bq=None):
        from torch.nn.attention.flex_attention import create_block_mask

        self.doc_ids_bt, self.parent_ids_bt = doc, parent = doc_ids_bt, parent_ids_bt
        packed = not bool((doc == 0).all())
        # built here, once per forward and outside any compiled layer (a compiled layer then only reads it;
        # built lazily inside one, the first layer's graph would differ from the others'); keys: every column
        self.block_mask, cols = None, cols_bq
        if not packed and cols is None:
            return

        def visible(b, h, q_idx, kv_idx):
            q_col = cols[b, q_idx] if cols is not None else q_idx
            see = kv_idx <= q_col
            if packed:
                same = doc[b, q_col] == doc[b, kv_idx]
                if parent is not None:
                    same = same | (parent[b, q_col] == doc[b, kv_idx])
                see = see & same
            return see

        rows, kv_len = doc.shape
        q_len = cols.shape[1] if cols is not None else kv_len
        compile_mask = doc.device.type == "cuda"  # the compiled builder never evaluates the whole Q x K grid
        self.block_mask = create_block_mask(
            visible, rows, None, q_len, kv_len, device=doc.device, _compile=compile_mask
        )

    def __call__(self, layer_idx: int, q_bhtd: Tensor, k_bhtd: Tensor, v_bhtd: Tensor) -> Tensor:
        if self.block_mask is None:  # one sample per row: SDPA's causal kernel needs no mask
            return sdpa(q_bhtd, k_bhtd, v_bhtd, None, causal=True)
        gqa = q_bhtd.shape[1] != k_bhtd.shape[1]
        flex = _flex_attention("compiling" if torch.compiler.is_compiling() else q_bhtd.device.type)
        return flex(q_bhtd, k_bhtd, v_bhtd, block_mask=self.block_mask, enable_gqa=gqa, kernel_options=FLEX_OPTIONS)

    def select_queries(self, cols_bq: Tensor) -> FlexPacked:
        """The same attention for queries at columns `cols_bq` [B, Q] only (keys: every column)."""
        return FlexPacked(self.doc_ids_bt, self.parent_ids_bt, cols_bq)


# the training kernel for every query length: inductor's flex-decoding kernel (chosen for short rows without
# grad, e.g. SFT's eval pass) found no valid configuration for the tiny preset on an H200 and failed the run
FLEX_OPTIONS = {"FORCE_USE_FLEX_ATTENTION": True}


@functools.cache
def _flex_attention(device_type: str):
    """FlexAttention compiled for CUDA (eager FlexAttention materialises the scores: slow and big); on CPU its
    eager (unfused, forward-only) form, for tests; inside a compiled decoder layer (`molt.train.compile`)
    traced into the layer's graph (`device_type` "compiling"). Each forward's new mask closure is guarded by
    its code, not its identity, so it does not recompile."""
    from torch.nn.attention.flex_attention import flex_attention

    if device_type == "compiling":  # traced into the caller's graph, on any device
        return flex_attention
    if device_type == "cuda":
        return torch.compile(flex_attention)

    def eager(*args, **kwargs):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "unfused implementation": expected off CUDA
            return flex_attention(*args, **kwargs)

    return eager


def take_columns(x_bt: Tensor, cols_bq: Tensor) -> Tensor:
    """x[b, cols_bq[b, q], ...] for every row b: [B, T, ...] -> [B, Q, ...]."""
    return x_bt[torch.arange(x_bt.shape[0], device=x_bt.device)[:, None], cols_bq]


def doc_ids_from_lengths(lengths: list[list[int]], row_len: int, device: torch.device | None = None):
    """doc ids [B, row_len] and restarting position ids for rows packed with samples of `lengths`; padding after a
    row's last sample gets doc id -1 and position 0."""
    doc_ids = torch.full((len(lengths), row_len), -1, dtype=torch.long)
    positions = torch.zeros((len(lengths), row_len), dtype=torch.long)
    for row, row_lengths in enumerate(lengths):
        if sum(row_lengths) > row_len:  # before the writes, which would fail on the shape first
            raise ValueError(f"row {row}: samples of total length {sum(row_lengths)} exceed row length {row_len}")
        start = 0
        for doc, n in enumerate(row_lengths):
            doc_ids[row, start : start + n] = doc
            positions[row, start : start + n] = torch.arange(n)
            start += n
    return doc_ids.to(device), positions.to(device)


class KVCache:
    """Preallocated contiguous KV cache [layers, B, kv_heads, max_len, head_dim]; slot = position.

    A forward writes each new token's k/v at its position and attends to every slot at or before it,
    so a row's state is just "what was written at positions < p" and needs no length bookkeeping.
    Positions < 0 mark padding tokens: they write nothing and see only themselves."""

    def __init__(
        self,
        cfg: TransformerConfig,
        batch: int,
        max_len: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ):
        shape = (cfg.num_layers, batch, cfg.num_kv_heads, max_len + 1, cfg.head_dim)  # +1: scratch slot for padding
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len

    def prepare(self, position_ids_bt: Tensor) -> Attend:
        if int(position_ids_bt.max()) >= self.max_len:
            raise ValueError(f"position {int(position_ids_bt.max())} exceeds KV cache length {self.max_len}")
        visible_bts = torch.arange(self.max_len + 1, device=position_ids_bt.device) <= position_ids_bt[:, :, None]
        visible_bts[:, :, self.max_len] = position_ids_bt < 0  # padding sees only its scratch slot
        mask_b1ts = visible_bts[:, None]
        index_bhtd = torch.where(position_ids_bt < 0, self.max_len, position_ids_bt)[:, None, :, None]  # slots

        def attend(layer_idx: int, q_bhtd, k_bhtd, v_bhtd) -> Tensor:
            idx = index_bhtd.expand(-1, k_bhtd.shape[1], -1, k_bhtd.shape[3])
            self.k[layer_idx].scatter_(2, idx, k_bhtd.to(self.k.dtype))
            self.v[layer_idx].scatter_(2, idx, v_bhtd.to(self.v.dtype))
            return sdpa(q_bhtd, self.k[layer_idx], self.v[layer_idx], mask_b1ts, causal=False)

        return attend
