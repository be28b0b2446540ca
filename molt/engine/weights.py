"""In-place weight updates for a running engine: Molt or HF parameter names, full or partial.

Resolves every incoming name to a view of an existing parameter (HF per-expert tensors land in a
slice of Molt's stacked expert weights), checks all shapes first, then copies. Nothing is
reallocated, so the KV cache and any compiled state stay where they are. Knows the model's
parameter naming (as `molt.models.hf_io` defines it), nothing of requests or caches.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

import torch

from molt.models.transformer import Transformer

HF_EXPERT = re.compile(r"model\.(layers\.\d+\.mlp\.)experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
IGNORED = re.compile(r"(rotary_emb\.)?inv_freq$")


def _destination(params: dict[str, torch.Tensor], name: str) -> torch.Tensor | None:
    """The parameter view `name` writes into, or None when the name is unknown."""
    m = HF_EXPERT.match(name)
    if m:
        stacked = params.get(m[1] + ("down_proj" if m[3] == "down_proj" else "gate_up_proj"))
        if stacked is None or int(m[2]) >= stacked.shape[0]:
            return None
        expert = stacked[int(m[2])]
        if m[3] == "down_proj":
            return expert
        half = expert.shape[0] // 2
        return expert[:half] if m[3] == "gate_proj" else expert[half:]
    return params.get(name.removeprefix("model."))


@torch.no_grad()
def load_weights(model: Transformer, weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> int:
    """Copy `weights` into `model`'s parameters in place; returns the number of tensors copied.

    Unknown names or shape mismatches are an error listing them, raised before anything is copied.
    """
    items = list(weights.items() if isinstance(weights, Mapping) else weights)
    params = model.state_dict(keep_vars=True)
    plan, unknown, mismatched = [], [], []
    for name, tensor in items:
        if IGNORED.search(name):
            continue
        dest = _destination(params, name)
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
