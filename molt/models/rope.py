"""Rotary position embeddings: inverse frequencies per scaling type, and their application.

Scaling types are registered functions `(dim, theta, params, max_pos) -> (inv_freq, attention_scale)`;
an unsupported `rope_type` is an error of the config. Positions are explicit tensors, so packed sequences simply
restart their positions at 0."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from molt.models.config import TransformerConfig
from molt.registry import Registry

RopeFn = Callable[[int, float, dict[str, Any], int], tuple[Tensor, float]]
ROPE_TYPES: Registry[RopeFn] = Registry("rope type")


def _base_inv_freq(dim: int, theta: float) -> Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


@ROPE_TYPES.register("default")
def _default(dim: int, theta: float, params: dict[str, Any], max_pos: int) -> tuple[Tensor, float]:
    return _base_inv_freq(dim, theta), 1.0


@ROPE_TYPES.register("linear")
def _linear(dim: int, theta: float, params: dict[str, Any], max_pos: int) -> tuple[Tensor, float]:
    return _base_inv_freq(dim, theta) / params["factor"], 1.0


@ROPE_TYPES.register("llama3")
def _llama3(dim: int, theta: float, params: dict[str, Any], max_pos: int) -> tuple[Tensor, float]:
    """Llama 3.1: keep high frequencies, divide low ones by `factor`, blend smoothly in between."""
    inv_freq = _base_inv_freq(dim, theta)
    factor, lo, hi = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    old_ctx = params["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_ctx / lo, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - lo) / (hi - lo)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_ctx / hi) & (wavelen <= old_ctx / lo)
    return torch.where(medium, blended, scaled), 1.0


@ROPE_TYPES.register("yarn")
def _yarn(dim: int, theta: float, params: dict[str, Any], max_pos: int) -> tuple[Tensor, float]:
    """YaRN: interpolate low frequencies, extrapolate high ones, ramp between; scale attention."""
    orig = params.get("original_max_position_embeddings") or max_pos
    factor = params.get("factor") or max_pos / orig

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn = params.get("attention_factor")
    if attn is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attn = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(params.get("beta_fast") or 32), correction_dim(params.get("beta_slow") or 1)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high
    keep = 1 - ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)  # 1 - ramp
    extrapolation = _base_inv_freq(dim, theta)
    return extrapolation / factor * (1 - keep) + extrapolation * keep, float(attn)


def rope_inv_freq(cfg: TransformerConfig) -> tuple[Tensor, float]:
    """(inv_freq [head_dim/2], attention scale) for the config's rope type (checked by the config)."""
    params = dict(cfg.rope_scaling or {})
    kind = params.get("rope_type", "default")
    return ROPE_TYPES[kind](cfg.head_dim, cfg.rope_theta, params, cfg.max_position_embeddings)


def rope_cos_sin(inv_freq: Tensor, scale: float, position_ids_bt: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos/sin tables [B, T, 1, D] for explicit positions, computed in fp32; the sin table's first half
    is negated (rotate-half's sign folded in, see `apply_rope`)."""
    freqs_btf = position_ids_bt.float()[..., None] * inv_freq.float()
    emb_btd = torch.cat((freqs_btf, freqs_btf), dim=-1)
    sign_d = torch.ones(emb_btd.shape[-1], device=emb_btd.device)
    sign_d[: emb_btd.shape[-1] // 2] = -1
    return (emb_btd.cos() * scale).to(dtype)[:, :, None], (emb_btd.sin() * (scale * sign_d)).to(dtype)[:, :, None]


def apply_rope(x_bthd: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate the two halves of the head dimension (the HF / Llama layout): x*cos + rotate_half(x)*sin,
    where rotate_half(x) = (-x2, x1) = roll(x) * sign, the sign being folded into `sin`. Three ops."""
    return torch.addcmul(x_bthd * cos, x_bthd.roll(x_bthd.shape[-1] // 2, dims=-1), sin)
