"""Mixture-of-experts routing metrics and the load-balancing loss: pure functions of routing tensors.

Per MoE layer, `experts_nk` holds each token's k expert ids and `valid_n` marks the tokens that
count (real tokens, and for agreement only those with a recorded routing). Imports only torch."""

from __future__ import annotations

import torch


def routing_agreement(live_nk: torch.Tensor, recorded_nk: torch.Tensor, valid_n: torch.Tensor) -> tuple[float, float]:
    """(agreeing, total) token counts: tokens whose live top-k SET equals the recorded one (order ignored)."""
    same_n = (live_nk.sort(dim=-1).values == recorded_nk.to(live_nk.dtype).sort(dim=-1).values).all(dim=-1)
    return float((same_n & valid_n).sum()), float(valid_n.sum())


def expert_load(experts_nk: torch.Tensor, valid_n: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Token-expert assignments per expert [E] over the valid tokens."""
    return torch.bincount(experts_nk[valid_n].reshape(-1), minlength=num_experts).float()


def load_imbalance(load_e: torch.Tensor) -> tuple[float, float]:
    """(coefficient of variation, max / mean) of an expert load vector (0 and 1 when perfectly even)."""
    mean = load_e.mean().clamp(min=1e-9)
    return float(load_e.std(unbiased=False) / mean), float(load_e.max() / mean)


def load_balance_loss(probs_ne: torch.Tensor, experts_nk: torch.Tensor, valid_n: torch.Tensor) -> torch.Tensor:
    """Switch-Transformer auxiliary loss E * sum_e f_e * P_e over the valid tokens (1 when balanced).

    f_e: fraction of token-expert assignments that went to e (no gradient); P_e: mean router
    probability of e (the gradient path)."""
    num_experts = probs_ne.shape[-1]
    count = valid_n.sum().clamp(min=1)
    frac_e = expert_load(experts_nk, valid_n, num_experts) / (count * experts_nk.shape[-1])
    mean_prob_e = (probs_ne * valid_n[:, None]).sum(0) / count
    return num_experts * (frac_e.to(mean_prob_e.dtype) * mean_prob_e).sum()
