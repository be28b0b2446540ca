"""Molt's one transformer: Llama / Qwen2 / Qwen3 dense and Qwen3-MoE from one `TransformerConfig`.

The forward takes token ids and explicit position ids, plus either `doc_ids` (packed training rows:
no attention across samples) or a `cache` (incremental decoding; see `attention.py`). Parameter
names follow HF's (fusing q/k/v or gate/up measured slower on CPU: the split's backward copies).
The model knows nothing about parallelism, sampling or RL."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from molt.models.attention import Cache, packed_attention, take_columns
from molt.models.config import TransformerConfig
from molt.models.dtypes import activation_dtype
from molt.models.moe import Routing, SparseMoE
from molt.models.rope import apply_rope, rope_cos_sin, rope_inv_freq
from molt.models.vision import VisionTower


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in fp32, rounded to the input's dtype, then scaled by the learned weight in
    that dtype (as `transformers` does; under autocast the fp32 master weight is cast first, see `dtypes.py`)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype == torch.float32:  # one fused op (bitwise equal to the lines below in fp32)
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight.to(x.dtype) * x32.to(x.dtype)


class SelfAttention(nn.Module):
    """Grouped-query attention with optional q/k RMSNorm (per head) and q/k/v bias."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.head_dim = cfg.head_dim  # the head counts follow from the projections' widths
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.o_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else nn.Identity()
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else nn.Identity()

    def forward(self, x_bth: Tensor, cos: Tensor, sin: Tensor, attend, layer_idx: int, queries_bq=None):
        """Attention output at every position, or only at columns `queries_bq` [B, Q] (keys and values
        still come from every position; `attend` must expect those queries)."""
        b, t, _ = x_bth.shape
        d = self.head_dim
        xq_bth, cos_q, sin_q = x_bth, cos, sin
        if queries_bq is not None:
            xq_bth, cos_q, sin_q = (take_columns(x, queries_bq) for x in (x_bth, cos, sin))
        # norm and rope in [B, T, H, D]: the backend gets transposed views of contiguous tensors
        q_bqhd = apply_rope(self.q_norm(self.q_proj(xq_bth).view(b, xq_bth.shape[1], -1, d)), cos_q, sin_q)
        k_bthd = apply_rope(self.k_norm(self.k_proj(x_bth).view(b, t, -1, d)), cos, sin)
        v_bthd = self.v_proj(x_bth).view(b, t, -1, d)
        out_bhqd = attend(layer_idx, q_bqhd.transpose(1, 2), k_bthd.transpose(1, 2), v_bthd.transpose(1, 2))
        return self.o_proj(out_bhqd.transpose(1, 2).reshape(b, xq_bth.shape[1], -1))


class SwiGLU(nn.Module):
    """Dense gated MLP: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, inner: int, bias: bool):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=bias)
        self.up_proj = nn.Linear(hidden, inner, bias=bias)
        self.down_proj = nn.Linear(inner, hidden, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: TransformerConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = SelfAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        moe = cfg.is_moe_layer(layer_idx)
        self.mlp = SparseMoE(cfg) if moe else SwiGLU(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)

    def forward(self, x_bth, cos, sin, attend, routing: Routing | None = None, queries_bq=None):
        """[B, T, H] out; with `queries_bq` only those columns' outputs [B, Q, H] (see `SelfAttention`)."""
        attn = self.self_attn(self.input_layernorm(x_bth), cos, sin, attend, self.layer_idx, queries_bq)
        x_bth = (x_bth if queries_bq is None else take_columns(x_bth, queries_bq)) + attn
        h_bth = self.post_attention_layernorm(x_bth)
        return x_bth + (self.mlp(h_bth, routing) if isinstance(self.mlp, SparseMoE) else self.mlp(h_bth))


