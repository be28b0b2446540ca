"""Images in agent conversations: found in chat messages, turned into placeholder tokens + pixel records.

Chat messages carry images as content parts: `{"type": "image", "image": <PIL | path | bytes>}`,
OpenAI `{"type": "image_url", "image_url": {"url": "data:..."}}` or Anthropic-decoded parts. The chat template writes
one `<|image|>` per part; `expand_images` repeats it to the model's `tokens_per_image` and returns one record per image
(absolute start position, uint8 pixels, content hash) for `Trajectory.images`. An image whose tokens would not fit in
the episode's context budget raises `ImageBudgetError`: a rollout is dropped rather than having an image cut in half.
Knows the engine's vision spec (`engine.vision`, `engine.image_token_id`), not models or trainers."""

from __future__ import annotations

from typing import Any

from molt.errors import RolloutDrop
from molt.models.vision import ImageError, expand_image_tokens, message_images, pixel_hash, to_pixels

__all__ = ["ImageBudgetError", "expand_images", "message_images", "pixels_arg", "with_images"]


class ImageBudgetError(ImageError, RolloutDrop):
    """An image's placeholder tokens do not fit in the context budget (the rollout is dropped)."""

    drop_reason = "image_over_context"


def with_images(observation: list[dict[str, Any]], images: list[Any] | None) -> list[dict[str, Any]]:
    """`Result.images` appended as image parts to the last observation message."""
    if not images:
        return observation
    *head, last = observation
    content = last.get("content")
    parts = [{"type": "text", "text": content}] if isinstance(content, str) else list(content or [])
    return [*head, {**last, "content": parts + [{"type": "image", "image": im} for im in images]}]


def expand_images(
    engine, ids: list[int], images: list[Any], offset: int, max_len: int | None = None
) -> tuple[list[int], list[dict[str, Any]]]:
    """`ids` (to be appended at position `offset`) with placeholders expanded, and their image records."""
    image_id, vision = getattr(engine, "image_token_id", None), getattr(engine, "vision", None)
    if vision is None:
        if images:
            raise ImageError(f"{len(images)} image(s) given but the policy has no vision tower")
        return ids, []
    found = sum(t == image_id for t in ids)
    if found != len(images):
        raise ImageError(f"the chat template rendered {found} image placeholders for {len(images)} images")
    pixels = [to_pixels(im, vision.image_size, f"image {i}") for i, im in enumerate(images)]
    ids, starts = expand_image_tokens(ids, image_id, vision.tokens_per_image)
    end = offset + (starts[-1] + vision.tokens_per_image if starts else 0)
    if max_len is not None and end > max_len:
        raise ImageBudgetError(f"image tokens would end at position {end}, past the context budget max_len={max_len}")
    return ids, [{"start": offset + s, "pixels": p, "hash": pixel_hash(p)} for s, p in zip(starts, pixels, strict=True)]


def pixels_arg(records: list[dict[str, Any]] | None) -> dict[str, Any]:
    """The `images=` argument of a generate call over a context with these image records (empty: none)."""
    return {"images": [r["pixels"] for r in records]} if records else {}
