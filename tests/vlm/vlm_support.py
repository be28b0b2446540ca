"""Shared helpers of the VLM tests: a small random VLM, its tokenizer, and test images."""

from __future__ import annotations

import io

import torch
from PIL import Image

from molt.models import Transformer, preset
from molt.models.config import VisionConfig
from molt.models.tokenizer import IMAGE_PLACEHOLDER, build_builtin_tokenizer

TOK = build_builtin_tokenizer(image_token=True)
IMAGE_ID = TOK.convert_tokens_to_ids(IMAGE_PLACEHOLDER)
VISION = VisionConfig(image_size=16, patch_size=8, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)
PER_IMAGE = VISION.tokens_per_image


def small_vlm(seed: int = 0) -> Transformer:
    cfg = preset(
        "tiny-vlm",
        vocab_size=len(TOK),
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=32,
        vision=VISION,
        image_token_id=IMAGE_ID,
        eos_token_id=TOK.eos_token_id,
    )
    return Transformer(cfg).init_weights(0.1, torch.Generator().manual_seed(seed)).eval()


def image(colour: tuple[int, int, int], size: int = 20) -> Image.Image:
    img = Image.new("RGB", (size, size), colour)
    img.putpixel((1, 2), (colour[2], colour[0], colour[1]))
    return img


def png_bytes(img: Image.Image) -> bytes:
    buffer = io.BytesIO()
    img.save(buffer, format="PNG")
    return buffer.getvalue()


def looking_agent():
    """A ChatAgent that shows the policy the row's PNG (OpenAI `image_url`) and scores nothing."""
    import base64

    from molt.agents.chat import ChatAgent, Result

    class Looking(ChatAgent):
        async def run(self, ctx) -> Result:
            url = "data:image/png;base64," + base64.b64encode(ctx.row["png"]).decode()
            content = [{"type": "text", "text": "what?"}, {"type": "image_url", "image_url": {"url": url}}]
            messages = [{"role": "user", "content": content}]
            await ctx.openai().chat.completions.create(model=ctx.model, messages=messages)
            return Result(reward=0.0)

    return Looking()


def looking_kit():
    """The agent-worker kit of `looking_agent` over the VLM tokenizer."""
    from molt.agents.workers import WorkerKit

    return WorkerKit(TOK, looking_agent)
