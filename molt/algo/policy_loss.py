"""Policy-gradient surrogates (per-token losses, not yet aggregated) and the clipped value loss.

Each surrogate in `POLICY_LOSSES` maps `(logp_bt, old_logp_bt, advantages_bt, mask_bt, params)`
to `(loss_bt, metrics)`: `loss_bt` [B, T] is zero off the mask and is aggregated by
`molt.algo.aggregation`. `old_logp_bt` is the *proximal* policy (trainer weights before this
update); the rollout (behaviour) policy enters only through `molt.algo.correction`.

Shared preprocessing: the log-ratio `logp - old` is clamped to +-30; action tokens whose
log-ratio or advantage is non-finite are dropped (loss 0, no gradient) and counted in
`nonfinite_frac`. Metrics are means over this micro-batch's action tokens."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from molt.algo.masked import masked_mean, sanitized_log_ratio
from molt.registry import Registry, bool_info

Metrics = dict[str, Tensor]


@dataclass(frozen=True)
class SurrogateParams:
    clip_low: float = 0.2  # ratio clipped below at 1 - clip_low
    clip_high: float = 0.2  # ratio clipped above at 1 + clip_high ("clip-higher" when > clip_low)
    dual_clip: float | None = None  # c > 1: for A < 0 the loss is capped at -c * A (ppo, gspo)

    def __post_init__(self) -> None:
        if not (0 <= self.clip_low <= 1 and self.clip_high >= 0):
            raise ValueError(f"need 0 <= clip_low <= 1, clip_high >= 0: {self.clip_low}, {self.clip_high}")
        if self.dual_clip is not None and self.dual_clip <= 1:
            raise ValueError(f"dual_clip must be > 1, got {self.dual_clip}")


Surrogate = Callable[[Tensor, Tensor, Tensor, Tensor, SurrogateParams], tuple[Tensor, Metrics]]
POLICY_LOSSES: Registry[Surrogate] = Registry(
    "policy loss",
    check=bool_info("pg_at_ratio_one"),
    flag="algo.policy_loss",
    call=(("logp_bt", "old_logp_bt", "advantages_bt", "mask_bt", "params"), ()),
)


def _prepare(
    logp_bt: Tensor, old_logp_bt: Tensor, advantages_bt: Tensor, mask_bt: Tensor
) -> tuple[Tensor, Tensor, Tensor, Metrics]:
    """`(log_ratio_bt, advantages_bt, valid_bt, metrics)` with invalid tokens zeroed."""
    log_ratio_bt, valid_bt = sanitized_log_ratio(logp_bt, old_logp_bt.detach(), mask_bt)
    valid_bt = valid_bt & torch.isfinite(advantages_bt)
    advantages_bt = torch.where(valid_bt, advantages_bt.detach(), 0.0)
    metrics = {
        "nonfinite_frac": masked_mean((~valid_bt).to(logp_bt.dtype), mask_bt),  # 0 without action tokens
        "policy_kl": masked_mean(-log_ratio_bt.detach(), valid_bt),  # k1 estimate of KL(old || new)
    }
    return log_ratio_bt, advantages_bt, valid_bt, metrics


def _clipped_surrogate(
    ratio_bt: Tensor, advantages_bt: Tensor, valid_bt: Tensor, params: SurrogateParams, metrics: Metrics
) -> tuple[Tensor, Metrics]:
    """-min(r A, clip(r, 1-lo, 1+hi) A), with the optional dual clip for A < 0; `metrics` plus its clip metrics."""
    unclipped_bt = ratio_bt * advantages_bt
    clipped_bt = ratio_bt.clamp(1 - params.clip_low, 1 + params.clip_high) * advantages_bt
    surrogate_bt = torch.minimum(unclipped_bt, clipped_bt)
    dual_bt = torch.zeros_like(valid_bt)
    if params.dual_clip is not None:
        floor_bt = params.dual_clip * advantages_bt
        dual_bt = (advantages_bt < 0) & (surrogate_bt < floor_bt)
        surrogate_bt = torch.where(dual_bt, floor_bt, surrogate_bt)
    return torch.where(valid_bt, -surrogate_bt, 0.0), metrics | {
        "clip_frac": masked_mean((clipped_bt < unclipped_bt).to(ratio_bt.dtype), valid_bt),
        "dual_clip_frac": masked_mean(dual_bt.to(ratio_bt.dtype), valid_bt),
        "ratio_mean": masked_mean(ratio_bt.detach(), valid_bt),
    }


@POLICY_LOSSES.register("ppo", pg_at_ratio_one=True)
def ppo(
    logp_bt: Tensor, old_logp_bt: Tensor, advantages_bt: Tensor, mask_bt: Tensor, params: SurrogateParams
) -> tuple[Tensor, Metrics]:
    """PPO clip (Schulman et al. 2017) with asymmetric clip (DAPO) and dual clip (Ye et al. 2020)."""
    log_ratio_bt, advantages_bt, valid_bt, metrics = _prepare(logp_bt, old_logp_bt, advantages_bt, mask_bt)
    return _clipped_surrogate(log_ratio_bt.exp(), advantages_bt, valid_bt, params, metrics)


@POLICY_LOSSES.register("gspo", pg_at_ratio_one=True)
def gspo(
    logp_bt: Tensor, old_logp_bt: Tensor, advantages_bt: Tensor, mask_bt: Tensor, params: SurrogateParams
) -> tuple[Tensor, Metrics]:
    """GSPO-token (Zheng et al. 2025): every token carries the sequence ratio s = exp(mean log-ratio).

    The per-token ratio is sg[s] * pi/sg[pi]: its value is s and its gradient w.r.t. logp_t is s,
    then PPO-clipped. With `seq-mean-token-mean` aggregation this is the paper's objective."""
    log_ratio_bt, advantages_bt, valid_bt, metrics = _prepare(logp_bt, old_logp_bt, advantages_bt, mask_bt)
    num_tokens_b = valid_bt.sum(dim=1).clamp_min(1).to(log_ratio_bt.dtype)
    log_seq_ratio_b1 = (log_ratio_bt.detach().sum(dim=1) / num_tokens_b).unsqueeze(1)
    ratio_bt = (log_ratio_bt - log_ratio_bt.detach() + log_seq_ratio_b1).exp()
    return _clipped_surrogate(ratio_bt, advantages_bt, valid_bt, params, metrics)


