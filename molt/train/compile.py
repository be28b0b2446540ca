"""Regional compilation of the trainer's model, applied from outside the model code.

`compile_model(model)` replaces each dense decoder layer's forward on the instance with a `torch.compile`d one
(parameter names, state dicts and FSDP2's hooks, which run around `forward`, are unchanged) and gives the LM
head a compiled chunk function for `molt.train.logprobs.head_logprobs`. Every layer runs the same code object
with parameters as graph inputs, so one compilation serves all layers. Shapes are dynamic from the start
(`dynamic=True`): the trainer's row widths change every step, and a static first compile would be thrown away
while its variants (with/without grad, packed or one-sample rows, the last layer's "trained queries only" call)
would use up dynamo's recompile limit (8 per code object; past it a layer silently runs eager). It composes with
`molt.train.memory.checkpoint_layers` in either order (checkpoint first is what torch recommends: the
recompute is then part of the compiled graph). MoE layers stay eager: their forward records and replays
routing in Python. Inside a compiled layer FlexAttention is traced into the layer's graph; outside it
`molt.models.attention` calls its own compiled FlexAttention on CUDA.

`resolve_compile("auto", device)` is on for CUDA and off elsewhere (inductor on CPU compiles for tens of
seconds and gains little for the tiny CPU presets). Knows torch and the model's layer list only.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch

from molt.models.moe import SparseMoE

COMPILE_MODES = ("auto", "on", "off")


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
    compiled = 0
    for layer in model.layers:
        if isinstance(layer.mlp, SparseMoE) or getattr(layer, "_molt_compiled", False):
            continue
        layer.forward = CompiledForward(layer.forward, backend, dynamic)
        layer._molt_compiled = True
        compiled += 1
    return compiled


def compile_model(model: torch.nn.Module, backend: str = "inductor", dynamic: bool | None = True) -> int:
    """`compile_layers`, plus a compiled LM-head chunk (head matmul, fp32 log-softmax, entropy fused: a chunk's
    logits exist once, in the compute dtype, instead of five fp32 temporaries). Returns the layers compiled."""
    from molt.train.logprobs import compiled_chunk

    model.lm_head._molt_chunk_fn = compiled_chunk(backend, dynamic)
    return compile_layers(model, backend, dynamic)
