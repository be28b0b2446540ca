"""The vision half of a VLM: images in (PIL / path / bytes / data URI) -> pixels -> LM-space embeddings.

`to_pixels` decodes an image to RGB resized to the tower's square `image_size`, uint8 [3, S, S]: those exact
pixels are what the engine and the trainer both see (they travel in the trajectory with a content hash,
`pixel_hash`). Each image becomes `tokens_per_image` placeholder tokens (one per patch): the chat template
writes one `<|image|>` per image and `expand_image_tokens` repeats it. `VisionTower` (patch embedding,
pre-norm encoder layers, a 2-layer projector into the LM's hidden size) makes the rows the LM scatters into
those positions. Knows nothing of engines, agents or training; model code free of parallelism."""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import itertools
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from molt.models.config import VisionConfig
from molt.models.dtypes import activation_dtype


class ImageError(ValueError):
    """An image that cannot be used (missing file, undecodable bytes, unknown kind)."""


def _image_bytes(image: Any, where: str) -> bytes:
    """The encoded bytes of a file path, raw bytes, a `data:` URI or an HF `{"bytes"/"path"}` dict (URLs refused)."""
    if isinstance(image, dict):
        image = image.get("bytes") or image.get("path")
    if isinstance(image, str) and image.startswith("data:"):
        try:
            return base64.b64decode("".join(image.split(",", 1)[1].split()), validate=True)  # line breaks allowed
        except (IndexError, binascii.Error):
            raise ImageError(f"{where}: malformed base64 data URI") from None
    if isinstance(image, str) and image.startswith(("http://", "https://")):
        raise ImageError(f"{where}: image URLs are not fetched ({image[:80]!r}); give a file path, bytes or a data URI")
    if isinstance(image, (str, Path)):
        if not Path(image).is_file():
            raise ImageError(f"{where}: image file {str(image)!r} does not exist")
        return Path(image).read_bytes()
    if not isinstance(image, (bytes, bytearray)):
        raise ImageError(f"{where}: expected a PIL image, path, bytes or data URI, got {type(image).__name__}")
    return bytes(image)


