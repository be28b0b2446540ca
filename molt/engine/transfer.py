"""Small per-step inputs (ids, positions, slots, sampling parameters) from Python lists to the engine's device.

On CUDA, `torch.tensor(values, device="cuda")` copies from pageable host memory, which waits until the GPU has
run every queued kernel. Built on the host in pinned memory and copied asynchronously instead, the inputs of a
step never stall the stream, so the step's only wait is the one copy of its sampled tokens and log-probs back
to the host (`sampling.sample`). On CPU this is a plain `torch.tensor`. Knows nothing of models or requests."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(values: Sequence, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`torch.tensor(values, dtype=dtype)` on `device`; on CUDA through pinned memory, without a stream sync."""
    if torch.device(device).type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    # the caching host allocator keeps the pinned block alive until the copy has run
    return torch.tensor(values, dtype=dtype).pin_memory().to(device, non_blocking=True)
