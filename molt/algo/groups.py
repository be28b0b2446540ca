"""Group bookkeeping: samples -> rollouts -> groups, and per-group statistics, all vectorised.

A *group* is the n rollouts of one prompt (`group_ids_b`); a *rollout* may be split into several
samples (segments, `rollout_ids_b`) that share its reward. Group statistics count each rollout
once, using its first sample in batch order. Ids are arbitrary integers; rollout ids must be
unique within the batch (one rollout belongs to one group)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class RolloutGroups:
    """Index maps for one batch: B samples, R rollouts, G groups."""

    sample_to_rollout_b: Tensor  # [B] rollout row of each sample
    first_sample_r: Tensor  # [R] first sample (batch order) of each rollout
    rollout_to_group_r: Tensor  # [R] group row of each rollout
    group_sizes_g: Tensor  # [G] rollouts per group

    @property
    def sample_to_group_b(self) -> Tensor:
        return self.rollout_to_group_r[self.sample_to_rollout_b]

    @property
    def num_groups(self) -> int:
        return self.group_sizes_g.numel()

    def per_rollout(self, values_b: Tensor) -> Tensor:
        """One value per rollout: the value of its first sample."""
        return values_b[self.first_sample_r]

    def group_sum(self, values_r: Tensor) -> Tensor:
        """[G] sums of per-rollout values."""
        return values_r.new_zeros(self.num_groups).index_add_(0, self.rollout_to_group_r, values_r)

    def group_mean_std(self, values_r: Tensor) -> tuple[Tensor, Tensor]:
        """Per-group mean and *sample* (n-1) std; a group of one has std 0."""
        sizes_g = self.group_sizes_g.to(values_r.dtype)
        mean_g = self.group_sum(values_r) / sizes_g
        sq_dev_g = self.group_sum((values_r - mean_g[self.rollout_to_group_r]) ** 2)
        return mean_g, (sq_dev_g / (sizes_g - 1).clamp_min(1)).sqrt()

    def group_reduce(self, values_r: Tensor, reduce: str) -> Tensor:
        """[G] `amax` / `amin` of per-rollout values."""
        out_g = values_r.new_zeros(self.num_groups)
        return out_g.scatter_reduce_(0, self.rollout_to_group_r, values_r, reduce, include_self=False)


def rollout_groups(group_ids_b: Tensor, rollout_ids_b: Tensor | None = None) -> RolloutGroups:
    """Index maps from ids; without `rollout_ids_b` every sample is its own rollout.

    Raises ValueError when the samples of one rollout disagree on their group."""
    num_b = group_ids_b.numel()
    device = group_ids_b.device
    if rollout_ids_b is None:
        rollout_ids_b = torch.arange(num_b, device=device)
    _, sample_to_rollout_b = torch.unique(rollout_ids_b, return_inverse=True)
    num_r = int(sample_to_rollout_b.max()) + 1 if num_b else 0
    first_sample_r = torch.full((num_r,), num_b, dtype=torch.long, device=device)
    first_sample_r.scatter_reduce_(0, sample_to_rollout_b, torch.arange(num_b, device=device), "amin")
    group_r = group_ids_b[first_sample_r]
    if bool((group_r[sample_to_rollout_b] != group_ids_b).any()):
        raise ValueError("samples of one rollout (same rollout id) have different group ids")
    _, rollout_to_group_r = torch.unique(group_r, return_inverse=True)
    group_sizes_g = torch.bincount(rollout_to_group_r) if num_r else torch.zeros(0, dtype=torch.long)
    return RolloutGroups(sample_to_rollout_b, first_sample_r, rollout_to_group_r, group_sizes_g)


def rollout_mean(values_b: Tensor, rollout_ids_b: Tensor | None = None) -> Tensor:
    """Mean over rollouts of a per-sample value its segments share (each rollout counts once); no ids = per sample."""
    if rollout_ids_b is None:
        return values_b.mean()
    ids_r, rollout_b = torch.unique(rollout_ids_b, return_inverse=True)
    sums_r = values_b.new_zeros(len(ids_r)).index_add_(0, rollout_b, values_b)
    counts_r = values_b.new_zeros(len(ids_r)).index_add_(0, rollout_b, torch.ones_like(values_b))
    return (sums_r / counts_r).mean()
