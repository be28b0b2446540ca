"""Decode attention over the paged KV cache: one query per row, its keys and values read through its block table.

The cache of one layer is [blocks, kv_heads, block_size, head_dim]; row n's position p lives in block
`table[n, p // block_size]` at offset `p % block_size`, and row n sees positions 0..lens[n]-1. Two
implementations of the same function:

- `triton` (CUDA): one program per (row, kv head) walks the row's blocks in tiles, keeps an online softmax in
  fp32, and stacks the head group's queries into one matrix product per tile; every key and value is read
  once, straight from its block (no gather into a padded copy), and the loop bound is read on the device, so
  the kernel sits inside a captured CUDA graph (`graphs.py`) whatever the lengths;
- `torch` (anywhere; the reference): every row gathers its whole table's width and masks past its length.

Scores and softmax in fp32; the products with values in the cache's dtype, as the trainer's attention does.
Knows nothing of models, requests or scheduling."""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)


def torch_paged_decode(q_nhd, k_cache, v_cache, table_nm, lens_n, scale: float) -> torch.Tensor:
    """[N, H, D]: row n's query heads over its first lens[n] positions (gathered through `table_nm`)."""
    n, h, d = q_nhd.shape
    kv_heads = k_cache.shape[1]
    keys = k_cache[table_nm.long()].transpose(1, 2).reshape(n, kv_heads, -1, d)  # [N, kv, M * bs, D]
    values = v_cache[table_nm.long()].transpose(1, 2).reshape(n, kv_heads, -1, d)
    visible_n1s = (torch.arange(keys.shape[2], device=q_nhd.device)[None, :] < lens_n[:, None])[:, None, None]
    q_nkgd = q_nhd.reshape(n, kv_heads, h // kv_heads, d)
    out = F.scaled_dot_product_attention(q_nkgd, keys, values, attn_mask=visible_n1s, scale=scale)
    return out.reshape(n, h, d)


@functools.cache
def _triton_kernel():
    """The Triton kernel, built on first use (Triton is imported only where a CUDA engine runs it)."""
    import triton
    import triton.language as tl

    @triton.jit
    def paged_decode_kernel(
        q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, out_ptr, table_stride, scale,
        KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, PRECISION: tl.constexpr,
    ):  # fmt: skip
        row, kv_head = tl.program_id(0), tl.program_id(1)
        length = tl.load(lens_ptr + row)
        g, d = tl.arange(0, GROUP_PAD), tl.arange(0, HEAD_DIM)
        head_rows = (row * KV_HEADS * GROUP + kv_head * GROUP + g).to(tl.int64) * HEAD_DIM
        q = tl.load(q_ptr + head_rows[:, None] + d[None, :], mask=(g < GROUP)[:, None], other=0.0)
        m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
        for start in range(0, length, TILE):
            pos = start + tl.arange(0, TILE)
            live = pos < length
            block = tl.load(table_ptr + row * table_stride + pos // BLOCK_SIZE, mask=live, other=0).to(tl.int64)
            at = ((block * KV_HEADS + kv_head) * BLOCK_SIZE + pos % BLOCK_SIZE) * HEAD_DIM
            k = tl.load(k_ptr + at[:, None] + d[None, :], mask=live[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION).to(tl.float32) * scale
            s = tl.where(live[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + at[:, None] + d[None, :], mask=live[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        out = acc / l_i[:, None]
        tl.store(out_ptr + head_rows[:, None] + d[None, :], out.to(out_ptr.dtype.element_ty), mask=(g < GROUP)[:, None])

    return paged_decode_kernel


def triton_paged_decode(q_nhd, k_cache, v_cache, table_nm, lens_n, scale: float, tile: int = 64) -> torch.Tensor:
    """The same as `torch_paged_decode` by the Triton kernel (module docstring); `table_nm`, `lens_n` int32."""
    n, h, d = q_nhd.shape
    kv_heads, block_size = k_cache.shape[1], k_cache.shape[2]
    group = h // kv_heads
    q_nhd = q_nhd.contiguous()
    out = torch.empty_like(q_nhd)
    precision = "ieee" if q_nhd.dtype == torch.float32 else None  # fp32 caches get fp32 products, not tf32
    _triton_kernel()[(n, kv_heads)](
        q_nhd, k_cache, v_cache, table_nm, lens_n, out, table_nm.stride(0), scale,
        KV_HEADS=kv_heads, GROUP=group, GROUP_PAD=max(16, 1 << (group - 1).bit_length()), HEAD_DIM=d,
        BLOCK_SIZE=block_size, TILE=max(tile, block_size), PRECISION=precision,
    )  # fmt: skip
    return out


BACKEND = {"triton": True}  # set to False (and logged) if the kernel ever fails: torch ops serve from then on


def paged_decode(q_nhd, k_cache, v_cache, table_nm, lens_n, scale: float) -> torch.Tensor:
    """Decode attention over the paged cache: the Triton kernel on CUDA (head_dim a power of two >= 16), torch
    ops elsewhere or if the kernel cannot be built (first use is the graphs' warm-up, outside any capture)."""
    head_dim = q_nhd.shape[-1]
    if q_nhd.is_cuda and head_dim >= 16 and head_dim & (head_dim - 1) == 0 and BACKEND["triton"]:
        try:
            return triton_paged_decode(q_nhd, k_cache, v_cache, table_nm, lens_n, scale)
        except Exception:  # noqa: BLE001 - e.g. no Triton in this build
            log.exception("the Triton paged-attention kernel failed; decode attention runs in torch ops")
            BACKEND["triton"] = False
    return torch_paged_decode(q_nhd, k_cache, v_cache, table_nm, lens_n, scale)
