"""MoE routing in the trainer's forward: replay of the engine's experts (R3), agreement, load, aux loss.

`forward_routing` builds the `Routing` a packed forward takes (replaying the recorded expert ids when
`algo.routing_replay`); `routing_stats` turns what it recorded into step sums and the Switch load-balancing
loss; `logprob_diffs` sums the log-prob mismatch with replayed *and* live routing; `freeze_routers` applies
`train.freeze_router`. Math lives in `molt/algo/routing.py`; nothing here knows the loop or engines."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from molt import algo
from molt.config import AlgoConfig, Config, ConfigError
from molt.models import Routing, Transformer
from molt.train.packing import PackedBatch, collate_routing


def forward_routing(packed: PackedBatch, replay: bool) -> Routing:
    """The Routing object for one packed forward: replays `packed.routing` when asked, records always."""
    return Routing(replay_nlk=packed.routing.flatten(0, 1) if replay and packed.routing is not None else None)


def routing_stats(routing: Routing, packed: PackedBatch, sums: dict) -> torch.Tensor:
    """Add this micro-batch's routing sums to `sums`; returns its mean-over-layers load-balancing loss.

    Sums: `moe_agree` / `moe_recorded` (token-layers whose live top-k set equals the recorded one,
    and token-layers with a record), `moe_load` [layers, E] token-expert assignments."""
    valid_n = (packed.doc_ids >= 0).flatten()
    recorded = packed.routing.flatten(0, 1) if packed.routing is not None else None
    losses, loads = [], []
    layers = zip(routing.live, routing.chosen, routing.probs, strict=True)
    for layer, (live_nk, chosen_nk, probs_ne) in enumerate(layers):
        if recorded is not None:
            has_record_n = valid_n & (recorded[:, layer, 0] >= 0)
            agree, total = algo.routing_agreement(live_nk, recorded[:, layer], has_record_n)
            sums["moe_agree"] = sums.get("moe_agree", 0.0) + agree
            sums["moe_recorded"] = sums.get("moe_recorded", 0.0) + total
        loads.append(algo.expert_load(chosen_nk, valid_n, probs_ne.shape[-1]))
        losses.append(algo.load_balance_loss(probs_ne, chosen_nk, valid_n))
    load_le = torch.stack(loads).cpu()
    sums["moe_load"] = sums["moe_load"] + load_le if "moe_load" in sums else load_le
    sums["moe_real"] = sums.get("moe_real", 0.0) + float(valid_n.sum()) * len(loads)
    return torch.stack(losses).mean()


def logprob_diffs(
    sums: dict, packed: PackedBatch, cfg: AlgoConfig, batch: algo.PolicyBatch, other_logp: Callable[[Routing], Tensor]
) -> None:
    """Add this micro-batch's |trainer - rollout| log-prob sums with replayed and live routing to `sums`.

    `batch.logp_bt` is the loss's forward (replayed experts if `algo.routing_replay`, else live); with
    `algo.moe_diff_both`, `other_logp(routing)` ([b, T] log-probs) runs once more, without grad, in
    the other mode. Nothing without recorded routing (both modes would route live)."""
    if packed.routing is None:
        return
    modes = ("replay", "live") if cfg.routing_replay else ("live", "replay")
    logps = [batch.logp_bt.detach()]
    if cfg.moe_diff_both:
        with torch.no_grad():
            logps.append(other_logp(forward_routing(packed, not cfg.routing_replay)))
    for mode, mode_logp_bt in zip(modes, logps, strict=False):
        diff = float(((mode_logp_bt - batch.rollout_logp_bt).abs() * batch.mask_bt).sum())
        sums[f"moe_diff_{mode}"] = sums.get(f"moe_diff_{mode}", 0.0) + diff
    sums["moe_diff_tokens"] = sums.get("moe_diff_tokens", 0.0) + float(batch.mask_bt.sum())


def routing_metrics(sums: dict) -> dict[str, float]:
    """Per-step `moe/*` metrics from the summed routing stats (empty for dense models)."""
    if "moe_load" not in sums:
        return {}
    imbalance = [algo.load_imbalance(load_e) for load_e in sums["moe_load"]]
    out = {
        "moe/load_cv": sum(cv for cv, _ in imbalance) / len(imbalance),
        "moe/load_max_over_mean": max(m for _, m in imbalance),
        "moe/aux_loss": sums.get("moe_aux", 0.0),
        "moe/recorded_frac": sums.get("moe_recorded", 0.0) / max(sums["moe_real"], 1.0),
    }
    if sums.get("moe_recorded"):
        out["moe/routing_agreement"] = sums["moe_agree"] / sums["moe_recorded"]
    for mode in ("replay", "live"):
        if f"moe_diff_{mode}" in sums:
            out[f"moe/logprob_diff_{mode}"] = sums[f"moe_diff_{mode}"] / max(sums["moe_diff_tokens"], 1.0)
    return out


def attach_routing(packs: list[PackedBatch], routings: list, shape_lk: tuple[int, int]) -> None:
    """Lay each sample's recorded routing out like its packed tokens (`packed.routing`), if any was recorded."""
    if all(r is None for r in routings):
        return
    for packed in packs:
        packed.routing = collate_routing(routings, packed.rows, packed.input_ids.shape[1], shape_lk)


def freeze_routers(model: Transformer, cfg: Config) -> set[str]:
    """Check the MoE flags against the model; freeze (requires_grad off) and return the router names if asked."""
    a, moe = cfg.algo, model.cfg.num_moe_layers()
    for flag, on in [("algo.routing_replay", a.routing_replay), ("algo.moe_aux_coef", a.moe_aux_coef > 0),
                     ("train.freeze_router", cfg.train.freeze_router)]:  # fmt: skip
        if on and not moe:
            raise ConfigError(f"{flag}: the model has no mixture-of-experts layers (num_experts = 0)")
    names = set(model.router_names()) if cfg.train.freeze_router else set()
    for name, param in model.named_parameters():
        if name in names:
            param.requires_grad_(False)
    return names
