"""Sparse mixture-of-experts MLP (Qwen3-MoE style): softmax router, top-k, batched expert weights.

Routing is explicit: `route` is a pure function, and a forward may take a `Routing` object that
replays given expert ids (R3: the trainer uses the experts the rollout engine chose) and records
what each MoE layer did (the engine's capture, the trainer's agreement / load metrics). Experts
are stored as stacked tensors [E, ...]; tokens are grouped by expert with one sort, then each
expert with work runs two matmuls. No parallelism, no RL here."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from molt.models.config import TransformerConfig
from molt.models.dtypes import no_autocast

NO_ROUTE = -1  # a position without a recorded routing: it routes live


def route(
    logits_ne: torch.Tensor, top_k: int, normalize: bool, fp32: bool = True, replay_nk: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [N, k], expert ids [N, k]): softmax over all experts, keep top-k, optionally renormalise.

    With `replay_nk`, tokens whose replay row is not NO_ROUTE use those experts instead of their own
    top-k; their weights are still the live router probabilities of those experts (so the router
    keeps learning through them)."""
    return select(router_probs(logits_ne, fp32), top_k, normalize, replay_nk)[:2]


def router_probs(logits_ne: torch.Tensor, fp32: bool) -> torch.Tensor:
    """Softmax over experts, in fp32 or in the logits' dtype (cast back: autocast would return fp32)."""
    return F.softmax(logits_ne.float(), dim=-1) if fp32 else F.softmax(logits_ne, dim=-1).to(logits_ne.dtype)


def select(
    probs_ne: torch.Tensor, top_k: int, normalize: bool, replay_nk: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weights, experts used, the router's own top-k experts), all [N, k], from router probabilities."""
    weights_nk, live_nk = probs_ne.topk(top_k, dim=-1)
    experts_nk = live_nk
    if replay_nk is not None:
        experts_nk = torch.where(replay_nk[:, :1] >= 0, replay_nk.to(live_nk.dtype), live_nk)
        weights_nk = probs_ne.gather(1, experts_nk)
    if normalize:
        weights_nk = weights_nk / weights_nk.sum(dim=-1, keepdim=True)
    return weights_nk, experts_nk, live_nk


class Routing:
    """Routing input/output of one forward, passed explicitly to `Transformer.forward`.

    `replay_nlk`: expert ids [N, L, k] to use per flattened token (N = B*T) and MoE layer (in layer
    order); rows of NO_ROUTE route live. After the forward, per MoE layer: `chosen` [N, k] the
    experts used, `live` [N, k] the router's own top-k, `probs` [N, E] the router probabilities
    (with grad: load-balancing losses use them). A plain class, not a dataclass: wrappers that
    rebuild dataclass arguments holding grad tensors (FSDP2 does) would make later layers record
    into a copy."""

    def __init__(self, replay_nlk: torch.Tensor | None = None):
        self.replay_nlk = replay_nlk
        self.chosen, self.live, self.probs = [], [], []  # per MoE layer, in layer order

    def route(self, logits_ne: torch.Tensor, top_k: int, normalize: bool, fp32: bool):
        """Route one MoE layer (the next in layer order) and record it; returns (weights, experts)."""
        replay = None if self.replay_nlk is None else self.replay_nlk[:, len(self.chosen)]
        probs_ne = router_probs(logits_ne, fp32)
        weights_nk, experts_nk, live_nk = select(probs_ne, top_k, normalize, replay)
        self.chosen.append(experts_nk)
        self.live.append(live_nk)
        self.probs.append(probs_ne)
        return weights_nk, experts_nk

    def chosen_nlk(self) -> torch.Tensor:
        """The experts used, [N, L, k] (L = MoE layers)."""
        return torch.stack(self.chosen, dim=1)


class SparseMoE(nn.Module):
    """Router + E SwiGLU experts; each token is processed by its top-k experts, gate-weighted.

    `fp32`: the router's matmul, softmax and the gate-weighted combine run in fp32 (whatever the
    parameter dtype), so a bf16 model's expert choice is not decided by bf16 rounding."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.top_k, self.normalize, self.fp32 = cfg.num_experts_per_tok, cfg.norm_topk_prob, cfg.router_fp32
        hidden, inner = cfg.hidden_size, cfg.moe_intermediate_size
        self.gate = nn.Linear(hidden, cfg.num_experts, bias=False)
        self.gate_up_proj = nn.Parameter(torch.empty(cfg.num_experts, 2 * inner, hidden))
        self.down_proj = nn.Parameter(torch.empty(cfg.num_experts, hidden, inner))

    def forward(self, x_bth: torch.Tensor, routing: Routing | None = None) -> torch.Tensor:
        x_nh = x_bth.reshape(-1, x_bth.shape[-1])
        if self.fp32:  # autocast off, so that the trainer's mixed precision too has an fp32 router, and the weight
            # as a copy in the activations' dtype holds it (an fp32 master's rounded, as the engine's bf16 copy)
            with no_autocast(x_nh.device.type):
                logits_ne = F.linear(x_nh.float(), self.gate.weight.to(x_nh.dtype).float())
        else:
            logits_ne = self.gate(x_nh)
        routing = routing if routing is not None else Routing()  # nothing to replay; the record is dropped
        weights_nk, experts_nk = routing.route(logits_ne, self.top_k, self.normalize, self.fp32)
        return self.mix(x_nh, weights_nk, experts_nk).view_as(x_bth)

    def mix(self, x_nh: torch.Tensor, weights_nk: torch.Tensor, experts_nk: torch.Tensor) -> torch.Tensor:
        """Weighted sum of each token's chosen experts' outputs (weights combined in fp32 if asked)."""
        flat_e = experts_nk.reshape(-1)
        order = flat_e.argsort(stable=True)
        token_of = order // self.top_k
        counts = torch.bincount(flat_e, minlength=self.gate_up_proj.shape[0]).tolist()
        x_sorted = x_nh[token_of]
        outputs = []
        # unbind once: indexing [e] per expert would make backward add E full-size zero gradients per layer
        gate_up_e, down_e = self.gate_up_proj.unbind(0), self.down_proj.unbind(0)
        for e, x_e in enumerate(x_sorted.split(counts)):
            if x_e.shape[0] == 0:
                continue
            gate, up = F.linear(x_e, gate_up_e[e]).chunk(2, dim=-1)
            outputs.append(F.linear(F.silu(gate) * up, down_e[e]))
        y_sorted = torch.cat(outputs) if outputs else x_sorted[:0]
        combine_dtype = torch.float32 if self.fp32 else x_nh.dtype
        y_sorted = y_sorted.to(combine_dtype) * weights_nk.reshape(-1)[order, None].to(combine_dtype)
        out = torch.zeros(x_nh.shape, dtype=combine_dtype, device=x_nh.device)
        return out.index_add_(0, token_of, y_sorted).to(x_nh.dtype)
