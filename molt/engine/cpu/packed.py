"""Prepacked weights for the engine's linear layers (CPU, fp32), multiplied by Molt's own kernel (`kernels.py`);
and its RMSNorms through Molt's one-pass kernel in eager steps.

Nothing changes for anyone else holding the model: the runner enters `LinearPacks.active()` around its own
forward, and outside it (the trainer, a reference forward, autograd, other `torch.compile` traces) a
`PackedLinear` is exactly `nn.Linear` and a `KernelRMSNorm` exactly `RMSNorm`. Each layer keeps its packed
copy as a plain attribute (not in the state dict); `active()` first repacks, in place, every layer whose weight's
version counter has moved (a weight load), so a pack is never stale. Where the kernels cannot run (no AVX2/FMA,
no C++ compiler) no module is swapped and the engine uses `F.linear` and `F.rms_norm`."""

from __future__ import annotations

import threading
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from molt.engine.cpu import kernels
from molt.models.transformer import RMSNorm

MAX_ROWS = 1024  # measured ahead of sgemm up to 512 rows; larger prefill chunks stay on sgemm
_ACTIVE = threading.local()  # set on the engine thread while its runner is in a forward
_TRACING = [False]  # a runner is tracing its compiled step (read when the graph is traced, and guarded on)


class PackedLinear(nn.Linear):
    """An `nn.Linear` that multiplies by its packed copy `packed` inside `LinearPacks.active()`."""

    packed: torch.Tensor | None = None
    packed_from: tuple = ()  # (version, address) of the weight it was packed from

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            use = _TRACING[0] and not torch.is_grad_enabled()  # the op has no backward
        else:
            use = getattr(_ACTIVE, "on", False) and x.dtype == torch.float32 and x.numel() // x.shape[-1] <= MAX_ROWS
        if not use or self.packed is None:
            return F.linear(x, self.weight, self.bias)
        out = torch.ops.molt_kernels.gemm(x, self.packed, self.out_features)  # kernels.matmul, traceable
        return out if self.bias is None else out + self.bias


class KernelRMSNorm(RMSNorm):
    """An `RMSNorm` that runs Molt's kernel inside `LinearPacks.active()`, eagerly (a compiled graph fuses its own)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling() or not getattr(_ACTIVE, "on", False) or x.dtype != torch.float32:
            return super().forward(x)
        return torch.ops.molt_kernels.rms_norm(x, self.weight, self.eps)


class LinearPacks:
    """Turns one model's `nn.Linear`s into `PackedLinear`s and its `RMSNorm`s into `KernelRMSNorm`s (none on GPU,
    for other dtypes, or where the kernels cannot run) and keeps the packed copies current."""

    def __init__(self, model: nn.Module):
        self.layers: list[PackedLinear] = []
        if not kernels.usable(next(model.parameters())):
            return
        for module in model.modules():
            if type(module) in (nn.Linear, PackedLinear):  # one already swapped by another engine's packs too
                module.__class__ = PackedLinear
                self.layers.append(module)
            elif type(module) is RMSNorm:
                module.__class__ = KernelRMSNorm

    def refresh(self) -> None:
        """Repack every layer whose weight moved since its pack (in place: a compiled graph holds the tensor)."""
        for layer in self.layers:
            weight = layer.weight
            key = (weight._version, weight.data_ptr())
            if layer.packed_from != key:
                packed = kernels.pack(weight.detach())
                if layer.packed is not None and layer.packed.shape == packed.shape:
                    layer.packed.copy_(packed)
                else:
                    layer.packed = packed
                layer.packed_from = key

    @contextmanager
    def active(self, tracing: bool = False):
        """Route this thread's `PackedLinear` calls through fresh packs for the duration; `tracing`: also those
        of a compiled graph traced meanwhile."""
        self.refresh()
        previous, _ACTIVE.on = getattr(_ACTIVE, "on", False), bool(self.layers)
        _TRACING[0] = tracing and bool(self.layers)
        try:
            yield
        finally:
            _ACTIVE.on, _TRACING[0] = previous, False
