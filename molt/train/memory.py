"""Trainer memory: activation checkpointing per decoder layer, applied from outside the model.

`checkpoint_layers(model)` makes each dense decoder layer keep only its input for backward and recompute
its activations there (torch's non-reentrant checkpoint, which replays autocast). The layer's forward is
replaced on the instance, so parameter names, state dicts and FSDP2 hooks are unchanged. MoE layers are
left as they are: their forward records the routing (and replays it by layer order), which a recompute
would record twice. The model code knows nothing of this."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint

from molt.models.moe import SparseMoE


def checkpoint_layers(model: torch.nn.Module) -> int:
    """Wrap every dense decoder layer's forward in activation checkpointing; returns how many were wrapped."""
    return wrap_dense_layers(model, lambda forward: functools.partial(_checkpointed, forward), "_molt_checkpointed")


def wrap_dense_layers(model: torch.nn.Module, wrap: Callable[[Callable], Callable], tag: str) -> int:
    """Replace each dense decoder layer's forward on the instance with `wrap(forward)`, once per `tag`; returns
    how many were replaced (0 the second time). MoE layers are skipped."""
    layers = [m for m in model.layers if not isinstance(m.mlp, SparseMoE) and not getattr(m, tag, False)]
    for layer in layers:
        layer.forward = wrap(layer.forward)
        setattr(layer, tag, True)
    return len(layers)


def _checkpointed(forward, *args, **kwargs):
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)
