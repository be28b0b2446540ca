"""Advantage estimators: per-sample rewards (+ ids, per-token KL, values) -> per-token advantages.

Call `compute_advantages(name, inputs, params)` once per optimizer step on the whole step batch
(group statistics and whitening are step-global), before splitting into micro-batches. Every
estimator is registered in `ESTIMATORS` with static info: `whiten` (its default), `needs` (the
`AdvantageInputs` fields it requires), `uses_kl` (whether it consumes `kl_bt` as a reward) and `group_baseline`
(whether it compares a rollout with its group, so an all-equal group carries no signal).

Layout: `mask_bt` [B, T] is 1 on action tokens; `rewards_b`, `group_ids_b`, `rollout_ids_b` are
[B]. Outputs are [B, T], zero off the mask. `returns_bt` are the un-whitened targets (the critic's
regression target for `gae`); `advantages_bt` feed the policy loss."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from molt.algo.groups import RolloutGroups, rollout_groups, rollout_mean
from molt.algo.masked import last_action_index, masked_mean, masked_whiten, next_action_index, reverse_linear_scan
from molt.registry import Registry, bool_info

Metrics = dict[str, Tensor]


@dataclass
class AdvantageInputs:
    """What an estimator may read; each estimator says which fields it needs."""

    mask_bt: Tensor  # [B, T] 1 on action tokens
    rewards_b: Tensor | None = None  # [B] outcome reward (segments of a rollout repeat it)
    group_ids_b: Tensor | None = None  # [B] int, one id per prompt
    rollout_ids_b: Tensor | None = None  # [B] int, one id per rollout; None = each sample its own
    kl_bt: Tensor | None = None  # [B, T] per-token KL to the reference (e.g. k1 of old vs ref)
    values_bt: Tensor | None = None  # [B, T] critic values at collection time (gae)


@dataclass(frozen=True)
class AdvantageParams:
    gamma: float = 1.0  # discount per action token
    lam: float = 1.0  # GAE lambda
    kl_coef: float = 0.0  # beta for the KL-in-reward penalty (reinforce, gae, on_policy_distill)
    std_eps: float = 1e-6  # grpo: a = (r - mean) / (std + std_eps)
    whiten: bool | None = None  # None = the estimator's default (see ESTIMATORS.info(name))


Estimator = Callable[[AdvantageInputs, AdvantageParams], tuple[Tensor, Tensor, Metrics]]


def _check_info(name: str, info: dict) -> str | None:
    """What is wrong with an estimator's registered info (`needs`/`reads` name real fields, flags are bools)."""
    fields = {f.name for f in dataclasses.fields(AdvantageInputs)}
    for key, allowed in (("needs", fields), ("reads", {"gamma", "lam"})):
        if not isinstance(value := info.get(key, ()), tuple | list) or not set(value) <= allowed:
            return f"{key}={value!r} must be a tuple of names from {sorted(allowed)}"
    return bool_info("whiten", "uses_kl", "group_baseline")(name, info)


ESTIMATORS: Registry[Estimator] = Registry(
    "advantage estimator",
    required=("whiten", "needs", "uses_kl", "group_baseline"),
    check=_check_info,
    flag="algo.estimator",
    call=(("inputs", "params"), ()),
)
GroupAdvantage = Callable[[Tensor, RolloutGroups, AdvantageParams], Tensor]


def compute_advantages(
    name: str, inputs: AdvantageInputs, params: AdvantageParams | None = None
) -> tuple[Tensor, Tensor, Metrics]:
    """`(advantages_bt, returns_bt, metrics)` of the estimator registered as `name`."""
    params = params or AdvantageParams()
    estimator, info = ESTIMATORS.get(name), ESTIMATORS.info(name)
    if missing := [field for field in info["needs"] if getattr(inputs, field) is None]:
        raise ESTIMATORS.problem(name, f"needs {', '.join(missing)}")
    if inputs.kl_bt is not None and params.kl_coef != 0 and not info["uses_kl"]:
        raise ValueError(
            f"estimator {name!r} ignores a per-token KL reward; add the KL as a loss term instead "
            "(--algo.kl_coef) or pick reinforce / gae / on_policy_distill"
        )
    if inputs.rewards_b is not None and not bool(torch.isfinite(inputs.rewards_b).all()):
        raise ValueError("non-finite rewards; drop them first (filtering.filter_groups with 'nonfinite')")
    for field, source in (("values_bt", "the critic's values"), ("kl_bt", "the per-token KL (teacher or reference)")):
        if (x := getattr(inputs, field)) is not None and (bad := _nonfinite_actions(x, inputs.mask_bt)):
            raise ValueError(f"{source} are NaN or inf on {bad} action tokens (a model that diverged or overflowed)")
    advantages_bt, returns_bt, metrics = estimator(inputs, params)
    metrics = {k: torch.as_tensor(v) for k, v in metrics.items()}
    shapes = [tuple(x.shape) for x in (advantages_bt, returns_bt)] + [(k, tuple(v.shape)) for k, v in metrics.items()]
    if shapes != [tuple(inputs.mask_bt.shape)] * 2 + [(k, ()) for k in metrics]:
        raise ESTIMATORS.problem(name, f"returned shapes {shapes}: need (advantages [B, T], returns [B, T], "
                                 f"scalar metrics) with [B, T] = {tuple(inputs.mask_bt.shape)}")  # fmt: skip
    if not (advantages_bt.is_floating_point() and returns_bt.is_floating_point()):
        raise ESTIMATORS.problem(name, f"returned {advantages_bt.dtype} advantages and {returns_bt.dtype} returns: "
                                 "need float tensors")  # fmt: skip
    for what, x_bt in (("advantages", advantages_bt), ("returns", returns_bt)):
        if bad := _nonfinite_actions(x_bt, inputs.mask_bt):
            raise ESTIMATORS.problem(name, f"returned NaN or inf {what} on {bad} action tokens (the policy loss "
                                     "would silently drop them, the critic regress on them)")  # fmt: skip
    if info["whiten"] if params.whiten is None else params.whiten:
        advantages_bt = masked_whiten(advantages_bt, inputs.mask_bt)
    metrics |= advantage_stats(advantages_bt, inputs.mask_bt)
    metrics["return_mean"] = masked_mean(returns_bt, inputs.mask_bt)
    return advantages_bt, returns_bt, {k: v.detach() for k, v in metrics.items()}


