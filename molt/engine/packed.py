"""oneDNN-prepacked weights for the engine's linear layers (CPU, fp32, small row counts).

torch's fp32 `linear` on CPU calls MKL's sgemm, which is slow for the few rows of a decode step once
the weights no longer sit in cache: on a 2-core AMD EPYC a matmul with a >= 256K-element weight ran
1.2-2.1x faster against a copy of the weight reordered once into oneDNN's blocked layout, for 2-32
rows (`benchmarks/engine.py` shows the whole-engine effect). Smaller weights and larger row counts
gain nothing there and stay on sgemm.

Nothing changes for anyone else holding the model: the runner enters `LinearPacks.active()` around
its own forward, and outside it (the trainer, a reference forward, autograd, `torch.compile`
tracing) a `PackedLinear` is exactly `nn.Linear`. A packed copy is redone whenever its weight's
in-place version counter has moved (a weight load), so it is never stale.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

MIN_WEIGHT_NUMEL = 1 << 18  # smaller weights stay in cache, where sgemm is as fast
MAX_ROWS = 256  # above this many rows sgemm is as fast or faster
_ACTIVE = threading.local()  # the engine thread's packs while its runner is in a forward


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear`, through the active packs' copy of `weight` where that is faster (large weight, few rows)."""
    packs = getattr(_ACTIVE, "packs", None)
    if packs is None or weight.numel() < MIN_WEIGHT_NUMEL or not 2 <= x.numel() // x.shape[-1] <= MAX_ROWS:
        return F.linear(x, weight, bias)
    return packs.linear(x, weight, bias)


packed_linear = torch.library.custom_op("molt::packed_linear", linear, mutates_args=())  # what compiled graphs call
packed_linear.register_fake(lambda x, weight, bias: x.new_empty((*x.shape[:-1], weight.shape[0])))


class PackedLinear(nn.Linear):
    """An `nn.Linear` that multiplies by the active `LinearPacks`' copy of its weight when one is set."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.compiler.is_compiling():
            return linear(x, self.weight, self.bias)
        if torch.is_grad_enabled() or self.weight.numel() < MIN_WEIGHT_NUMEL:  # the op has no backward
            return F.linear(x, self.weight, self.bias)
        return packed_linear(x, self.weight, self.bias)


class LinearPacks:
    """Packed copies of one model's large linear weights, made on first use (none on GPU, for other dtypes, or
    without oneDNN); turns those layers into `PackedLinear`s."""

    def __init__(self, model: nn.Module):
        self.packed: dict[int, tuple[torch.Tensor, int, torch.Tensor]] = {}  # by data_ptr: (weight, version, packed)
        param = next(model.parameters())
        if param.device.type != "cpu" or param.dtype != torch.float32 or not torch.backends.mkldnn.is_available():
            return
        for module in model.modules():
            if type(module) is nn.Linear and module.weight.numel() >= MIN_WEIGHT_NUMEL:  # others: no overhead
                module.__class__ = PackedLinear

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        entry = self.packed.get(weight.data_ptr())  # the held weight keeps its address from being reused
        if entry is None or entry[1] != weight._version or entry[0].shape != weight.shape:
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
            entry = self.packed[weight.data_ptr()] = (weight, weight._version, packed)
        return torch.ops.mkldnn._linear_pointwise(x, entry[2], bias, "none", [], "")

    @contextmanager
    def active(self):
        """Route this thread's `PackedLinear` calls through these packs for the duration."""
        previous, _ACTIVE.packs = getattr(_ACTIVE, "packs", None), self
        try:
            yield
        finally:
            _ACTIVE.packs = previous
