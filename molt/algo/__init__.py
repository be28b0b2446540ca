"""The algorithm library: pure, vectorised tensor functions, every variant registered by name.

Imports only torch. Layout: padded [B, T] tensors per (micro-)batch with `mask_bt` = 1 on action
tokens; per-sample tensors are [B]. See docs/algorithms.md for the formulas and their flags."""

from molt.algo.advantages import ESTIMATORS, AdvantageInputs, AdvantageParams, add_teacher_kl, compute_advantages
from molt.algo.aggregation import AGGREGATIONS, StepDenominators, aggregate, step_denominators
from molt.algo.correction import IS_LEVELS, IS_MODES, ISCorrectionParams, is_correction
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

__all__ = ["AGGREGATIONS", "ESTIMATORS", "GROUP_FILTERS", "IS_LEVELS", "IS_MODES", "KL_CONTROLLERS", "KL_ESTIMATORS",
           "POLICY_LOSSES", "AdaptiveKLController", "AdvantageInputs", "AdvantageParams", "FilterParams",
           "FixedKLController", "ISCorrectionParams", "ObjectiveParams", "PolicyBatch", "Registry",
           "RewardShapingParams", "StepDenominators", "SurrogateParams", "adaptive_kl_coef", "add_teacher_kl",
           "aggregate", "clip_rewards", "compute_advantages", "expert_load", "filter_groups", "is_correction",
           "kl_estimate", "load_balance_loss", "load_imbalance", "make_kl_controller", "mask_truncated",
           "overlong_penalty", "policy_objective", "rollout_totals", "routing_agreement", "shape_rewards",
           "step_denominators", "value_loss"]  # fmt: skip