def _nonfinite_actions(x_bt: Tensor, mask_bt: Tensor) -> int:
    """How many action tokens hold NaN or inf in `x_bt`."""
    return int((~torch.isfinite(x_bt) & (mask_bt > 0)).sum())


# --- group (outcome) estimators: one scalar per rollout, broadcast to its action tokens ---------


def _grouped_rewards(inputs: AdvantageInputs) -> tuple[RolloutGroups, Tensor, Metrics]:
    groups = rollout_groups(inputs.group_ids_b, inputs.rollout_ids_b)
    rewards_r = groups.per_rollout(inputs.rewards_b)
    if bool((rewards_r[groups.sample_to_rollout_b] != inputs.rewards_b).any()):
        raise ValueError("samples of one rollout (same rollout id) have different rewards")
    _, std_g = groups.group_mean_std(rewards_r)
    multi_g = groups.group_sizes_g > 1
    group_std = (std_g * multi_g).sum() / multi_g.sum().clamp_min(1)
    return groups, rewards_r, {"reward_mean": rewards_r.mean(), "group_reward_std": group_std}


def _group_estimator(name: str, whiten: bool, advantage_r: GroupAdvantage) -> None:
    """Register an outcome estimator from `advantage_r(rewards_r, groups, params) -> [R]`."""

    @ESTIMATORS.register(
        name, whiten=whiten, needs=("rewards_b", "group_ids_b"), uses_kl=False, group_baseline=True, reads=()
    )
    def estimate(inputs: AdvantageInputs, params: AdvantageParams) -> tuple[Tensor, Tensor, Metrics]:
        groups, rewards_r, metrics = _grouped_rewards(inputs)
        # in float64: a float32 mean of equal rewards may miss them by an ulp, which GRPO's std would blow up
        advantages_r = advantage_r(rewards_r.double(), groups, params).to(rewards_r.dtype)
        per_sample_b1 = advantages_r[groups.sample_to_rollout_b].unsqueeze(1)
        advantages_bt = torch.where(inputs.mask_bt.bool(), per_sample_b1, 0.0)
        return advantages_bt, advantages_bt, metrics

    estimate.__name__ = estimate.__qualname__ = name
    estimate.__doc__ = advantage_r.__doc__


def grpo_r(rewards_r: Tensor, groups: RolloutGroups, params: AdvantageParams) -> Tensor:
    """GRPO: (r - group mean) / (group sample std + std_eps); a group of one or all-equal -> 0."""
    mean_g, std_g = groups.group_mean_std(rewards_r)
    group_r = groups.rollout_to_group_r
    return (rewards_r - mean_g[group_r]) / (std_g[group_r] + params.std_eps)


def dr_grpo_r(rewards_r: Tensor, groups: RolloutGroups, params: AdvantageParams) -> Tensor:
    """Dr. GRPO: r - group mean (no std division)."""
    mean_g, _ = groups.group_mean_std(rewards_r)
    return rewards_r - mean_g[groups.rollout_to_group_r]


def rloo_r(rewards_r: Tensor, groups: RolloutGroups, params: AdvantageParams) -> Tensor:
    """RLOO: r - mean of the *other* rollouts of the group; a group of one keeps r (no baseline)."""
    sizes_r = groups.group_sizes_g[groups.rollout_to_group_r].to(rewards_r.dtype)
    others_sum_r = groups.group_sum(rewards_r)[groups.rollout_to_group_r] - rewards_r
    return rewards_r - torch.where(sizes_r > 1, others_sum_r / (sizes_r - 1).clamp_min(1), 0.0)