class Transformer(nn.Module):
    """Decoder-only causal LM. `forward` returns logits [B, T, V] (or final hidden states)."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.vision = VisionTower(cfg.vision, cfg.hidden_size) if cfg.vision is not None else None
        self.register_buffer("inv_freq", torch.empty(cfg.head_dim // 2), persistent=False)
        self.reset_rope()

    def reset_rope(self) -> None:
        """(Re)compute the rotary inverse frequencies from the config."""
        inv_freq, self.rope_scale = rope_inv_freq(self.cfg)
        self.inv_freq = inv_freq.to(self.inv_freq.device)

    def _apply(self, fn, recurse=True):
        """Casts and moves (`to`, `cuda`, `to_empty`, ...) recompute the rotary frequencies in fp32: `.to(bf16)`
        would round them, turning position p's angles by ~p * 2^-9 rad (an engine's bf16 copy then computes
        another function than the trainer's fp32 master: vLLM, too, keeps them fp32)."""
        super()._apply(fn, recurse)
        self.reset_rope()
        return self

    def forward(
        self,
        input_ids_bt: Tensor,
        position_ids_bt: Tensor | None = None,
        *,
        doc_ids_bt: Tensor | None = None,
        parent_ids_bt: Tensor | None = None,
        cache: Cache | None = None,
        return_hidden: bool = False,
        routing: Routing | None = None,
        pixel_values: Tensor | None = None,
        image_embeds_nh: Tensor | None = None,
        outputs_bq: Tensor | None = None,
        attention: str = "auto",
    ) -> Tensor:
        """Logits for `input_ids_bt` at explicit positions (default 0..T-1 per row).

        `doc_ids_bt` packs several samples per row (see `PackedCausal`, also for `parent_ids_bt`); `cache`
        switches to incremental decoding. `routing` (MoE) replays and records expert ids (see `moe.py`).
        A VLM takes uint8 `pixel_values` [N, 3, S, S] (whole images, in placeholder order) or `image_embeds_nh`,
        one row per `image_token_id` position in row-major order. `outputs_bq` (packed training, dense models):
        only these columns' logits [B, Q, V], equal to the full forward's there. `attention`: the packed
        backend (see `attention.packed_attention`)."""
        if position_ids_bt is None:
            position_ids_bt = torch.arange(input_ids_bt.shape[1], device=input_ids_bt.device).expand_as(input_ids_bt)
        if cache is not None and doc_ids_bt is not None:
            raise ValueError("pass either doc_ids_bt (packed training) or cache (decoding), not both")
        if outputs_bq is not None and (cache is not None or routing is not None):
            raise ValueError("outputs_bq is for packed training of dense models (no cache, no MoE routing)")
        attend = (
            packed_attention(doc_ids_bt, parent_ids_bt, attention) if cache is None else cache.prepare(position_ids_bt)
        )
        # the residual stream runs in the compute dtype, under autocast too (see `dtypes.py`)
        x_bth = self.embed_tokens(input_ids_bt).to(activation_dtype(self.embed_tokens.weight))
        if pixel_values is not None:
            image_embeds_nh = self.vision(pixel_values).flatten(0, 1)
        if image_embeds_nh is not None or self.cfg.image_token_id is not None:
            x_bth = self._scatter_images(input_ids_bt, x_bth, image_embeds_nh)
        cos, sin = rope_cos_sin(self.inv_freq, self.rope_scale, position_ids_bt.clamp(min=0), x_bth.dtype)
        for layer in self.layers[:-1]:
            x_bth = layer(x_bth, cos, sin, attend, routing)
        # with `outputs_bq`, the last layer's queries, MLP and head only where an output is wanted
        last_attend = attend if outputs_bq is None else attend.select_queries(outputs_bq)
        x_bth = self.layers[-1](x_bth, cos, sin, last_attend, routing, outputs_bq)
        x_bth = self.norm(x_bth)
        return x_bth if return_hidden else self.lm_head(x_bth)

    def _scatter_images(self, ids_bt: Tensor, x_bth: Tensor, embeds_nh: Tensor | None):
        """Image embeddings written over the embeddings of the placeholder positions (counts must match)."""
        if self.cfg.image_token_id is None:
            raise ValueError("image embeddings given to a model without image_token_id (not a VLM)")
        mask_bt = ids_bt == self.cfg.image_token_id
        num_rows = 0 if embeds_nh is None else embeds_nh.shape[0]
        if int(mask_bt.sum()) != num_rows:
            raise ValueError(f"{int(mask_bt.sum())} image placeholder tokens but {num_rows} image embedding rows")
        return x_bth if embeds_nh is None else x_bth.masked_scatter(mask_bt[..., None], embeds_nh.to(x_bth.dtype))

    @torch.no_grad()
    def init_weights(self, std: float = 0.02, generator: torch.Generator | None = None) -> Transformer:
        """Random init (normal(0, std) matrices, zero biases, unit norms) for models built from config."""
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.normal_(0.0, std, generator=generator)
        return self

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def router_names(self) -> list[str]:
        """Parameter names of the MoE routers (gate weights), in layer order."""
        return [f"{name}.gate.weight" for name, m in self.named_modules() if isinstance(m, SparseMoE)]
