"""Loss aggregation: per-token losses [B, T] -> one scalar, with step-global denominators.

An optimizer step may span several micro-batches (and, later, data-parallel ranks). Every mode
divides by counts taken over the *whole step* (`StepDenominators`, from `step_denominators`),
so summing the micro-batch losses (backward on each, no 1/num_micro rescale) gives exactly the
gradient of the full-batch loss. Under data parallelism the scalar counts are summed across
ranks (`StepDenominators.all_reduced`) and the trainer undoes the gradient mean over ranks.

Empty inputs are safe: a zero denominator is floored at 1, and its numerator is then 0."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from molt.algo.masked import masked_sum
from molt.registry import Registry, bool_info


@dataclass(frozen=True)
class StepDenominators:
    """Counts over all micro-batches of one optimizer step (0-dim float64 tensors)."""

    num_tokens: Tensor  # action tokens
    num_seqs: Tensor  # sequences (samples) with >= 1 action token
    num_groups: Tensor  # groups (prompts) with >= 1 action token; 0 without group ids
    group_ids_g: Tensor | None = None  # sorted group ids seen in the step
    group_tokens_g: Tensor | None = None  # action tokens per group (a group lives on one rank)

    def scalars(self) -> Tensor:
        """[3] vector (tokens, seqs, groups): what data-parallel ranks sum in one all-reduce."""
        return torch.stack([self.num_tokens, self.num_seqs, self.num_groups])

    def all_reduced(self, all_reduce_sum: Callable[[Tensor], Tensor]) -> StepDenominators:
        """Copy with the scalars replaced by `all_reduce_sum(self.scalars())` (e.g. a DP all-reduce)."""
        tokens, seqs, groups = all_reduce_sum(self.scalars().clone()).unbind()
        return replace(self, num_tokens=tokens, num_seqs=seqs, num_groups=groups)


def step_denominators(mask_bts: Sequence[Tensor], group_ids_bs: Sequence[Tensor] | None = None) -> StepDenominators:
    """Denominators for one step from the loss masks (and group ids) of all its micro-batches."""
    tokens_b = torch.cat([mask_bt.bool().sum(dim=1) for mask_bt in mask_bts]).to(torch.float64)
    num_tokens, num_seqs = tokens_b.sum(), (tokens_b > 0).sum().to(torch.float64)
    if group_ids_bs is None:
        return StepDenominators(num_tokens, num_seqs, torch.zeros((), dtype=torch.float64))
    group_ids_b = torch.cat(list(group_ids_bs))
    group_ids_g, sample_to_group_b = torch.unique(group_ids_b, return_inverse=True)
    group_tokens_g = torch.zeros(group_ids_g.numel(), dtype=torch.float64, device=tokens_b.device)
    group_tokens_g.index_add_(0, sample_to_group_b, tokens_b)
    num_groups = (group_tokens_g > 0).sum().to(torch.float64)
    return StepDenominators(num_tokens, num_seqs, num_groups, group_ids_g, group_tokens_g)


AGGREGATIONS: Registry[Callable[..., Tensor]] = Registry(
    "loss aggregation",
    check=bool_info("needs_norm_len", "needs_group_ids"),
    flag="algo.loss_agg",
    call=(("loss_bt", "mask_bt", "denoms"), ("group_ids_b", "norm_len")),
)


def aggregate(
    name: str,
    loss_bt: Tensor,
    mask_bt: Tensor,
    denoms: StepDenominators,
    *,
    group_ids_b: Tensor | None = None,
    norm_len: float | None = None,
) -> Tensor:
    """This micro-batch's share of the step loss under mode `name`."""
    fn, info = AGGREGATIONS.get(name), AGGREGATIONS.info(name)
    if info.get("needs_group_ids") and (group_ids_b is None or denoms.group_ids_g is None):
        raise ValueError(f"loss aggregation {name!r} needs group ids (here and in step_denominators)")
    if info.get("needs_norm_len") and not norm_len:
        raise ValueError(f"loss aggregation {name!r} needs norm_len (a constant, e.g. the max new tokens)")
    loss = fn(loss_bt, mask_bt, denoms, group_ids_b=group_ids_b, norm_len=norm_len)
    if not isinstance(loss, Tensor) or loss.dim() != 0:
        raise AGGREGATIONS.problem(name, f"returned {tuple(getattr(loss, 'shape', ()))}: need a scalar tensor")
    # yours (a host sync, so not for the built-ins): its own doing only from per-token losses finite on the action
    # tokens (a float16 overflow upstream is the loss scaler's to skip)
    finite = not AGGREGATIONS.from_user(name) or bool(torch.isfinite(loss.detach()))
    if not finite and bool((torch.isfinite(loss_bt.detach()) | ~mask_bt.bool()).all()):
        raise AGGREGATIONS.problem(name, f"returned {float(loss.detach())} from per-token losses finite on the "
                                   "action tokens (a division by a zero count? floor it at 1)")  # fmt: skip
    return loss


