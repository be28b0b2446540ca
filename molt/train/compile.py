"""Regional compilation of the trainer's model, applied from outside the model code.

`compile_model(model)` replaces each dense decoder layer's forward on the instance with a `torch.compile`d one
(parameter names, state dicts and FSDP2's hooks are unchanged) and gives the LM head a compiled chunk function
for `molt.train.logprobs.head_logprobs`. Every layer runs the same code object, so one compilation serves all.
Shapes are dynamic from the start: row widths change every step, and a static first compile plus its variants
would use up dynamo's recompile limit (past it a layer silently runs eager). Activation checkpointing first
puts the recompute inside the compiled graph. MoE layers stay eager: their forward records routing in Python.
FlexAttention is traced into a compiled layer's graph (outside one, `molt.models.attention` compiles its own).
`resolve_compile("auto", device)` is on for CUDA only (inductor on CPU compiles slowly for little gain)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch

from molt.config import TrainConfig
from molt.train.logprobs import head_chunk
from molt.train.memory import checkpoint_layers, wrap_dense_layers

COMPILE_MODES = ("auto", "on", "off")


def prepare_layers(model: torch.nn.Module, train: TrainConfig, device: str) -> None:
    """What the trainer does to each model it trains (the policy, a critic body): activation checkpointing of its
    layers (`train.activation_checkpointing`), then compilation (`train.compile`, recomputing inside the graph)."""
    if train.activation_checkpointing:
        checkpoint_layers(model)
    if resolve_compile(train.compile, device):
        compile_model(model, train.compile_backend)


def resolve_compile(mode: str, device: str) -> bool:
    """Whether `train.compile` (`auto` | `on` | `off`) compiles on `device`: `auto` is on for CUDA only."""
    if mode not in COMPILE_MODES:
        raise ValueError(f"unknown compile mode {mode!r}; use one of {COMPILE_MODES}")
    return mode == "on" or (mode == "auto" and device.startswith("cuda"))


class CompiledForward:
    """`torch.compile(forward)`, callable in its place; a deep copy (reference model, critic) compiles the copied
    module's forward instead of calling the original module's (a compiled function alone would be shared)."""

    def __init__(self, forward: Callable, backend: str = "inductor", dynamic: bool | None = True):
        self.forward, self.backend, self.dynamic = forward, backend, dynamic
        self.compiled = torch.compile(forward, backend=backend, dynamic=dynamic)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.compiled(*args, **kwargs)

    def __deepcopy__(self, memo: dict) -> CompiledForward:
        return CompiledForward(copy.deepcopy(self.forward, memo), self.backend, self.dynamic)


def compile_layers(model: torch.nn.Module, backend: str = "inductor", dynamic: bool | None = True) -> int:
    """Compile every dense decoder layer's forward in place; returns how many were compiled (0 the second time)."""
    return wrap_dense_layers(model, lambda forward: CompiledForward(forward, backend, dynamic), "_molt_compiled")


def compile_model(model: torch.nn.Module, backend: str = "inductor", dynamic: bool | None = True) -> int:
    """`compile_layers`, plus a compiled LM-head chunk (head matmul, fp32 log-softmax, entropy fused: a chunk's
    logits exist once, in the compute dtype, instead of five fp32 temporaries). Returns the layers compiled."""
    model.lm_head._molt_chunk_fn = torch.compile(head_chunk, backend=backend, dynamic=dynamic)
    return compile_layers(model, backend, dynamic)
