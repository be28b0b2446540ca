"""The PPO critic (`--algo.estimator gae`, or one of your own that needs `values_bt`): the policy's architecture
with a scalar value head, its optimizer; it regresses on the run's estimator's returns.

`ValueModel` wraps a `Transformer` body (final hidden states; the LM head is dropped) and a zero-initialised
`Linear(hidden, 1)` head, so the model code stays free of RL. Values come out in the packed layout of the
policy's log-probs (`molt.train.logprobs.packed_hidden`): unpacked like them, `values_bt[b, t]` = V before action
token t (shared prefixes included). The body starts as a copy of the initial policy or the HF folder
`--critic.path`. Data parallel, the value model is sharded like the policy (FSDP2) and its loss sums are
all-reduced. Knows the model, the packed micro-batches and the value loss; nothing of trajectories or the loop."""

from __future__ import annotations

import copy
import dataclasses
import logging
import time
from collections.abc import Callable

import torch
from torch import nn

from molt import algo
from molt.config import Config, ConfigError
from molt.models import Transformer, from_pretrained
from molt.train import parallel
from molt.train.compile import prepare_layers
from molt.train.logprobs import laid_out_rows, packed_hidden
from molt.train.optim import build_optimizer
from molt.train.packing import PackedBatch
from molt.train.precision import Precision, clip_and_step

log = logging.getLogger("molt.train")

Returns = Callable[[object, torch.Tensor, torch.Tensor], torch.Tensor]  # (micro-batch, mask_bt, values_bt) -> [B, T]