def _floor1(count: Tensor, like: Tensor) -> Tensor:
    return count.to(device=like.device, dtype=like.dtype).clamp_min(1)


@AGGREGATIONS.register("token-mean")
def token_mean(loss_bt: Tensor, mask_bt: Tensor, denoms: StepDenominators, **_: object) -> Tensor:
    """sum over action tokens / step action tokens: every token weighs the same (DAPO)."""
    return masked_sum(loss_bt, mask_bt) / _floor1(denoms.num_tokens, loss_bt)


@AGGREGATIONS.register("seq-mean-token-sum")
def seq_mean_token_sum(loss_bt: Tensor, mask_bt: Tensor, denoms: StepDenominators, **_: object) -> Tensor:
    """Per-sequence token sums, averaged over the step's sequences."""
    return masked_sum(loss_bt, mask_bt, dim=1).sum() / _floor1(denoms.num_seqs, loss_bt)


@AGGREGATIONS.register("seq-mean-token-sum-norm", needs_norm_len=True)
def seq_mean_token_sum_norm(
    loss_bt: Tensor, mask_bt: Tensor, denoms: StepDenominators, *, norm_len: float, **_: object
) -> Tensor:
    """Per-sequence token sums / a constant length, averaged over sequences (Dr. GRPO)."""
    return masked_sum(loss_bt, mask_bt, dim=1).sum() / (_floor1(denoms.num_seqs, loss_bt) * norm_len)


@AGGREGATIONS.register("seq-mean-token-mean")
def seq_mean_token_mean(loss_bt: Tensor, mask_bt: Tensor, denoms: StepDenominators, **_: object) -> Tensor:
    """Per-sequence token means, averaged over the step's sequences (GRPO paper, GSPO)."""
    tokens_b = mask_bt.bool().sum(dim=1).clamp_min(1).to(loss_bt.dtype)
    return (masked_sum(loss_bt, mask_bt, dim=1) / tokens_b).sum() / _floor1(denoms.num_seqs, loss_bt)


@AGGREGATIONS.register("prompt-mean-token-mean", needs_group_ids=True)
def prompt_mean_token_mean(
    loss_bt: Tensor, mask_bt: Tensor, denoms: StepDenominators, *, group_ids_b: Tensor, **_: object
) -> Tensor:
    """Token mean within each prompt (over the whole step), averaged over the step's prompts."""
    index_b = torch.searchsorted(denoms.group_ids_g, group_ids_b).clamp_max(denoms.group_ids_g.numel() - 1)
    if bool((denoms.group_ids_g[index_b] != group_ids_b).any()):
        raise ValueError("a group id of this micro-batch is missing from the step denominators")
    group_tokens_b = _floor1(denoms.group_tokens_g[index_b], loss_bt)
    return (masked_sum(loss_bt, mask_bt, dim=1) / group_tokens_b).sum() / _floor1(denoms.num_groups, loss_bt)
