"""The algorithm library: pure, vectorised tensor functions, every variant registered by name.

Imports only torch. Layout: padded [B, T] tensors per (micro-)batch with `mask_bt` = 1 on action
tokens; per-sample tensors are [B]. See docs/algorithms.md for the formulas and their flags."""

from molt.algo.advantages import ESTIMATORS, AdvantageInputs, AdvantageParams, add_teacher_kl, compute_advantages
from molt.algo.aggregation import AGGREGATIONS, StepDenominators, aggregate, step_denominators
from molt.algo.correction import IS_LEVELS, IS_MODES, ISCorrectionParams, is_correction, level_modes
from molt.algo.filtering import (
    GROUP_FILTERS,
    FilterParams,
    RewardShapingParams,
    clip_rewards,
    filter_groups,
    mask_truncated,
    overlong_penalty,
    rollout_totals,
    shape_rewards,
)
from molt.algo.kl import (
    KL_CONTROLLERS,
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    adaptive_kl_coef,
    kl_estimate,
    make_kl_controller,
)
from molt.algo.objective import ObjectiveParams, PolicyBatch, policy_objective
from molt.algo.policy_loss import POLICY_LOSSES, SurrogateParams, value_loss
from molt.algo.routing import expert_load, load_balance_loss, load_imbalance, routing_agreement
from molt.registry import Registry

FAMILIES = (ESTIMATORS, POLICY_LOSSES, AGGREGATIONS, KL_ESTIMATORS, KL_CONTROLLERS, IS_LEVELS, IS_MODES, GROUP_FILTERS)


MOLT_NAMES = {r.kind: set(r) for r in FAMILIES}  # what Molt registers itself (at import)


def own_variants() -> list[tuple[str, str, object, dict]]:
    """(registry kind, name, variant, info) of each variant registered since Molt's own (your estimator, loss, ...):
    what another process of the run (a Ray trainer rank) registers too, with `register_own`."""
    return [(r.kind, name, r.get(name), r.info(name)) for r in FAMILIES for name in r if name not in MOLT_NAMES[r.kind]]


def register_own(variants: list[tuple[str, str, object, dict]]) -> None:
    """Register another process's `own_variants()` here (those not registered yet, e.g. by importing their module)."""
    registries = {r.kind: r for r in FAMILIES}
    for kind, name, variant, info in variants:
        if name not in registries[kind]:
            registries[kind].add(name, variant, **info)


__all__ = ["AGGREGATIONS", "ESTIMATORS", "GROUP_FILTERS", "IS_LEVELS", "IS_MODES", "KL_CONTROLLERS", "KL_ESTIMATORS",
           "POLICY_LOSSES", "FAMILIES", "AdaptiveKLController", "AdvantageInputs", "AdvantageParams", "FilterParams",
           "FixedKLController", "ISCorrectionParams", "ObjectiveParams", "PolicyBatch", "Registry",
           "RewardShapingParams", "StepDenominators", "SurrogateParams", "adaptive_kl_coef", "add_teacher_kl",
           "aggregate", "clip_rewards", "compute_advantages", "expert_load", "filter_groups", "is_correction",
           "kl_estimate", "level_modes", "load_balance_loss", "load_imbalance", "make_kl_controller", "mask_truncated",
           "overlong_penalty", "own_variants", "policy_objective", "register_own", "rollout_totals",
           "routing_agreement", "shape_rewards", "step_denominators", "value_loss"]  # fmt: skip