@POLICY_LOSSES.register("cispo", pg_at_ratio_one=True)
def cispo(
    logp_bt: Tensor, old_logp_bt: Tensor, advantages_bt: Tensor, mask_bt: Tensor, params: SurrogateParams
) -> tuple[Tensor, Metrics]:
    """CISPO (MiniMax-M1 2025): -sg[min(r, 1 + clip_high)] * A * logp; every token keeps a gradient.

    The gradient w.r.t. logp_t is exactly -min(r_t, 1 + clip_high) * A_t (no lower bound, as the
    paper recommends; `clip_low` is unused)."""
    log_ratio_bt, advantages_bt, valid_bt, metrics = _prepare(logp_bt, old_logp_bt, advantages_bt, mask_bt)
    ratio_bt = log_ratio_bt.detach().exp()
    weight_bt = ratio_bt.clamp(max=1 + params.clip_high)
    logp_valid_bt = torch.where(valid_bt, logp_bt, 0.0)
    metrics["clip_frac"] = masked_mean((ratio_bt > 1 + params.clip_high).to(ratio_bt.dtype), valid_bt)
    metrics["ratio_mean"] = masked_mean(ratio_bt, valid_bt)
    return torch.where(valid_bt, -weight_bt * advantages_bt * logp_valid_bt, 0.0), metrics


@POLICY_LOSSES.register("pg", pg_at_ratio_one=True)
def policy_gradient(
    logp_bt: Tensor, old_logp_bt: Tensor, advantages_bt: Tensor, mask_bt: Tensor, params: SurrogateParams
) -> tuple[Tensor, Metrics]:
    """Plain policy gradient (REINFORCE, Williams 1992): -A * logp, no ratio and no clipping."""
    _, advantages_bt, valid_bt, metrics = _prepare(logp_bt, old_logp_bt, advantages_bt, mask_bt)
    return -advantages_bt * torch.where(valid_bt, logp_bt, 0.0), metrics


def value_loss(
    values_bt: Tensor, old_values_bt: Tensor, returns_bt: Tensor, mask_bt: Tensor, clip: float | None = 0.2
) -> tuple[Tensor, Metrics]:
    """Critic loss 0.5 * max((V - R)^2, (V_old + clip(V - V_old, +-clip) - R)^2); unclipped if None."""
    mask = mask_bt.bool()  # off-mask inputs (NaN included) are selected away before any arithmetic: no NaN grads
    values_bt, old_bt, returns_bt = (torch.where(mask, x, 0.0) for x in (values_bt, old_values_bt.detach(), returns_bt))
    loss_bt = 0.5 * (values_bt - returns_bt) ** 2
    metrics: Metrics = {}
    if clip is not None:
        delta_bt = values_bt - old_bt
        clipped_bt = old_bt + delta_bt.clamp(-clip, clip)
        loss_bt = torch.maximum(loss_bt, 0.5 * (clipped_bt - returns_bt) ** 2)
        metrics["value_clip_frac"] = masked_mean((delta_bt.abs() > clip).to(values_bt.dtype), mask)
    loss_bt = torch.where(mask, loss_bt, 0.0)
    metrics["value_loss"] = masked_mean(loss_bt.detach(), mask)
    return loss_bt, {k: v.detach() for k, v in metrics.items()}
