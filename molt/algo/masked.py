"""Masked tensor primitives shared by the algorithms: reductions, whitening, log-ratios, scans.

Layout: `[B, T]` tensors, one row per sample (segment), `mask_bt` 1 on action tokens (any dtype;
nonzero = action). Positions outside the mask never influence a result, even when they hold
NaN/inf: selection uses `torch.where`, never multiplication by the mask. No loops over samples
or tokens; the reverse scan takes log2(T) vectorised steps."""

from __future__ import annotations

import torch
from torch import Tensor

LOG_RATIO_LIMIT = 30.0  # |log ratio| cap before exp(): e^30 ~ 1e13 stays finite in fp32


def masked_sum(x_bt: Tensor, mask_bt: Tensor, dim: int | None = None) -> Tensor:
    """Sum of `x` over action positions (all, or along `dim`)."""
    kept = torch.where(mask_bt.bool(), x_bt, 0.0)
    return kept.sum() if dim is None else kept.sum(dim)


def masked_mean(x_bt: Tensor, mask_bt: Tensor) -> Tensor:
    """Mean of `x` over action positions; 0 when there are none."""
    return masked_sum(x_bt, mask_bt) / mask_bt.bool().sum().clamp_min(1).to(x_bt.dtype)


def masked_whiten(x_bt: Tensor, mask_bt: Tensor, eps: float = 1e-8) -> Tensor:
    """(x - mean) / std over all action tokens (population std, floored at sqrt(eps)); 0 off-mask."""
    mean = masked_mean(x_bt, mask_bt)
    var = masked_mean((x_bt - mean) ** 2, mask_bt)
    white = (x_bt - mean) * torch.rsqrt(var.clamp_min(eps))
    return torch.where(mask_bt.bool(), white, 0.0)


def sanitized_log_ratio(logp_bt: Tensor, base_logp_bt: Tensor, mask_bt: Tensor) -> tuple[Tensor, Tensor]:
    """`(logp - base, valid)`: zero where masked out or non-finite; `valid` marks usable action tokens.

    A non-finite log-ratio at an action token is a numerical failure upstream; such a token is
    dropped (0, no gradient) rather than clamped to e^±30, and callers count it."""
    diff_bt = logp_bt - base_logp_bt
    valid_bt = mask_bt.bool() & torch.isfinite(diff_bt)
    return torch.where(valid_bt, diff_bt, 0.0).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT), valid_bt


def finite_log_ratio(logp_bt: Tensor, base_logp_bt: Tensor, mask_bt: Tensor) -> Tensor:
    """`logp - base` with NaN -> 0, +-inf -> +-30, and 0 off-mask (reference rule); finite values are kept."""
    diff_bt = torch.nan_to_num(logp_bt - base_logp_bt, nan=0.0, posinf=LOG_RATIO_LIMIT, neginf=-LOG_RATIO_LIMIT)
    return torch.where(mask_bt.bool(), diff_bt, 0.0)


def clamped_log_ratio(logp_bt: Tensor, base_logp_bt: Tensor, mask_bt: Tensor) -> Tensor:
    """`finite_log_ratio` clamped to +-30, for an exp() of it."""
    return finite_log_ratio(logp_bt, base_logp_bt, mask_bt).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)


def _shift_left(x_bt: Tensor, shift: int) -> Tensor:
    """x[:, t + shift], zero past the end."""
    return torch.nn.functional.pad(x_bt[:, shift:], (0, shift))


def reverse_linear_scan(b_bt: Tensor, a_bt: Tensor) -> Tensor:
    """Solve `x_t = b_t + a_t * x_{t+1}` with `x_T = 0` along dim 1 (discounted reverse cumsum).

    Hillis-Steele doubling: after k steps each position holds the composition of the next 2^k
    terms, so T tokens take ceil(log2 T) vectorised steps. Stable: only products of `a` appear."""
    x_bt, a_bt = b_bt, a_bt.to(b_bt.dtype)
    shift = 1
    while shift < x_bt.shape[1]:
        x_bt = x_bt + a_bt * _shift_left(x_bt, shift)
        a_bt = a_bt * _shift_left(a_bt, shift)
        shift *= 2
    return x_bt


def last_action_index(mask_bt: Tensor) -> tuple[Tensor, Tensor]:
    """`(index_b, has_action_b)`: position of each row's last action token (0 if none)."""
    mask = mask_bt.bool()
    from_end_b = torch.flip(mask, dims=[1]).to(torch.uint8).argmax(dim=1)
    has_action_b = mask.any(dim=1)
    return torch.where(has_action_b, mask.shape[1] - 1 - from_end_b, 0), has_action_b


def next_action_index(mask_bt: Tensor) -> Tensor:
    """For each position, the index of the next action token strictly after it (T if none)."""
    num_t = mask_bt.shape[1]
    action_pos_bt = torch.where(mask_bt.bool(), torch.arange(num_t, device=mask_bt.device), num_t)
    after_bt = torch.nn.functional.pad(action_pos_bt[:, 1:], (0, 1), value=num_t)  # T past the end
    return torch.flip(torch.cummin(torch.flip(after_bt, dims=[1]), dim=1).values, dims=[1])
