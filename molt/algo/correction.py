"""Train/rollout importance-sampling correction: a detached weight per token multiplying the loss.

The rollout engine (behaviour policy) and the trainer's proximal policy differ (kernels, precision,
staleness). With `rho_t = exp(old_t - rollout_t)` (log-ratio NaN -> 0, clamped to +-30), a *level*
gives the statistic `u` that is tested or bounded, and a *mode* turns it into the weight:

  level  token: u_t = rho_t      seq: u = prod_t rho_t      geo: u = (prod_t rho_t)^(1/n)
  mode   mask: w_t = rho_t if low <= u <= high else 0   (survivors keep their per-token rho)
         clip: w = clamp(u, low, high)                   trunc: w = min(u, high)

Named schemes: token/trunc = TIS, token/mask = IcePop, seq/mask = sequence-masked IS,
geo/mask = geometric-mean masked IS, seq/trunc = sequence-level TIS. `geo` is a length-normalised
filter statistic, not an importance weight, so it only takes `mask`. With the PPO surrogate clipped
against the proximal policy this is decoupled PPO: the behaviour policy enters only through `w`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from molt.algo.masked import LOG_RATIO_LIMIT, clamped_log_ratio, masked_mean
from molt.registry import Registry

Metrics = dict[str, Tensor]

Level = Callable[[Tensor, Tensor], Tensor]
Mode = Callable[[Tensor, Tensor, float, float], tuple[Tensor, Tensor]]
IS_LEVELS: Registry[Level] = Registry(
    "IS correction level",
    required=("modes",),
    check=lambda name, info: (
        None if isinstance(m := info["modes"], tuple | list) and m else f"modes={m!r} must be a tuple of IS mode names"
    ),
    flag="algo.is_level",
    call=(("log_ratio_bt", "mask_bt"), ()),
)
IS_MODES: Registry[Mode] = Registry(
    "IS correction mode", flag="algo.is_mode", call=(("ratio_bt", "stat_bt", "low", "high"), ())
)


@dataclass(frozen=True)
class ISCorrectionParams:
    level: str | None = None  # token | seq | geo; None = no correction (metrics still measured)
    mode: str = "mask"  # mask | clip | trunc
    low: float = 0.5  # band [low, high]; trunc uses only high
    high: float = 5.0

    def __post_init__(self) -> None:
        if self.level is None:
            return
        allowed = level_modes(self.level)
        IS_MODES.get(self.mode)
        if self.mode not in allowed:
            why = "; the geometric mean is a filter statistic, not a weight" if self.level == "geo" else ""
            raise ValueError(f"IS correction level {self.level!r} does not support mode {self.mode!r} "
                             f"(allowed: {', '.join(allowed)}){why}")  # fmt: skip
        if not 0 <= self.low <= 1 <= self.high:
            raise ValueError(f"IS correction band must satisfy 0 <= low <= 1 <= high, got [{self.low}, {self.high}]")


def level_modes(level: str) -> tuple[str, ...]:
    """The IS modes `level` takes: those it was registered with, then each mode registered with `levels=` naming it
    (a mode of your own: `IS_MODES.add("soft", fn, levels=("token", "seq"))`)."""
    own = tuple(IS_LEVELS.info(level)["modes"])
    return own + tuple(m for m in IS_MODES.names() if m not in own and level in IS_MODES.info(m).get("levels", ()))


@IS_LEVELS.register("token", modes=("mask", "clip", "trunc"))
def token_level(log_ratio_bt: Tensor, mask_bt: Tensor) -> Tensor:
    return log_ratio_bt


@IS_LEVELS.register("seq", modes=("mask", "clip", "trunc"))
def seq_level(log_ratio_bt: Tensor, mask_bt: Tensor) -> Tensor:
    return log_ratio_bt.sum(dim=1, keepdim=True).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)


@IS_LEVELS.register("geo", modes=("mask",))
def geo_level(log_ratio_bt: Tensor, mask_bt: Tensor) -> Tensor:
    num_tokens_b1 = mask_bt.bool().sum(dim=1, keepdim=True).clamp_min(1).to(log_ratio_bt.dtype)
    return log_ratio_bt.sum(dim=1, keepdim=True) / num_tokens_b1


@IS_MODES.register("mask")
def mask_mode(ratio_bt: Tensor, stat_bt: Tensor, low: float, high: float) -> tuple[Tensor, Tensor]:
    """(weight, rejected): zero outside the band, per-token ratio inside."""
    rejected_bt = ((stat_bt < low) | (stat_bt > high)).expand_as(ratio_bt)
    return torch.where(rejected_bt, 0.0, ratio_bt), rejected_bt


@IS_MODES.register("clip")
def clip_mode(ratio_bt: Tensor, stat_bt: Tensor, low: float, high: float) -> tuple[Tensor, Tensor]:
    """(weight, clipped): the statistic clamped into the band."""
    return stat_bt.clamp(low, high).expand_as(ratio_bt), ((stat_bt < low) | (stat_bt > high)).expand_as(ratio_bt)


@IS_MODES.register("trunc")
def trunc_mode(ratio_bt: Tensor, stat_bt: Tensor, low: float, high: float) -> tuple[Tensor, Tensor]:
    """(weight, truncated): the statistic capped at `high` (truncated IS)."""
    return stat_bt.clamp(max=high).expand_as(ratio_bt), (stat_bt > high).expand_as(ratio_bt)


def is_correction(
    old_logp_bt: Tensor, rollout_logp_bt: Tensor, mask_bt: Tensor, params: ISCorrectionParams
) -> tuple[Tensor, Metrics]:
    """`(weight_bt, metrics)`: detached weights (1 when off, 0 off the mask) and mismatch metrics.

    Metrics: `is_filter_frac` (action tokens masked, clipped or truncated), `is_weight_mean`,
    `rollout_kl` (mean of rollout - old: k1 of KL(rollout || trainer)), `logprob_diff` (mean |old - rollout|)."""
    mask = mask_bt.bool()
    log_ratio_bt = clamped_log_ratio(old_logp_bt.detach(), rollout_logp_bt.detach(), mask)
    ratio_bt = log_ratio_bt.exp()
    if params.level is None:
        weight_bt, changed_bt = torch.ones_like(ratio_bt), torch.zeros_like(mask)
    else:
        stat_bt = IS_LEVELS.get(params.level)(log_ratio_bt, mask).exp()
        weight_bt, changed_bt = IS_MODES.get(params.mode)(ratio_bt, stat_bt, params.low, params.high)
    weight_bt = torch.where(mask, weight_bt, 0.0)
    metrics = {
        "is_filter_frac": masked_mean(changed_bt.to(ratio_bt.dtype), mask),
        "is_weight_mean": masked_mean(weight_bt, mask),
        "rollout_kl": masked_mean(-log_ratio_bt, mask),
        "logprob_diff": masked_mean(log_ratio_bt.abs(), mask),
    }
    return weight_bt, metrics
