"""Images in the built-in engine: request checks and the image embeddings of one step's prefill chunks.

A request's images are uint8 pixel tensors, one per whole run of `tokens_per_image` placeholder
tokens in its prompt. Each prefill chunk runs the vision tower (current weights, so a recompute
after a weight swap re-encodes too) on the images its positions overlap and takes the rows of its
own placeholder positions; a chunk boundary may fall inside an image. Generated tokens are never
placeholders (the core bans the id from sampling). Knows the model config, not requests' origins."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from molt.models.config import TransformerConfig
from molt.models.transformer import Transformer
from molt.models.vision import ImageError, image_spans, to_pixels


def check_request_images(cfg: TransformerConfig, prompt: list[int], images: Sequence | None) -> list | None:
    """The request's pixel tensors, checked against its placeholder runs (a mismatch is an `ImageError`)."""
    if cfg.vision is None:
        if images:
            raise ImageError("this model has no vision tower: requests cannot carry images")
        return None
    per = cfg.vision.tokens_per_image
    starts = image_spans(prompt, cfg.image_token_id, per)
    images = list(images or ())
    if len(starts) != len(images):
        raise ImageError(f"prompt has {len(starts)} image placeholder runs of {per} tokens but {len(images)} images")
    return [to_pixels(im, cfg.vision.image_size, f"image {i}") for i, im in enumerate(images)] or None


@torch.inference_mode()
def chunk_image_embeds(model: Transformer, chunks: list[tuple[list[int], int, int, list | None]]):
    """Embedding rows [n, H] for the placeholder tokens of (tokens, start, end, images) chunks, in order.

    One vision forward over every image the step's chunks overlap (small batches are overhead-bound)."""
    image_id, per = model.cfg.image_token_id, model.cfg.vision.tokens_per_image
    needed, slices = [], []  # images to encode; per chunk, its rows in their flattened embeddings
    for tokens, start, end, images in chunks:
        if not images:
            continue
        before = sum(t == image_id for t in tokens[:start])
        inside = sum(t == image_id for t in tokens[start:end])
        if not inside:
            continue
        first, last = before // per, (before + inside - 1) // per
        offset = len(needed) * per + before - first * per
        needed += images[first : last + 1]
        slices.append(slice(offset, offset + inside))
    if not needed:
        return None
    embeds = model.vision(torch.stack(needed).to(model.inv_freq.device)).flatten(0, 1)
    return torch.cat([embeds[s] for s in slices])
