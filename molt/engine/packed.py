"""Prepacked weights for the engine's linear layers (CPU, fp32), multiplied by Molt's own kernel (`gemm.py`).

Nothing changes for anyone else holding the model: the runner enters `LinearPacks.active()` around its own
forward, and outside it (the trainer, a reference forward, autograd, `torch.compile` tracing) a
`PackedLinear` is exactly `nn.Linear`. A packed copy is redone whenever its weight's in-place version counter
has moved (a weight load), so it is never stale. Where the kernel cannot run (no AVX2/FMA, no C compiler) no
layer is swapped and the engine multiplies with `F.linear`.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from molt.engine import gemm

MAX_ROWS = 1024  # measured ahead of sgemm up to 512 rows; larger prefill chunks stay on sgemm
_ACTIVE = threading.local()  # the engine thread's packs while its runner is in a forward


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear`, through the active packs' copy of `weight` for up to `MAX_ROWS` fp32 rows."""
    packs = getattr(_ACTIVE, "packs", None)
    if packs is None or x.dtype != torch.float32 or not 1 <= x.numel() // x.shape[-1] <= MAX_ROWS:
        return F.linear(x, weight, bias)
    return packs.linear(x, weight, bias)


packed_linear = torch.library.custom_op("molt::packed_linear", linear, mutates_args=())  # what compiled graphs call
packed_linear.register_fake(lambda x, weight, bias: x.new_empty((*x.shape[:-1], weight.shape[0])))


class PackedLinear(nn.Linear):
    """An `nn.Linear` that multiplies by the active `LinearPacks`' copy of its weight when one is set."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.compiler.is_compiling():
            return linear(x, self.weight, self.bias)
        if torch.is_grad_enabled():  # the op has no backward
            return F.linear(x, self.weight, self.bias)
        return packed_linear(x, self.weight, self.bias)


class LinearPacks:
    """Packed copies of one model's linear weights, made on first use; turns its `nn.Linear`s into
    `PackedLinear`s (none on GPU, for other dtypes, or where the kernel cannot run)."""

    def __init__(self, model: nn.Module):
        self.packed: dict[int, tuple[torch.Tensor, int, torch.Tensor]] = {}  # by data_ptr: (weight, version, packed)
        param = next(model.parameters())
        if param.device.type != "cpu" or param.dtype != torch.float32 or gemm.kernel() is None:
            return
        for module in model.modules():
            if type(module) is nn.Linear:
                module.__class__ = PackedLinear

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        entry = self.packed.get(weight.data_ptr())  # the held weight keeps its address from being reused
        if entry is None or entry[1] != weight._version or entry[0].shape != weight.shape:
            entry = self.packed[weight.data_ptr()] = (weight, weight._version, gemm.pack(weight.detach()))
        out = gemm.matmul(x, entry[2], weight.shape[0])
        return out if bias is None else out.add_(bias)

    @contextmanager
    def active(self):
        """Route this thread's `PackedLinear` calls through these packs for the duration."""
        previous, _ACTIVE.packs = getattr(_ACTIVE, "packs", None), self
        try:
            yield
        finally:
            _ACTIVE.packs = previous
