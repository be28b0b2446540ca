"""Which dtype the model's activations run in, so that one forward computes the same function under autocast.

A model served in bf16 (built-in engine, vLLM, `transformers`) runs its residual stream, norms and rotary tables
in bf16. The trainer's mixed precision keeps fp32 parameters under `torch.autocast`, which lowers only the matmuls:
elementwise ops would stay fp32, a different function than the one the engine samples from. So the model casts its
activations to the autocast dtype where they enter (embeddings, pixels) and its own elementwise weights (norms,
positional embeddings) to the activations' dtype: every op sees what it would see in a bf16 copy of the weights.
Ops the model wants in fp32 whatever the parameters (the MoE router) run with autocast off. Knows torch only."""

from __future__ import annotations

import contextlib

import torch


def activation_dtype(weight: torch.Tensor) -> torch.dtype:
    """The dtype activations run in: autocast's, where it is on for `weight`'s device, else `weight`'s own."""
    device_type = weight.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return weight.dtype


def no_autocast(device_type: str) -> contextlib.AbstractContextManager:
    """Autocast off on `device_type`: ops inside run in their inputs' dtype (an fp32 router stays fp32)."""
    if not torch.is_autocast_enabled(device_type):
        return contextlib.nullcontext()
    return torch.autocast(device_type, enabled=False)
