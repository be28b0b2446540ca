"""KL estimators (k1, k2, k3) between the policy and a reference, and KL-coefficient controllers.

Estimators (Schulman, "Approximating KL divergence", 2020) act per token on the log-ratio `x = logp - base_logp`
of tokens sampled from the policy (NaN -> 0, +-inf -> +-30). k2 and k3 are clamped to [0, KL_CLAMP]; k1 is not
(distillation rewards stay uncapped). Used as a reward penalty (k1 recommended) or a loss term (k2/k3).
Controllers hold the coefficient beta: `fixed`, or `adaptive` (Ziegler et al. 2019)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from molt.algo.masked import LOG_RATIO_LIMIT, finite_log_ratio
from molt.registry import Registry

KL_CLAMP = 10.0

KLEstimator = Callable[[Tensor], Tensor]
KL_ESTIMATORS: Registry[KLEstimator] = Registry("KL estimator", flag="algo.kl_estimator", call=(("log_ratio_bt",), ()))


def kl_estimate(name: str, logp_bt: Tensor, base_logp_bt: Tensor, mask_bt: Tensor) -> Tensor:
    """Per-token KL(policy || base) estimate [B, T] with estimator `name`; zero off the mask."""
    log_ratio_bt = finite_log_ratio(logp_bt, base_logp_bt, mask_bt)
    kl_bt = KL_ESTIMATORS.get(name)(log_ratio_bt)
    if not isinstance(kl_bt, Tensor) or kl_bt.shape != log_ratio_bt.shape or not kl_bt.is_floating_point():
        raise KL_ESTIMATORS.problem(name, f"returned a {getattr(kl_bt, 'dtype', type(kl_bt).__name__)} "
                                    f"{tuple(getattr(kl_bt, 'shape', ()))}: need a per-token float KL shaped like "
                                    f"its log-ratio [B, T] = {tuple(log_ratio_bt.shape)}")  # fmt: skip
    if KL_ESTIMATORS.from_user(name) and (bad := int((~torch.isfinite(kl_bt.detach()) & mask_bt.bool()).sum())):
        raise KL_ESTIMATORS.problem(name, f"returned NaN or inf on {bad} action tokens from a finite log-ratio")
    return torch.where(mask_bt.bool(), kl_bt, 0.0)


@KL_ESTIMATORS.register("k1")
def k1(log_ratio_bt: Tensor) -> Tensor:
    """x: the plain log-ratio (unbiased, can be negative)."""
    return log_ratio_bt


@KL_ESTIMATORS.register("k2")
def k2(log_ratio_bt: Tensor) -> Tensor:
    """x^2 / 2 (its gradient is the gradient of the true KL at the reference)."""
    return (0.5 * log_ratio_bt**2).clamp(max=KL_CLAMP)


@KL_ESTIMATORS.register("k3")
def k3(log_ratio_bt: Tensor) -> Tensor:
    """exp(-x) - 1 + x: unbiased, non-negative and of low variance (x clamped to +-30 first: exp(-x) stays finite)."""
    x_bt = log_ratio_bt.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    return (torch.expm1(-x_bt) + x_bt).clamp(min=0.0, max=KL_CLAMP)


KL_CONTROLLERS: Registry[Callable[..., object]] = Registry("KL controller")


@KL_CONTROLLERS.register("fixed")
@dataclass
class FixedKLController:
    """A constant coefficient."""

    coef: float

    def update(self, kl: float, num_samples: int) -> float:
        return self.coef


@KL_CONTROLLERS.register("adaptive")
@dataclass
class AdaptiveKLController:
    """beta <- beta * (1 + clip(kl / target - 1, +-0.2) * min(num_samples / horizon, 1)) (Ziegler et al. 2019; the
    cap keeps beta positive, moving it at most 20% a step)."""

    coef: float
    target: float
    horizon: int = 10000

    def __post_init__(self) -> None:
        if self.target <= 0 or self.horizon <= 0:
            raise ValueError(f"adaptive KL needs target, horizon > 0, got {self.target}, {self.horizon}")

    def update(self, kl: float, num_samples: int) -> float:
        """Update from the measured KL of the last step over `num_samples` samples; new coef."""
        self.coef = adaptive_kl_coef(self.coef, kl, self.target, num_samples, self.horizon)
        return self.coef


def adaptive_kl_coef(coef: float, kl: float, target: float, num_samples: int, horizon: int) -> float:
    """One adaptive step: coef * (1 + clip(kl / target - 1, -0.2, 0.2) * min(num_samples / horizon, 1))."""
    error = min(max(kl / target - 1.0, -0.2), 0.2)
    return coef * (1.0 + error * min(num_samples / horizon, 1.0))


def make_kl_controller(name: str, **kwargs: float) -> FixedKLController | AdaptiveKLController:
    """A controller by name, e.g. `make_kl_controller("adaptive", coef=0.05, target=6.0)`."""
    return KL_CONTROLLERS.get(name)(**kwargs)
