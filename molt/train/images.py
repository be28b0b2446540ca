"""The trainer's side of images: each trajectory's pixels, checked against its placeholder positions.

A trajectory records one entry per image (`start`, uint8 `pixels`, content `hash`). Before the
forward, every image's placeholder run must start exactly at its recorded position and its pixels
must hash to what the engine saw; otherwise the step fails loudly (like a token mismatch) rather
than training on misaligned images. Knows the model config, not engines or agents.
"""

from __future__ import annotations

import torch

from molt.data.trajectory import Trajectory
from molt.models.config import TransformerConfig
from molt.models.vision import image_spans, pixel_hash


class ImageMismatchError(RuntimeError):
    """A trajectory's images disagree with its placeholder tokens or with the pixels the engine saw."""


def trajectory_pixels(trajs: list[Trajectory], cfg: TransformerConfig) -> list[list[torch.Tensor]] | None:
    """Per trajectory, its pixel tensors in placeholder order (None when the batch has no images)."""
    if cfg.vision is None:
        if any(t.images for t in trajs):
            raise ImageMismatchError("trajectories carry images but the policy has no vision tower")
        return None
    out = []
    for traj in trajs:
        records = traj.images or []
        starts = image_spans(traj.tokens, cfg.image_token_id, cfg.vision.tokens_per_image, f"rollout {traj.rollout_id}")
        if starts != [r["start"] for r in records]:
            raise ImageMismatchError(
                f"rollout {traj.rollout_id}: placeholders start at {starts} but images are recorded at "
                f"{[r['start'] for r in records]}"
            )
        for r in records:
            if pixel_hash(r["pixels"]) != r["hash"]:
                raise ImageMismatchError(f"rollout {traj.rollout_id}: image at {r['start']} differs from the engine's")
        out.append([r["pixels"] for r in records])
    return out if any(out) else None
