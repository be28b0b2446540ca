"""One micro-batch's training loss, composed from the registered pieces.

    loss = agg(w * surrogate(logp, old, A))
         + kl_loss_coef * token-mean(k(logp, ref)) - entropy_coef * token-mean(H)

`w` is the train/rollout IS weight (`correction`), the surrogate is clipped against the proximal
policy `old_logp_bt` (defaults to `logp_bt.detach()`, i.e. strictly on-policy), and every term
uses the step denominators so micro-batch losses sum to the full-step loss. Knows nothing about
models or the trainer: it takes [B, T] tensors and returns a scalar and metrics."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from molt.algo.aggregation import AGGREGATIONS, StepDenominators, aggregate
from molt.algo.correction import ISCorrectionParams, is_correction
from molt.algo.kl import KL_ESTIMATORS, kl_estimate
from molt.algo.masked import masked_mean
from molt.algo.policy_loss import POLICY_LOSSES, SurrogateParams

Metrics = dict[str, Tensor]


@dataclass
class PolicyBatch:
    """One micro-batch, padded [B, T]; position t holds the log-prob of token t (0 off the mask is fine)."""

    logp_bt: Tensor  # current policy, with grad
    mask_bt: Tensor  # 1 on action tokens
    advantages_bt: Tensor
    old_logp_bt: Tensor | None = None  # proximal policy (trainer before the update); None = logp.detach()
    rollout_logp_bt: Tensor | None = None  # behaviour policy (rollout engine)
    ref_logp_bt: Tensor | None = None  # reference policy (KL loss)
    entropy_bt: Tensor | None = None  # per-token entropy (with grad if entropy_coef != 0)
    group_ids_b: Tensor | None = None  # prompt-mean-token-mean


@dataclass(frozen=True)
class ObjectiveParams:
    policy_loss: str = "ppo"
    loss_agg: str = "token-mean"
    surrogate: SurrogateParams = field(default_factory=SurrogateParams)
    is_correction: ISCorrectionParams = field(default_factory=ISCorrectionParams)
    kl_estimator: str = "k3"
    kl_loss_coef: float = 0.0  # > 0 adds the KL to the reference as a loss term
    entropy_coef: float = 0.0
    norm_len: float | None = None  # seq-mean-token-sum-norm constant

    def __post_init__(self) -> None:
        POLICY_LOSSES.get(self.policy_loss)
        AGGREGATIONS.get(self.loss_agg)
        KL_ESTIMATORS.get(self.kl_estimator)


def policy_objective(batch: PolicyBatch, denoms: StepDenominators, params: ObjectiveParams) -> tuple[Tensor, Metrics]:
    """`(loss, metrics)` for one micro-batch; call `.backward()` on each and step once per window."""
    mask_bt = batch.mask_bt
    old_logp_bt = batch.logp_bt.detach() if batch.old_logp_bt is None else batch.old_logp_bt
    surrogate = POLICY_LOSSES.get(params.policy_loss)
    loss_bt, metrics = surrogate(batch.logp_bt, old_logp_bt, batch.advantages_bt, mask_bt, params.surrogate)
    scored_bt = None  # the action tokens with finite inputs, where a loss of your own must be finite (a host sync)
    if POLICY_LOSSES.from_user(params.policy_loss):
        finite_bt = torch.isfinite(batch.logp_bt.detach()) & torch.isfinite(old_logp_bt)
        scored_bt = mask_bt.bool() & finite_bt & torch.isfinite(batch.advantages_bt)
    metrics = _checked_surrogate(params.policy_loss, loss_bt, metrics, mask_bt, scored_bt)
    if params.is_correction.level is not None and batch.rollout_logp_bt is None:
        raise ValueError("IS correction needs rollout_logp_bt (the rollout engine's log-probs)")
    if batch.rollout_logp_bt is not None:
        weight_bt, is_metrics = is_correction(old_logp_bt, batch.rollout_logp_bt, mask_bt, params.is_correction)
        loss_bt = loss_bt * weight_bt
        metrics |= is_metrics
    metrics["policy_loss"] = masked_mean(loss_bt.detach(), mask_bt)
    loss = aggregate(params.loss_agg, loss_bt, mask_bt, denoms, group_ids_b=batch.group_ids_b, norm_len=params.norm_len)
    if batch.ref_logp_bt is not None:
        kl_bt = kl_estimate(params.kl_estimator, batch.logp_bt, batch.ref_logp_bt, mask_bt)
        metrics["kl"] = masked_mean(kl_bt.detach(), mask_bt)
        if params.kl_loss_coef:
            loss = loss + params.kl_loss_coef * aggregate("token-mean", kl_bt, mask_bt, denoms)
    if batch.entropy_bt is not None:  # a non-finite token is dropped from the bonus, as from the surrogate
        entropy_bt = torch.where(torch.isfinite(batch.entropy_bt), batch.entropy_bt, 0.0)
        metrics["entropy"] = masked_mean(entropy_bt.detach(), mask_bt)
        if params.entropy_coef:
            loss = loss - params.entropy_coef * aggregate("token-mean", entropy_bt, mask_bt, denoms)
    return loss, {name: value.detach() for name, value in metrics.items()}


def _checked_surrogate(name: str, loss_bt: Tensor, metrics: Metrics, mask_bt: Tensor, scored_bt) -> Metrics:
    """Policy loss `name`'s metrics as 0-dim tensors, after checking that it returned a per-token float loss [B, T]
    and 0-dim metrics, and, where `scored_bt` is given (a loss of your own), finite on those tokens: a NaN there
    would skip every optimizer step, naming nothing (a float16 overflow upstream is the loss scaler's to skip)."""
    if not isinstance(loss_bt, Tensor) or loss_bt.shape != mask_bt.shape or not loss_bt.is_floating_point():
        raise POLICY_LOSSES.problem(name, f"returned a {getattr(loss_bt, 'dtype', type(loss_bt).__name__)} "
                                    f"{tuple(getattr(loss_bt, 'shape', ()))} loss: need a per-token float loss "
                                    f"[B, T] = {tuple(mask_bt.shape)}")  # fmt: skip
    if scored_bt is not None and (bad := int((~torch.isfinite(loss_bt.detach()) & scored_bt).sum())):
        raise POLICY_LOSSES.problem(name, f"returned NaN or inf on {bad} action tokens: drop the tokens it cannot "
                                    "score (loss 0 there; masked.sanitized_log_ratio)")  # fmt: skip
    if not isinstance(metrics, dict):
        raise POLICY_LOSSES.problem(name, f"returned {type(metrics).__name__} metrics: need a dict of numbers")
    checked = {}
    for key, value in metrics.items():
        value = value if isinstance(value, Tensor) else torch.as_tensor(value) if _is_number(value) else None
        if value is None or value.dim() != 0:
            shape = tuple(value.shape) if value is not None else type(metrics[key]).__name__
            raise POLICY_LOSSES.problem(name, f"returned metric {key!r} of shape {shape}: need a 0-dim number "
                                        "(e.g. masked.masked_mean of a per-token value)")  # fmt: skip
        checked[key] = value
    return checked


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
