"""Sparse mixture-of-experts MLP (Qwen3-MoE style): softmax router, top-k, batched expert weights.

Routing is a pure function (`route`) so the engine can record expert choices and the trainer can
replay them later. Experts are stored as stacked tensors [E, ...]; tokens are grouped by expert
with one sort, then each expert with work runs two matmuls. No parallelism here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def route(logits_ne: torch.Tensor, top_k: int, normalize: bool, fp32: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [N, k], expert ids [N, k]): softmax over all experts, keep top-k, optionally renormalise."""
    probs_ne = F.softmax(logits_ne.float() if fp32 else logits_ne, dim=-1)
    weights_nk, experts_nk = probs_ne.topk(top_k, dim=-1)
    if normalize:
        weights_nk = weights_nk / weights_nk.sum(dim=-1, keepdim=True)
    return weights_nk, experts_nk


class SparseMoE(nn.Module):
    """Router + E SwiGLU experts; each token is processed by its top-k experts, gate-weighted."""

    def __init__(self, hidden: int, inner: int, num_experts: int, top_k: int, normalize: bool, fp32: bool):
        super().__init__()
        self.top_k, self.normalize, self.fp32 = top_k, normalize, fp32
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * inner, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, inner))

    def forward(self, x_bth: torch.Tensor) -> torch.Tensor:
        x_nh = x_bth.reshape(-1, x_bth.shape[-1])
        weights_nk, experts_nk = route(self.gate(x_nh), self.top_k, self.normalize, self.fp32)
        return self.mix(x_nh, weights_nk, experts_nk).view_as(x_bth)

    def mix(self, x_nh: torch.Tensor, weights_nk: torch.Tensor, experts_nk: torch.Tensor) -> torch.Tensor:
        """Weighted sum of each token's chosen experts' outputs (weights combined in fp32 if asked)."""
        num_experts = self.gate_up_proj.shape[0]
        flat_e = experts_nk.reshape(-1)
        order = flat_e.argsort(stable=True)
        token_of = order // self.top_k
        counts = torch.bincount(flat_e, minlength=num_experts).tolist()
        x_sorted = x_nh[token_of]
        outputs = []
        for e, x_e in enumerate(x_sorted.split(counts)):
            if x_e.shape[0] == 0:
                continue
            gate, up = F.linear(x_e, self.gate_up_proj[e]).chunk(2, dim=-1)
            outputs.append(F.linear(F.silu(gate) * up, self.down_proj[e]))
        y_sorted = torch.cat(outputs) if outputs else x_sorted[:0]
        combine_dtype = torch.float32 if self.fp32 else x_nh.dtype
        y_sorted = y_sorted.to(combine_dtype) * weights_nk.reshape(-1)[order, None].to(combine_dtype)
        out = torch.zeros(x_nh.shape, dtype=combine_dtype, device=x_nh.device)
        return out.index_add_(0, token_of, y_sorted).to(x_nh.dtype)
