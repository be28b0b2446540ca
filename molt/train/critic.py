"""The PPO critic (`--algo.estimator gae`): the policy's architecture with a scalar value head, its optimizer.

`ValueModel` wraps a `Transformer` body (its final hidden states, `return_hidden=True`) and a `Linear(hidden, 1)`
head, so the model code stays free of RL. Values come out in the same packed layout as the policy's log-probs
(`molt.train.logprobs.packed_hidden`): the value at flat position p is V(state before the token predicted at p),
so unpacking them like the log-probs gives `values_bt[b, t]` = V before action token t (shared prefixes
included: a tail's first value is read at the prefix's last position, as its first log-prob is).

The body starts as a copy of the initial policy (default) or the HF folder `--critic.path`; the head starts at
zero (V = 0 before the first update). The LM head is dropped: a critic never needs the [T, V] logits.
Knows the model and the packed layout; nothing of trajectories, advantages or the loop.
"""

from __future__ import annotations

import copy
import dataclasses

import torch
from torch import nn

from molt.config import Config
from molt.models import Transformer, from_pretrained
from molt.train.logprobs import laid_out_rows, packed_hidden
from molt.train.optim import build_optimizer
from molt.train.packing import PackedBatch
from molt.train.precision import Precision


class ValueModel(nn.Module):
    """A transformer body plus a scalar head: one value per packed position."""

    def __init__(self, body: Transformer):
        super().__init__()
        body.lm_head = nn.Identity()  # hidden states only; a tied embedding stays with `embed_tokens`
        self.body = body
        self.head = nn.Linear(body.cfg.hidden_size, 1)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, packed: PackedBatch) -> torch.Tensor:
        """fp32 values laid out like `token_logprobs` ([R, W], or flat [R * W + E] with forks); positions
        whose target is not trained hold 0 (only trained positions and forks are computed)."""
        hidden_nh, at_n, _ = packed_hidden(self.body, packed, routing=None, trained_only=True)
        values_n = self.head(hidden_nh).float()[:, 0]
        return laid_out_rows(values_n, at_n, packed, trained_only=True)


class Critic:
    """The value model with its own AdamW and schedule (`--critic.lr`, the policy's warm-up and decay)."""

    def __init__(self, policy: Transformer, cfg: Config, precision: Precision):
        body = from_pretrained(cfg.critic.path) if cfg.critic.path else copy.deepcopy(policy)
        self.model = ValueModel(body.requires_grad_(True)).to(cfg.runtime.device, precision.params).train()
        self.clip = cfg.critic.clip or None
        self.updates = cfg.critic.updates
        self.scaler = precision.scaler()
        train_cfg = dataclasses.replace(cfg.train, lr=cfg.critic.lr or cfg.train.lr)
        self.opt, self.schedule = build_optimizer(self.model.parameters(), train_cfg)

    def state_dict(self) -> dict:
        """Weights, optimizer and schedule: everything a resumed run needs to continue exactly."""
        return {
            "model": self.model.state_dict(),
            "optimizer": self.opt.state_dict(),
            "schedule": self.schedule.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["optimizer"])
        self.schedule.load_state_dict(state["schedule"])


def explained_variance(sums: dict[str, float]) -> float:
    """1 - Var(returns - values) / Var(returns) over the step's action tokens, from accumulated sums
    (`ret`, `ret2`, `err`, `err2`, `n`); 0 when the returns do not vary."""
    n = max(sums["n"], 1.0)
    var_ret = sums["ret2"] / n - (sums["ret"] / n) ** 2
    var_err = sums["err2"] / n - (sums["err"] / n) ** 2
    return 1.0 - var_err / var_ret if var_ret > 1e-12 else 0.0
