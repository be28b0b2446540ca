"""In-place weight updates for a running engine: Molt or HF parameter names, full or partial.

Resolves every incoming name to a view of an existing parameter (HF per-expert tensors land in a
slice of Molt's stacked expert weights), checks all shapes first, then copies. Nothing is
reallocated, so the KV cache and any compiled state stay where they are. Knows the model's
parameter naming (through `molt.models.hf_io`, where it is defined), nothing of requests or caches."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from molt.models.hf_io import IGNORED_HF_KEYS, hf_views
from molt.models.transformer import Transformer


@torch.no_grad()
def load_weights(model: Transformer, weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> int:
    """Copy `weights` into `model`'s parameters in place; returns the number of tensors copied.

    Unknown names or shape mismatches are an error listing them, raised before anything is copied."""
    params = model.state_dict(keep_vars=True)
    params |= hf_views(params, model.cfg)  # HF names too: per-expert tensors land in a slice of the stacked ones
    plan, unknown, mismatched = [], [], []
    for name, tensor in weights.items() if isinstance(weights, Mapping) else weights:
        if IGNORED_HF_KEYS.search(name):
            continue
        dest = params.get(name)
        if dest is None:
            unknown.append(name)
        elif tuple(dest.shape) != tuple(tensor.shape):
            mismatched.append(f"{name}: got {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
        else:
            plan.append((dest, tensor))
    if unknown or mismatched:
        raise ValueError(f"update_weights: unknown names {sorted(unknown)}; shape mismatches {mismatched}")
    for dest, tensor in plan:
        dest.copy_(tensor)
    return len(plan)