def load_image(image: Any, where: str = "image", verify: bool | str = False):
    """A PIL image from a PIL image, file path, raw bytes, a `data:` URI or an HF `{"bytes"/"path"}` dict; `verify`:
    only check that it decodes (PIL's `verify`, no pixels; `"scan"`: a JPEG decoded at 1/8 scale as well, since its
    verify reads no scan data, so a cut-short file passes). URLs are not fetched; images over PIL's
    `MAX_IMAGE_PIXELS` (a decompression bomb: a small file of huge size) are refused."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(image, Image.Image):
        return image
    path = image.get("path") if isinstance(image, dict) and not image.get("bytes") else image
    named = f" of {str(path)!r}" if isinstance(path, (str, Path)) and not str(path).startswith("data:") else ""
    image = _image_bytes(image, where)
    try:
        loaded = Image.open(io.BytesIO(image))
        if loaded.width * loaded.height > (limit := Image.MAX_IMAGE_PIXELS or float("inf")):
            raise Image.DecompressionBombError(
                f"Image size ({loaded.width * loaded.height} pixels) exceeds limit of {limit} pixels"
            )
        scan = verify == "scan" and loaded.format in ("JPEG", "MPO")  # MPO: a phone's JPEG with its extra frames
        if scan:  # at 1/8 scale, still reading all of the scan data
            loaded.draft(loaded.mode, (loaded.width // 8 or 1, loaded.height // 8 or 1))
        loaded.verify() if verify and not scan else loaded.load()
        return loaded
    except Image.DecompressionBombError as e:
        raise ImageError(f"{where}: image{named} is too large ({str(e).split(',')[0]})") from None
    except (UnidentifiedImageError, OSError, SyntaxError) as e:
        why = "not an image format Pillow reads" if isinstance(e, UnidentifiedImageError) else str(e)
        raise ImageError(f"{where}: cannot decode image bytes{named} ({len(image)} bytes): {why}") from None


def rgb_image(image: Any, where: str = "image"):
    """`image` as 8-bit RGB as a viewer shows it: EXIF orientation applied, 16-bit grey scaled to 8 bits (wider
    integers clipped, never wrapped), float grey in [0, 1] scaled by 255, transparent pixels over white (as
    `transformers`' `convert_to_rgb`)."""
    import numpy as np
    from PIL import Image, ImageOps

    image = ImageOps.exif_transpose(load_image(image, where))
    if image.mode in ("I", "I;16", "I;16B", "I;16L", "F"):
        grey = np.nan_to_num(np.asarray(image, dtype=np.float64))  # NaN -> 0
        if image.mode == "F" and grey.max() <= 1.0:
            grey = grey * 255.0
        elif grey.max() > 255:
            grey = grey / 257.0
        image = Image.fromarray(np.clip(grey, 0, 255).round().astype(np.uint8), "L")
    if "A" in image.getbands() or "transparency" in image.info:
        image = Image.alpha_composite(Image.new("RGBA", image.size, "white"), image.convert("RGBA"))
    return image.convert("RGB")


def image_data_uri(image: Any, where: str = "image") -> str:
    """`image` (anything `load_image` takes) as a base64 `data:` URI, the image form both chat wires accept: a data
    URI passes unchanged, encoded bytes keep their format (a JPEG stays a JPEG), a PIL image becomes a PNG; the
    pixels `to_pixels` makes are the same either way."""
    from PIL import Image

    if isinstance(image, str) and image.startswith("data:"):
        return image
    if isinstance(image, Image.Image):
        buffer = io.BytesIO()
        rgb_image(image, where).save(buffer, format="PNG")
        return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    data = _image_bytes(image, where)
    mime = Image.MIME.get(load_image(data, where, verify=True).format or "", "application/octet-stream")
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def to_pixels(image: Any, size: int, where: str = "image") -> torch.Tensor:
    """uint8 [3, size, size] RGB pixels of `image` (as `rgb_image`, resized bilinearly); made pixels pass through."""
    if isinstance(image, torch.Tensor):
        if image.dtype != torch.uint8 or tuple(image.shape) != (3, size, size):
            raise ImageError(f"{where}: pixel tensor must be uint8 [3, {size}, {size}], got {tuple(image.shape)}")
        return image
    from PIL import Image

    rgb = rgb_image(image, where).resize((size, size), Image.Resampling.BILINEAR)
    return torch.frombuffer(bytearray(rgb.tobytes()), dtype=torch.uint8).view(size, size, 3).permute(2, 0, 1).clone()


def pixel_hash(pixels: torch.Tensor) -> str:
    """Content hash of a pixel tensor (what the engine saw, checked again by the trainer)."""
    return hashlib.sha256(pixels.contiguous().numpy().tobytes()).hexdigest()[:16]


IMAGE_PART_TYPES = ("image", "image_url", "input_image")


def message_images(messages: list[dict[str, Any]]) -> list[Any]:
    """Every image in chat `messages` (content parts), in the order the chat template renders placeholders."""
    out = []
    for message in messages:
        for part in message.get("content") if isinstance(message.get("content"), list) else ():
            if isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES:
                value = part.get("image", part.get("image_url"))
                out.append(value["url"] if isinstance(value, dict) and "url" in value else value)
    return out


def expand_image_tokens(ids: list[int], image_token_id: int, per_image: int) -> tuple[list[int], list[int]]:
    """`ids` with each placeholder repeated `per_image` times, and the start position of each image."""
    out, starts = [], []
    for token in ids:
        if token == image_token_id:
            starts.append(len(out))
        out += [token] * (per_image if token == image_token_id else 1)
    return out, starts


def expand_row_images(ids: list[int], mask: list[int], messages: list, cfg, where: str) -> tuple[list, list, list]:
    """(ids, mask, pixels) of a tokenized conversation with its images' placeholders expanded (SFT rows)."""
    images = message_images(messages)
    if cfg is None or cfg.vision is None:
        if images:
            raise ImageError(f"{where}: has {len(images)} image(s) but the model has no vision tower")
        return ids, mask, []
    per, image_id = cfg.vision.tokens_per_image, cfg.image_token_id
    expanded, starts = expand_image_tokens(ids, image_id, per)
    if len(starts) != len(images):
        raise ImageError(f"{where}: the chat template rendered a placeholder count different from {len(images)} images")
    pixels = [to_pixels(im, cfg.vision.image_size, f"{where}: image {k}") for k, im in enumerate(images)]
    # placeholders are inputs, never targets (an image in an assistant turn is not something the model writes)
    mask = [x for m, t in zip(mask, ids, strict=True) for x in ([0] * per if t == image_id else [m])]
    return expanded, mask, pixels


def image_spans(ids: list[int], image_token_id: int, per_image: int, where: str = "prompt") -> list[int]:
    """Start positions of the images in already-expanded `ids`; a run that is not whole images is an error."""
    starts, i = [], 0
    for token, run in itertools.groupby(ids):
        n = len(list(run))
        if token == image_token_id:
            if n % per_image:
                raise ImageError(f"{where}: image placeholder run at {i} has {n} tokens, not a multiple of {per_image}")
            starts += range(i, i + n, per_image)
        i += n
    return starts


class LayerNorm(nn.LayerNorm):
    """`nn.LayerNorm` with its weight and bias in the input's dtype (under autocast too, see `dtypes.py`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.weight.to(x.dtype), self.bias.to(x.dtype)
        return F.layer_norm(x, self.normalized_shape, weight, bias, self.eps).to(x.dtype)


class VisionBlock(nn.Module):
    """Pre-norm encoder layer: x + attn(norm(x)), then x + mlp(norm(x)) (bidirectional, GELU)."""

    def __init__(self, vc: VisionConfig):
        super().__init__()
        self.num_heads = vc.num_heads
        self.attn_norm = LayerNorm(vc.hidden_size, eps=vc.layer_norm_eps)
        self.qkv = nn.Linear(vc.hidden_size, 3 * vc.hidden_size)
        self.proj = nn.Linear(vc.hidden_size, vc.hidden_size)
        self.mlp_norm = LayerNorm(vc.hidden_size, eps=vc.layer_norm_eps)
        self.fc1 = nn.Linear(vc.hidden_size, vc.intermediate_size)
        self.fc2 = nn.Linear(vc.intermediate_size, vc.hidden_size)

    def forward(self, x_nph: torch.Tensor) -> torch.Tensor:
        n, p, h = x_nph.shape
        q, k, v = self.qkv(self.attn_norm(x_nph)).view(n, p, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(n, p, h)
        x_nph = x_nph + self.proj(attn)
        return x_nph + self.fc2(F.gelu(self.fc1(self.mlp_norm(x_nph))))


class VisionTower(nn.Module):
    """uint8 pixels [N, 3, S, S] -> embeddings [N, tokens_per_image, lm_hidden]."""

    def __init__(self, vc: VisionConfig, lm_hidden: int):
        super().__init__()
        self.cfg = vc
        self.patch_embed = nn.Linear(3 * vc.patch_size**2, vc.hidden_size)
        self.pos_embed = nn.Parameter(torch.zeros(vc.tokens_per_image, vc.hidden_size))
        self.layers = nn.ModuleList(VisionBlock(vc) for _ in range(vc.num_layers))
        self.post_norm = LayerNorm(vc.hidden_size, eps=vc.layer_norm_eps)
        self.proj_in = nn.Linear(vc.hidden_size, lm_hidden)
        self.proj_out = nn.Linear(lm_hidden, lm_hidden)

    def forward(self, pixels_n3ss: torch.Tensor) -> torch.Tensor:
        p = self.cfg.patch_size
        dtype = activation_dtype(self.patch_embed.weight)
        x = pixels_n3ss.to(dtype) / 127.5 - 1.0
        patches = F.unfold(x, kernel_size=p, stride=p).transpose(1, 2)  # [N, P, 3*p*p], row-major patches
        x_nph = self.patch_embed(patches) + self.pos_embed.to(dtype)
        for layer in self.layers:
            x_nph = layer(x_nph)
        return self.proj_out(F.gelu(self.proj_in(self.post_norm(x_nph))))