SUMS = ("loss", "clip", "n", "value", "ret", "ret2", "err", "err2")


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
    """The value model with its own AdamW and schedule (`--critic.lr`, the policy's warm-up and decay).

    `shard` (data parallel): wraps the value model like the policy (FSDP2) before its optimizer is built; the
    forward then runs without autocast (FSDP2 casts the parameters)."""

    def __init__(self, policy: Transformer, cfg: Config, precision: Precision, shard: Callable | None = None):
        if algo.ESTIMATORS.info(cfg.algo.estimator)["group_baseline"]:  # one of your own: its targets are per row
            log.warning("--algo.estimator %s compares a rollout with its group, but the critic's targets are its "
                        "returns computed per micro-batch, which may split a group (docs/algorithms.md)",
                        cfg.algo.estimator)  # fmt: skip
        if cfg.critic.path:  # wrapped as the policy is; a copy of the policy inherits its wrapping
            body = from_pretrained(cfg.critic.path, router_fp32=cfg.model.router_fp32)
            if body.cfg.vision is None and policy.cfg.vision is not None:
                raise ConfigError(f"critic.path: the policy reads images but {cfg.critic.path} has no vision tower")
            prepare_layers(body, cfg.train, cfg.runtime.device)
        else:
            body = copy.deepcopy(policy)
        self.model = ValueModel(body.requires_grad_(True)).to(cfg.runtime.device, precision.params).train()
        self.clip, self.updates, self.scaler = cfg.critic.clip or None, cfg.critic.updates, precision.scaler()
        self.path, self.skipped = cfg.critic.path, 0  # skipped: optimizer steps a float16 loss scaler left out
        self.precision, self.device, self.grad_clip = precision, cfg.runtime.device, cfg.train.grad_clip
        if shard is not None:
            shard(self.model)
            self.precision = precision.unsharded()
        self.train_cfg = dataclasses.replace(cfg.train, lr=cfg.critic.lr or cfg.train.lr)  # its optimizer's settings
        self.opt, self.schedule = build_optimizer(self.model.parameters(), self.train_cfg)

    def train(self, mbs: list, lengths: list[int], returns: Returns, denoms,
              num_mbs: int) -> tuple[list[list[float]], dict[str, float]]:  # fmt: skip
        """Values at every token of every sample (before the update) and `--critic.updates` critic optimizer steps.

        `mbs`: the trainer's micro-batches of samples of `lengths` tokens; `returns(mb, mask_bt, values_bt)`: the
        run's estimator's returns of a micro-batch's rows from their values. The first update's forward gives V_old
        (what the estimator reads) and each row's returns, the targets of every update:
        forward, clipped value loss (token-mean over the step: `denoms`) and backward per micro-batch, then one
        optimizer step. The clip bounds V - V_old, so it binds from the second update on. A rank runs zero-scaled
        repeats of its last micro-batch up to `num_mbs`, so every rank's FSDP collectives line up."""
        t0 = time.perf_counter()
        values: list[list[float]] = [[] for _ in lengths]
        targets: list[tuple[torch.Tensor, torch.Tensor]] = []  # per micro-batch: (V_old, returns)
        passes = []
        for _ in range(self.updates):
            sums = self._update(mbs, lengths, returns, denoms, targets, values)
            for _ in range(num_mbs - len(mbs)):
                self._loss(self._values(mbs[-1]), mbs[-1], denoms, *targets[-1])[0].mul(0.0).backward()
            grad_norm, stepped = clip_and_step(self.opt, self.model.parameters(), self.grad_clip, self.scaler)
            self.skipped += not stepped
            passes.append((parallel.all_reduce_sums(sums), float(grad_norm)))
        lr = self.schedule.get_last_lr()[0]
        self.schedule.step()  # once per batch: the schedule counts policy steps
        (first, _), (last, grad_norm) = passes[0], passes[-1]
        n = max(first["n"], 1.0)
        return values, {
            "critic/value_loss": first["loss"],  # at V_old: the loss of the values the estimator used
            "critic/value_loss_last": last["loss"],
            "critic/explained_variance": explained_variance(first),
            "critic/value_mean": first["value"] / n,
            "critic/return_mean": first["ret"] / n,
            "critic/clip_frac": last["clip"] / n,
            "critic/grad_norm": grad_norm,
            "critic/skipped_steps": self.skipped,
            "critic/lr": lr,
            "time/critic_s": time.perf_counter() - t0,
        }

    def _update(self, mbs, lengths, returns: Returns, denoms, targets, values) -> dict[str, float]:
        """One update's forward + clipped value loss + backward per micro-batch; the first one fills `targets`
        (V_old and the estimator's returns) and `values` (V_old per sample). Sums for the metrics."""
        sums = dict.fromkeys(SUMS, 0.0)
        for k, mb in enumerate(mbs):
            values_bt = self._values(mb)
            mask_bt = mb.mask_bt.to(values_bt.device)
            if k == len(targets):  # the first update: these are V_old
                targets.append((values_bt.detach(), returns(mb, mask_bt, values_bt.detach())))
                for b, i in enumerate(mb.samples):
                    values[i] = values_bt[b, : lengths[i]].detach().tolist()
            loss, clip_frac = self._loss(values_bt, mb, denoms, *targets[k])
            (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
            returns_bt, values_bt = targets[k][1], values_bt.detach()
            err_bt = (returns_bt - values_bt) * mask_bt
            batch = dict(loss=loss.detach(), n=mask_bt, value=values_bt * mask_bt, ret=returns_bt, ret2=returns_bt**2,
                         err=err_bt, err2=err_bt**2)  # fmt: skip
            for key, value in batch.items():
                sums[key] += float(value.sum())
            sums["clip"] += clip_frac * float(mask_bt.sum())
        return sums

    def _values(self, mb) -> torch.Tensor:
        """Values [b, T] of a micro-batch's samples, with grad."""
        with self.precision.autocast():
            return mb.unpack(self.model(mb.packed.to(self.device)))

    def _loss(self, values_bt, mb, denoms, old_bt, returns_bt) -> tuple[torch.Tensor, float]:
        """The clipped value loss of one micro-batch (token-mean over the step) and its clip fraction."""
        mask_bt = mb.mask_bt.to(values_bt.device)
        loss_bt, metrics = algo.value_loss(values_bt, old_bt, returns_bt, mask_bt, self.clip)
        return algo.aggregate("token-mean", loss_bt, mask_bt, denoms), float(metrics.get("value_clip_frac", 0.0))

    def _parts(self) -> dict:
        return {"model": self.model, "optimizer": self.opt, "schedule": self.schedule}

    def state_dict(self) -> dict:
        return {key: part.state_dict() for key, part in self._parts().items()} | {"skipped": self.skipped}

    def load_state_dict(self, state: dict) -> None:
        """A checkpoint's critic; its body's architecture comes from `critic.path` (or the policy), so another
        folder's is a ConfigError naming it."""
        try:
            self.model.load_state_dict(state["model"])
        except RuntimeError as e:
            shapes = str(e).split("\n")[1].strip() if "\n" in str(e) else str(e)
            raise ConfigError(
                f"critic.path: {self.path or 'the policy'} is not the architecture of the critic this "
                f"checkpoint holds ({shapes}); give the folder the run's critic started from"
            ) from None
        for key, part in self._parts().items():
            if key != "model":
                part.load_state_dict(state[key])
        self.skipped = state.get("skipped", 0)


def explained_variance(sums: dict[str, float]) -> float:
    """1 - Var(returns - values) / Var(returns) over the step's action tokens, from accumulated sums
    (`ret`, `ret2`, `err`, `err2`, `n`); 0 when the returns do not vary."""
    n = max(sums["n"], 1.0)
    var_ret = sums["ret2"] / n - (sums["ret"] / n) ** 2
    var_err = sums["err2"] / n - (sums["err"] / n) ** 2
    return 1.0 - var_err / var_ret if var_ret > 1e-12 else 0.0
