"""Data parallelism for the trainer: process group, FSDP2 wrapping, batch split, full-weight gather.

`parallelize()` applies `fully_shard` to a built model from the outside (each decoder layer, then
the root; a value model's layers are its `.body`'s), so the model code stays free of parallelism.
Each rank's loss already divides by the step's global denominators (all-reduced in `Trainer.step`),
so the ranks' gradients must be summed, not averaged: the FSDP gradient divide factor is set to 1;
plain (replicated) parameters such as LoRA adapters get theirs summed by `sum_replicated_grads`.
Knows torch.distributed and the model's layer list; nothing of Ray, engines or the loop."""

from __future__ import annotations

import datetime
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from molt.data.trajectory import Trajectory


def init_process_group(
    rank: int, world_size: int, address: str, port: int, device: str = "cpu", timeout_s: int = 600
) -> None:
    """Join the trainer group: gloo on CPU; on CUDA, NCCL for CUDA tensors (FSDP2's) and gloo for the CPU ones (the
    step's denominators and metric sums, object gathers), which NCCL cannot move. A collective waiting past
    `timeout_s` raises."""
    backend = "cpu:gloo,cuda:nccl" if device.startswith("cuda") else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(backend, f"tcp://{address}:{port}", timeout=timeout, world_size=world_size, rank=rank)


def parallelize(model: torch.nn.Module, compute_dtype: torch.dtype | None = None) -> torch.nn.Module:
    """Shard `model` over the default process group with FSDP2 (summed gradients).

    `compute_dtype` (mixed precision): parameters are all-gathered and computed in it while the shards,
    gradient reduction and optimizer stay in the parameters' own dtype (FSDP2's `MixedPrecisionPolicy`)."""
    reduce_dtype = torch.float32 if compute_dtype is not None else None  # None, None: FSDP2's default policy
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=reduce_dtype)
    for layer in getattr(model, "body", model).layers:  # the critic's `ValueModel` wraps a Transformer body
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # plain SUM: gloo has no PREMUL_SUM
    return model


def reshard(model: torch.nn.Module) -> None:
    """Free `model`'s unsharded parameters if it is FSDP2-sharded: a forward without backward (under no_grad)
    leaves the root's (embedding, final norm) unsharded, as plain tensors beside the other DTensors."""
    if isinstance(model, FSDPModule):
        model.reshard()


def _multi_rank() -> bool:
    return dist.is_initialized() and dist.get_world_size() > 1


def all_reduce_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the trainer ranks (a no-op without a process group)."""
    if _multi_rank():
        dist.all_reduce(x, op=dist.ReduceOp.SUM)
    return x


def all_reduce_sums(sums: dict) -> dict:
    """Sum a dict of floats and tensors (same keys and shapes on every rank) over the trainer ranks."""
    keys = sorted(sums)
    flat = [torch.as_tensor(sums[k], dtype=torch.float64).flatten() for k in keys]
    summed = all_reduce_sum(torch.cat(flat)).split([f.numel() for f in flat])
    return {
        k: s.view_as(sums[k]).to(sums[k].dtype) if torch.is_tensor(sums[k]) else float(s)
        for k, s in zip(keys, summed, strict=True)
    }


def sum_replicated_grads(params) -> None:
    """Sum over the ranks the gradients FSDP does not reduce: those of plain (replicated) parameters, e.g. the
    LoRA adapters beside a sharded frozen base. Every rank holds every such parameter, so the calls line up."""
    params = [p for p in params if not isinstance(p, DTensor)]
    if not params or not _multi_rank():
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    summed = all_reduce_sum(torch.cat([g.flatten() for g in grads])).split([g.numel() for g in grads])
    for p, g in zip(params, summed, strict=True):
        p.grad = g.view_as(p)


def gather_samples(shard: list[int], num_samples: int, *per_sample: list | None) -> tuple[list | None, ...]:
    """Per-sample lists each rank computed for its `shard` (indices into the step's batch), as lists over the
    whole batch on every rank (a collective; None stays None)."""
    parts: list = [(shard, per_sample)]
    if _multi_rank():
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, (shard, per_sample))
    out = [[[] for _ in range(num_samples)] if values is not None else None for values in per_sample]
    for indices, lists in parts:
        for full, values in zip(out, lists, strict=True):
            if full is not None:
                for i, v in zip(indices, values, strict=True):
                    full[i] = v
    return tuple(out)


def all_reduce_max(value: int) -> int:
    t = torch.tensor([value], dtype=torch.int64)
    if _multi_rank():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t)


def split_by_tokens(trajs: list[Trajectory], num_ranks: int) -> list[list[int]]:
    """Indices of `trajs` per rank: whole groups, largest first onto the rank with the fewest tokens.

    Groups stay on one rank (per-prompt loss modes need a group's tokens in one place). Every rank
    gets at least one group when there are enough groups (`RayTrainer.step` refuses fewer)."""
    groups: dict[int, list[int]] = {}
    for i, t in enumerate(trajs):
        groups.setdefault(t.group_id, []).append(i)
    sizes = {g: sum(len(trajs[i].tokens) for i in idx) for g, idx in groups.items()}
    shards: list[list[int]] = [[] for _ in range(num_ranks)]
    load = [0] * num_ranks
    for g in sorted(groups, key=lambda g: (-sizes[g], g)):
        r = min(range(num_ranks), key=lambda r: (load[r], r))
        shards[r] += groups[g]
        load[r] += sizes[g]
    return [sorted(s) for s in shards]


def full_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full CPU tensor) for every entry of the state dict; collective: every rank must iterate."""
    for name, value in model.state_dict().items():
        full = value.full_tensor() if hasattr(value, "full_tensor") else value
        yield name, full.detach().cpu()