_group_estimator("grpo", whiten=False, advantage_r=grpo_r)
_group_estimator("dr_grpo", whiten=False, advantage_r=dr_grpo_r)
_group_estimator("rloo", whiten=False, advantage_r=rloo_r)
# REINFORCE++-baseline: Dr. GRPO's r - group mean, then whitened over the batch (by default)
_group_estimator("reinforce_baseline", whiten=True, advantage_r=dr_grpo_r)


# --- token-level estimators: one row per sample (segments are not collapsed) ------------------


def _token_rewards(inputs: AdvantageInputs, params: AdvantageParams) -> Tensor:
    """-kl_coef * kl on every action token, plus the outcome reward on each row's last action token."""
    mask = inputs.mask_bt.bool()
    dtype = inputs.rewards_b.dtype if inputs.rewards_b is not None else inputs.kl_bt.dtype
    rewards_bt = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    if inputs.rewards_b is not None:
        last_b, has_action_b = last_action_index(mask)
        outcome_b1 = torch.where(has_action_b, inputs.rewards_b.to(dtype), 0.0).unsqueeze(1)
        rewards_bt.scatter_(1, last_b.unsqueeze(1), outcome_b1)
    if inputs.kl_bt is not None:
        rewards_bt = rewards_bt - params.kl_coef * inputs.kl_bt.to(dtype)
    return torch.where(mask, rewards_bt, 0.0)


@ESTIMATORS.register(
    "reinforce", whiten=True, needs=("rewards_b",), uses_kl=True, group_baseline=False, reads=("gamma",)
)
def reinforce(inputs: AdvantageInputs, params: AdvantageParams) -> tuple[Tensor, Tensor, Metrics]:
    """REINFORCE++: discounted return of the token rewards over action tokens (`gae` with V = 0 and lambda = 1,
    observation tokens transparent); whitened by default."""
    zeros_bt = torch.zeros(inputs.mask_bt.shape, device=inputs.mask_bt.device)
    return gae(dataclasses.replace(inputs, values_bt=zeros_bt), dataclasses.replace(params, lam=1.0))


@ESTIMATORS.register(
    "gae", whiten=True, needs=("rewards_b", "values_bt"), uses_kl=True, group_baseline=False, reads=("gamma", "lam")
)
def gae(inputs: AdvantageInputs, params: AdvantageParams) -> tuple[Tensor, Tensor, Metrics]:
    """GAE(gamma, lambda) over action tokens, masked positions transparent; terminal after the last."""
    mask = inputs.mask_bt.bool()
    rewards_bt = _token_rewards(inputs, params)
    values_bt = torch.where(mask, inputs.values_bt.to(rewards_bt.dtype), 0.0)
    next_values_bt = torch.nn.functional.pad(values_bt, (0, 1)).gather(1, next_action_index(mask))  # T: terminal 0
    deltas_bt = torch.where(mask, rewards_bt + params.gamma * next_values_bt - values_bt, 0.0)
    step_bt = torch.ones_like(rewards_bt).masked_fill(mask, params.gamma * params.lam)
    advantages_bt = torch.where(mask, reverse_linear_scan(deltas_bt, step_bt), 0.0)
    returns_bt = torch.where(mask, advantages_bt + values_bt, 0.0)
    return advantages_bt, returns_bt, {"reward_mean": rollout_mean(inputs.rewards_b, inputs.rollout_ids_b)}


@ESTIMATORS.register("on_policy_distill", whiten=False, needs=("kl_bt",), uses_kl=True, group_baseline=False, reads=())
def on_policy_distill(inputs: AdvantageInputs, params: AdvantageParams) -> tuple[Tensor, Tensor, Metrics]:
    """Per-token reverse KL to the teacher as the advantage: A_t = -kl_coef * kl_t (no reward)."""
    mask = inputs.mask_bt.bool()
    advantages_bt = torch.where(mask, -params.kl_coef * inputs.kl_bt, 0.0)
    return advantages_bt, advantages_bt, {"distill_kl": masked_mean(inputs.kl_bt, mask)}


def add_teacher_kl(advantages_bt: Tensor, kl_bt: Tensor, mask_bt: Tensor, coef: float) -> tuple[Tensor, Metrics]:
    """On-policy distillation mixed into another estimator: `A_t - coef * kl_t` on action tokens, where
    `kl_t = log pi(a_t) - log teacher(a_t)` (k1 of the reverse KL to the teacher; use after whitening)."""
    mask = mask_bt.bool()
    mixed_bt = torch.where(mask, advantages_bt - coef * kl_bt.to(advantages_bt.dtype), 0.0)
    stats = {k: v.detach() for k, v in advantage_stats(mixed_bt, mask_bt).items()}  # of the advantage trained
    return mixed_bt, {"distill_kl": masked_mean(kl_bt, mask).detach(), **stats}


def advantage_stats(advantages_bt: Tensor, mask_bt: Tensor) -> Metrics:
    """`advantage_mean` and `advantage_std` over the action tokens."""
    mean = masked_mean(advantages_bt, mask_bt)
    return {"advantage_mean": mean, "advantage_std": masked_mean((advantages_bt - mean) ** 2, mask_bt).sqrt()}
