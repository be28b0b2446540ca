"""Optimizer and learning-rate schedule shared by SFT and RL: AdamW, linear warm-up, cosine decay."""

from __future__ import annotations

import math

import torch

from molt.config import TrainConfig


def lr_factor(step: int, warmup_steps: int, max_steps: int, min_ratio: float) -> float:
    """Multiplier of the peak LR at optimizer step `step` (0-based): warm-up to 1, then cosine decay to `min_ratio`
    at the last step (`max_steps - 1`); a warm-up longer than the run is the run."""
    warmup_steps = min(warmup_steps, max_steps)
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - 1 - warmup_steps))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_optimizer(params, cfg: TrainConfig) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over `params` (no decay on norms and biases) with its warm-up + cosine schedule."""
    params = [p for p in params if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # the fused kernel: on CPU ~7x faster than foreach for the tiny presets (also on FSDP2 DTensor shards)
    opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=1e-8, fused=True)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_factor(s, cfg.warmup_steps, cfg.max_steps, cfg.min_lr_ratio)
    )
    return opt, schedule
