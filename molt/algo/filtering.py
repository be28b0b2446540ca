"""Sample selection and reward shaping before the estimator: group filters, overlong handling, clipping.

`filter_groups` applies registered group filters (DAPO dynamic sampling) and returns a keep-mask
per sample; whole groups are kept or dropped so n-sample groups stay intact, and each rollout
counts once. The loop refills dropped groups and counts each drop under its filter's name.
`shape_rewards` is the reward pipeline the trainer runs before the estimator: the overlong penalty
on each rollout's generated length (its segments summed), then clipping (`RewardShapingParams`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from molt.algo.groups import RolloutGroups, rollout_groups, rollout_mean
from molt.registry import Registry

Metrics = dict[str, Tensor]


@dataclass(frozen=True)
class FilterParams:
    score_range: tuple[float, float] = (0.0, 1.0)  # score-range: keep groups whose mean is strictly inside


GroupFilter = Callable[[Tensor, RolloutGroups, FilterParams], Tensor]
GROUP_FILTERS: Registry[GroupFilter] = Registry(
    "group filter",
    check=lambda name, info: "'auto' is --rollout.filters' own word (the default set)" if name == "auto" else None,
    flag="rollout.filters",
    call=(("scores_r", "groups", "params"), ()),
)


@GROUP_FILTERS.register("nonfinite")
def drop_nonfinite(scores_r: Tensor, groups: RolloutGroups, params: FilterParams) -> Tensor:
    """Drop groups with any NaN/inf score."""
    return groups.group_sum((~torch.isfinite(scores_r)).to(torch.float64)) > 0


@GROUP_FILTERS.register("all-equal")
def drop_all_equal(scores_r: Tensor, groups: RolloutGroups, params: FilterParams) -> Tensor:
    """Drop groups whose scores are all equal (no learning signal for group baselines; a group of one)."""
    return groups.group_reduce(scores_r, "amax") == groups.group_reduce(scores_r, "amin")


@GROUP_FILTERS.register("score-range")
def drop_out_of_range(scores_r: Tensor, groups: RolloutGroups, params: FilterParams) -> Tensor:
    """Drop groups whose mean score is not strictly inside `params.score_range` (DAPO: keep 0 < mean < 1)."""
    low, high = params.score_range
    mean_g = groups.group_sum(scores_r) / groups.group_sizes_g.to(scores_r.dtype)
    return ~((mean_g > low) & (mean_g < high))


def filter_groups(
    scores_b: Tensor,
    group_ids_b: Tensor,
    rollout_ids_b: Tensor | None = None,
    filters: Sequence[str] = ("nonfinite", "all-equal"),
    params: FilterParams | None = None,
) -> tuple[Tensor, Metrics]:
    """`(keep_b, metrics)`: samples of groups no filter drops; `filter_<name>_frac` = groups it drops."""
    params = params or FilterParams()
    groups = rollout_groups(group_ids_b, rollout_ids_b)
    scores_r = groups.per_rollout(scores_b)
    dropped_g = torch.zeros(groups.num_groups, dtype=torch.bool, device=scores_b.device)
    metrics: Metrics = {}
    for name in filters:
        drop_g = GROUP_FILTERS.get(name)(scores_r, groups, params)
        if not (isinstance(drop_g, Tensor) and drop_g.dtype == torch.bool and drop_g.shape == dropped_g.shape):
            raise GROUP_FILTERS.problem(name, f"returned {getattr(drop_g, 'dtype', type(drop_g).__name__)} "
                                        f"{tuple(getattr(drop_g, 'shape', ()))}: need a bool [G] = "
                                        f"{tuple(dropped_g.shape)} mask, True = drop the group")  # fmt: skip
        metrics[f"filter_{name.replace('-', '_')}_frac"] = drop_g.to(torch.float32).mean()
        dropped_g |= drop_g
    metrics["filter_keep_frac"] = (~dropped_g).to(torch.float32).mean()
    return ~dropped_g[groups.sample_to_group_b], metrics


def overlong_penalty(lengths_b: Tensor, max_len: int, buffer_len: int, factor: float = 1.0) -> Tensor:
    """DAPO soft overlong punishment (<= 0), added to the reward.

    0 up to `max_len - buffer_len` tokens, then linear down to -factor at `max_len`, -factor beyond."""
    if not 0 < buffer_len <= max_len:
        raise ValueError(f"need 0 < buffer_len <= max_len, got {buffer_len}, {max_len}")
    excess_b = (max_len - buffer_len - lengths_b.to(torch.float32)) / buffer_len
    return factor * excess_b.clamp(-1.0, 0.0)


def mask_truncated(mask_bt: Tensor, truncated_b: Tensor) -> tuple[Tensor, Metrics]:
    """DAPO overlong filtering: zero the loss mask of truncated samples (they stay in group statistics)."""
    new_mask_bt = mask_bt.masked_fill(truncated_b.bool().unsqueeze(1), 0)
    return new_mask_bt, {"overlong_frac": truncated_b.to(torch.float32).mean()}


@dataclass(frozen=True)
class RewardShapingParams:
    clip: float = 0.0  # > 0: rewards clamped to [-clip, clip] after the overlong penalty
    overlong_buffer: int = 0  # > 0: DAPO soft overlong penalty over the last `overlong_buffer` tokens
    overlong_max_len: int = 0  # generated tokens at which the penalty is full (needed with a buffer)
    overlong_coef: float = 1.0  # the penalty at `overlong_max_len` and beyond

    def __post_init__(self) -> None:
        if self.clip < 0 or self.overlong_coef <= 0:
            raise ValueError(f"need clip >= 0, overlong_coef > 0, got {self.clip}, {self.overlong_coef}")
        if self.overlong_buffer and not 0 < self.overlong_buffer <= self.overlong_max_len:
            raise ValueError(
                f"need 0 < overlong_buffer <= overlong_max_len: {self.overlong_buffer}, {self.overlong_max_len}"
            )


def rollout_totals(values_b: Tensor, rollout_ids_b: Tensor | None = None) -> Tensor:
    """Per sample, the sum of `values_b` over the samples of its rollout (its segments); no ids = its own."""
    if rollout_ids_b is None:
        return values_b
    ids_r, rollout_b = torch.unique(rollout_ids_b, return_inverse=True)
    return values_b.new_zeros(len(ids_r)).index_add_(0, rollout_b, values_b)[rollout_b]


def shape_rewards(
    rewards_b: Tensor, lengths_b: Tensor, params: RewardShapingParams, rollout_ids_b: Tensor | None = None
) -> tuple[Tensor, Metrics]:
    """`(rewards_b, metrics)`: `overlong_penalty` on each rollout's generated tokens (`lengths_b` per sample,
    summed over a rollout's segments, so its segments keep one reward), then `clip_rewards` to +-clip."""
    metrics: Metrics = {}
    if params.overlong_buffer:
        lengths_b = rollout_totals(lengths_b.to(torch.float32), rollout_ids_b)
        penalty_b = overlong_penalty(lengths_b, params.overlong_max_len, params.overlong_buffer, params.overlong_coef)
        rewards_b = rewards_b + penalty_b.to(rewards_b.dtype)
        metrics["overlong_penalty_mean"] = rollout_mean(penalty_b, rollout_ids_b)
    if params.clip:
        rewards_b, clip_metrics = clip_rewards(rewards_b, -params.clip, params.clip)
        metrics |= clip_metrics
    return rewards_b, metrics


def clip_rewards(rewards_b: Tensor, low: float = -10.0, high: float = 10.0) -> tuple[Tensor, Metrics]:
    """Rewards clamped to [low, high]; `reward_clip_frac` = fraction changed (NaN passes through)."""
    clipped_b = rewards_b.clamp(low, high)
    return clipped_b, {"reward_clip_frac": ((rewards_b < low) | (rewards_b > high)).to(torch.float32).mean()}
