"""Training precision, applied from outside the model: which dtype parameters live in and which one computes.

`model.dtype` is the compute dtype (the engines hold their weights in it; the trainer's matmuls run in it).
`train.precision` says where the trainer's parameters live:

- `mixed` (default): parameters, gradients and AdamW states stay fp32 (master weights); forward and backward
  run under `torch.autocast` in the compute dtype (one process), or FSDP2's `MixedPrecisionPolicy` when
  sharded (`parallel.parallelize`). float16 adds dynamic loss scaling (`torch.amp.GradScaler`).
- `pure`: parameters (hence gradients and optimizer states) are stored in the compute dtype.

With a float32 compute dtype both are plain fp32 training. Knows torch only: no model, no config tree."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, device: str) -> torch.dtype:
    """The compute dtype `name` means on `device`: `auto` is bfloat16 on CUDA (float16 on GPUs without bf16)
    and float32 elsewhere (bf16 matmuls are slow on most CPUs)."""
    if name != "auto":
        return DTYPES[name]
    if not device.startswith("cuda"):
        return torch.float32
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16


@dataclass(frozen=True)
class Precision:
    """Compute dtype, parameter dtype and the device type autocast runs on."""

    compute: torch.dtype = torch.float32
    params: torch.dtype = torch.float32
    device_type: str = "cpu"

    @classmethod
    def of(cls, dtype_name: str, mode: str, device: str) -> Precision:
        """From `model.dtype`, `train.precision` (mixed | pure) and `runtime.device`."""
        compute = resolve_dtype(dtype_name, device)
        return cls(compute, torch.float32 if mode == "mixed" else compute, device.split(":")[0])

    @property
    def mixed(self) -> bool:
        return self.compute != self.params

    def autocast(self) -> contextlib.AbstractContextManager:
        """Context for forward passes: autocast to the compute dtype when parameters are wider."""
        return torch.autocast(self.device_type, dtype=self.compute) if self.mixed else contextlib.nullcontext()

    def unsharded(self) -> Precision:
        """The same precision with autocast off (FSDP2's mixed-precision policy casts the parameters instead)."""
        return Precision(self.params, self.params, self.device_type)

    def scaler(self) -> torch.amp.GradScaler | None:
        """A dynamic loss scaler for float16 compute with wider parameters (bf16 needs none)."""
        return torch.amp.GradScaler(self.device_type) if self.compute == torch.float16 and self.mixed else None


def clip_and_step(
    opt: torch.optim.Optimizer, params, max_norm: float, scaler: torch.amp.GradScaler | None
) -> tuple[torch.Tensor, bool]:
    """Unscale (fp16), clip the global gradient norm, step unless it is non-finite; (norm, stepped)."""
    if scaler is not None:
        scaler.unscale_(opt)
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm or float("inf"))
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    finite = bool(torch.isfinite(norm))
    if scaler is not None:
        scaler.step(opt)  # skips the step itself when unscale_ found inf/nan
        scaler.update()
    elif finite:
        opt.step()
    opt.zero_grad(set_to_none=True)
    return norm, finite
