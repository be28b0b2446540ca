"""The RL trainer: token checks, advantages, packed log-prob forward, loss through `molt/algo`, step.

One `step(trajectories)` is one optimizer step over a batch of complete groups (policy version +1). The forward
runs on packed rows; per-token values are laid out per sample as the padded [B, T] tensors `molt/algo` expects,
and every micro-batch's loss uses the step's global denominators, so the gradient does not depend on the split
(except the MoE load-balancing loss, `--algo.moe_aux_coef`, computed per micro-batch over its packed positions as
Megatron-style trainers do).

Order of one step:
1. micro-batches and step denominators;
2. per-token signals: the teacher's no-grad log-probs (`--algo.teacher`: reverse KL of the sampled tokens) and
   the critic's pass (`Critic.train`: values V_old for the estimator, then `--critic.updates` value-loss updates
   toward its returns);
3. advantages over the whole batch (group statistics, whitening) from the shaped rewards (overlong penalty,
   clip), values and teacher KL;
4. the policy's forward + loss + backward per micro-batch, one optimizer step.
LoRA (`--train.lora_rank`): only the adapters train; `weights()` and checkpoints give the merged policy. The
KL-loss coefficient `--algo.kl_coef` adapts toward `--algo.kl_target` when set (`train/kl_coef`). A resume trains
with the config it is given: its learning rates, schedule, AdamW settings and (fixed) KL coefficient. Data parallel
(`fsdp=True`, in each `molt.runtime.ranks.TrainerRank`): every model is FSDP2-sharded, each rank runs step 2 on
its own samples and the per-sample values and KL are gathered, so step 3 sees the whole batch."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import time
from pathlib import Path

import torch

from molt import algo
from molt.config import Config, TrainConfig
from molt.config.training import check_rl_batch
from molt.data.trajectory import Trajectory
from molt.models import Transformer
from molt.train import parallel, routing
from molt.train.batch import MicroBatch, check_tokens, layout, padded, per_sample, trajectory_pixels
from molt.train.compile import prepare_layers
from molt.train.critic import Critic, Returns
from molt.train.logprobs import token_logprobs, token_logprobs_entropy
from molt.train.lora import LoRA, save_policy
from molt.train.optim import build_optimizer
from molt.train.packing import PackedBatch, pack
from molt.train.precision import Precision, clip_and_step
from molt.train.teacher import load_teacher, teacher_logprobs


def resume_optimizer(
    opt: torch.optim.Optimizer, schedule: torch.optim.lr_scheduler.LambdaLR, train: TrainConfig
) -> None:
    """Make a restored AdamW and schedule (`build_optimizer`'s) train with `train`'s lr, betas and weight decay (first
    group only), the current lr recomputed from this config's schedule at the restored step."""
    schedule.base_lrs = [train.lr] * len(opt.param_groups)
    schedule._last_lr = [train.lr * fn(schedule.last_epoch) for fn in schedule.lr_lambdas]  # noqa: SLF001 - get_last_lr
    for i, (group, lr) in enumerate(zip(opt.param_groups, schedule._last_lr, strict=True)):  # noqa: SLF001
        group.update(lr=lr, initial_lr=train.lr, betas=train.betas, weight_decay=train.weight_decay if i == 0 else 0.0)


def _add(sums: dict[str, float], **values: torch.Tensor) -> None:
    for name, value in values.items():
        sums[name] = sums.get(name, 0.0) + float(value.sum())


class Trainer:
    """Owns the policy's training copy, its optimizer and version; `step` trains on one batch."""

    def __init__(self, model: Transformer, cfg: Config, fsdp: bool = False):
        """`fsdp` (a `TrainerRank`): every model it builds is FSDP2-sharded before the optimizers are built."""
        check_rl_batch(cfg.train, cfg.rollout.max_len)
        self.precision = Precision.of(cfg.model.dtype, cfg.train.precision, cfg.runtime.device)
        self.model, self.cfg = model.to(self.precision.params), cfg
        prepare_layers(model, cfg.train, cfg.runtime.device)  # a critic copied from it inherits the wrapping
        self.scaler = self.precision.scaler()
        self.moe_shape = (model.cfg.num_moe_layers(), model.cfg.num_experts_per_tok)
        self.frozen = routing.freeze_routers(model, cfg)
        a, tr = cfg.algo, cfg.train
        self.objective = a.objective()
        kl = dict(coef=a.kl_coef, target=a.kl_target, horizon=a.kl_horizon) if a.kl_target else dict(coef=a.kl_coef)
        self.kl_control = algo.make_kl_controller("adaptive" if a.kl_target else "fixed", **kl)
        overlong = (a.overlong_buffer, cfg.overlong_budget(), a.overlong_coef)
        self.shaping = algo.RewardShapingParams(a.reward_clip, *overlong)
        mixed = self.precision.compute if self.precision.mixed else None
        shard = functools.partial(parallel.parallelize, compute_dtype=mixed) if fsdp else None
        self.critic = Critic(model, cfg, self.precision, shard) if a.needs("values_bt") else None
        self.teacher = load_teacher(a.teacher, model, cfg.runtime.device, self.precision.compute) if a.teacher else None
        self.lora = LoRA(model, tr.lora_rank, tr.lora_alpha, tr.lora_targets, tr.seed) if tr.lora_rank else None
        # the KL reference is the initial policy: with LoRA, the frozen base itself (adapters off), no copy
        self.ref = copy.deepcopy(model).eval().requires_grad_(False) if a.kl_coef > 0 and self.lora is None else None
        if fsdp:  # LoRA adapters stay whole on every rank (`parallel.sum_replicated_grads`)
            for m in [m for m in (self.teacher, self.ref, model) if m is not None]:
                shard(m)
            self.precision = self.precision.unsharded()  # FSDP2 casts the parameters: no autocast on top
        self.opt, self.schedule = build_optimizer(self.trainable(), cfg.train)
        self.version = self.num_skipped_steps = 0

    def trainable(self):
        """The parameters the optimizer steps: the LoRA adapters, or the model's own."""
        return self.lora.parameters() if self.lora is not None else self.model.parameters()

    def weights(self) -> dict[str, torch.Tensor]:
        """The weights rollout engines need (Molt names): all but frozen routers; with LoRA the merged targets."""
        state = self.model.state_dict() | (self.lora.merged_weights() if self.lora is not None else {})
        return {k: v.detach() for k, v in state.items() if k not in self.frozen}

    def extra_state(self) -> dict:
        """Checkpoint entries beside the optimizer's: the critic, the LoRA adapters and their targets' base weights
        (the HF folder holds merged ones), float16's loss scales."""
        state = {"kl_coef": self.kl_control.coef, "scalers": self.scaler_states()}
        if self.critic is not None:
            state["critic"] = self.critic.state_dict()
        if self.lora is not None:
            state["lora"] = self.lora.resume_state()
        return state

    def load_extra_state(self, state: dict) -> None:
        """Restore what `extra_state` saved (entries a checkpoint lacks keep their fresh values), then apply this
        config's optimizer settings over the restored optimizer and schedule states (`resume_optimizer`)."""
        if state.get("kl_coef") is not None and self.cfg.algo.kl_target:  # the adaptive coefficient where it was
            self.kl_control.coef = state["kl_coef"]
            self.objective = dataclasses.replace(self.objective, kl_loss_coef=state["kl_coef"])
        if self.critic is not None and state.get("critic") is not None:
            self.critic.load_state_dict(state["critic"])
        for key, scaler in self._scalers().items():  # a resumed float16 run keeps its loss scale
            if key in (state.get("scalers") or {}):
                scaler.load_state_dict(state["scalers"][key])
        if self.lora is not None and state.get("lora") is not None:
            self.lora.load_resume_state(state["lora"])
        resume_optimizer(self.opt, self.schedule, self.cfg.train)
        if self.critic is not None:
            resume_optimizer(self.critic.opt, self.critic.schedule, self.critic.train_cfg)

    def _scalers(self) -> dict[str, torch.amp.GradScaler]:
        scalers = {"policy": self.scaler, "critic": self.critic.scaler if self.critic is not None else None}
        return {key: scaler for key, scaler in scalers.items() if scaler is not None}

    def scaler_states(self) -> dict[str, dict]:
        """The float16 loss scalers' states, by model (none in bfloat16 or float32)."""
        return {key: scaler.state_dict() for key, scaler in self._scalers().items()}

    sharded = False  # checkpoints are this process's state dicts (`RayTrainer` writes sharded ones)

    def save(self, folder: Path, tokenizer) -> dict:
        """The policy as an HF folder (with LoRA its merged weights, plus the adapters in PEFT format in `adapter/`);
        returns the optimizer, schedule and extra models' state."""
        save_policy(self.model, self.lora, folder, tokenizer, self.cfg.model.path)
        ref = self.ref.state_dict() if self.ref is not None else None
        return {"optimizer": self.opt.state_dict(), "schedule": self.schedule.state_dict(), "ref": ref,
                **self.extra_state()}  # fmt: skip

    def load(self, folder: Path, state: dict) -> None:
        """Restore what `save` returned (the policy's weights come from the HF folder when it is built)."""
        self.opt.load_state_dict(state["optimizer"])
        self.schedule.load_state_dict(state["schedule"])
        self.load_extra_state(state)
        if self.ref is not None and state.get("ref") is not None:
            self.ref.load_state_dict(state["ref"])

    def micro_batches(self, trajs: list[Trajectory]) -> list[MicroBatch]:
        ids = [t.tokens for t in trajs]
        row_len = max(self.cfg.rollout.max_len, max(map(len, ids)))
        groups = [self._share_key(t) for t in trajs] if self.cfg.train.share_prefix else None
        images = trajectory_pixels(trajs, self.model.cfg)
        packs = pack(ids, [t.loss_mask for t in trajs], row_len, self.cfg.train.micro_batch_tokens, images, groups)
        if self.moe_shape[0]:
            routing.attach_routing(packs, [t.routing for t in trajs], self.moe_shape)
        return [layout(p, trajs) for p in packs]

    def _share_key(self, traj: Trajectory) -> object:
        """Samples with one key share their common prompt in the packed rows: a group's, and with MoE routing
        replayed, only those whose prompt was routed alike (one recomputed after a weight swap routed it anew, and
        the shared prefix replays one member's routing)."""
        if not (self.cfg.algo.routing_replay and traj.routing is not None):
            return traj.group_id
        prompt = next((i for i, m in enumerate(traj.loss_mask) if m), len(traj.tokens))
        return traj.group_id, traj.routing[:prompt].cpu().numpy().tobytes()

    def advantages(
        self,
        trajs: list[Trajectory],
        values: list[list[float]] | None = None,
        teacher_kl: list[list[float]] | None = None,
    ) -> tuple[list[list[float]], dict]:
        """Per-token advantages of every trajectory (over the whole step batch), from the rewards and, where the run
        has them, the critic's `values` and the reverse KL to the teacher (`teacher_kl`)."""
        algo_cfg = self.cfg.algo
        distill = algo_cfg.needs("kl_bt")
        rewards_b, shaping_metrics = self.rewards(trajs)
        inputs = algo.AdvantageInputs(
            mask_bt=padded([t.loss_mask for t in trajs]),
            rewards_b=rewards_b,
            group_ids_b=torch.tensor([t.group_id for t in trajs]),
            rollout_ids_b=torch.tensor([t.rollout_id for t in trajs]),
            values_bt=padded(values) if values is not None else None,
            kl_bt=padded(teacher_kl) if teacher_kl is not None and distill else None,
        )
        adv_bt, _, metrics = algo.compute_advantages(algo_cfg.estimator, inputs, self._advantage_params())
        metrics |= shaping_metrics
        if teacher_kl is not None and not distill:  # distillation added to the task estimator's advantage
            adv_bt, kl_metrics = algo.add_teacher_kl(adv_bt, padded(teacher_kl), inputs.mask_bt, algo_cfg.teacher_coef)
            metrics |= kl_metrics
        return [adv_bt[b, : len(t.tokens)].tolist() for b, t in enumerate(trajs)], metrics

    def rewards(self, trajs: list[Trajectory]) -> tuple[torch.Tensor, dict]:
        """Each trajectory's reward [B] as the estimator and the critic's returns see it, and the shaping metrics: the
        DAPO overlong penalty on its rollout's generated tokens (`--algo.overlong_buffer`) then `--algo.reward_clip`."""
        rewards_b = torch.tensor([t.reward for t in trajs], dtype=torch.float32)
        lengths_b = torch.tensor([t.num_action_tokens for t in trajs], dtype=torch.float32)
        return algo.shape_rewards(rewards_b, lengths_b, self.shaping, torch.tensor([t.rollout_id for t in trajs]))

    def _critic_returns(self, trajs: list[Trajectory], teacher_kl: list[list[float]] | None) -> Returns:
        """The critic's targets for a micro-batch: the run's estimator's returns (never whitened) from its rows' own
        shaped rewards, group and rollout ids, teacher KL and values. Per micro-batch, so one critic forward gives both
        V_old and the update's loss: exact for returns that depend on the row alone (gae's, any lambda-return)."""
        rewards_b, params = self.rewards(trajs)[0], self._advantage_params(whiten=False)
        ids_b = torch.tensor([(t.group_id, t.rollout_id) for t in trajs])
        distill = teacher_kl is not None and self.cfg.algo.needs("kl_bt")

        def returns(mb: MicroBatch, mask_bt: torch.Tensor, values_bt: torch.Tensor) -> torch.Tensor:
            rows, device = torch.tensor(mb.samples), mask_bt.device
            (groups, rollouts), rewards = ids_b[rows].to(device).T, rewards_b[rows].to(device)
            kl_bt = per_sample(teacher_kl, mb).to(device) if distill else None
            inputs = algo.AdvantageInputs(mask_bt, rewards, groups, rollouts, kl_bt=kl_bt, values_bt=values_bt)
            return algo.compute_advantages(self.cfg.algo.estimator, inputs, params)[1]

        return returns

    def _advantage_params(self, whiten: bool | None = None) -> algo.AdvantageParams:
        a = self.cfg.algo
        coef = a.teacher_coef if a.needs("kl_bt") else 0.0  # its advantage: -coef * kl
        return algo.AdvantageParams(a.gamma, a.lam, coef, whiten=a.whiten if whiten is None else whiten)

    def step(self, trajs: list[Trajectory], shard: list[int] | None = None) -> dict[str, float]:
        """One optimizer step on `trajs` (complete groups); returns scalar metrics. Data parallel, every rank gets the
        whole batch and trains on its `shard` (indices of whole groups); denominators and sums add over the ranks."""
        t0 = time.perf_counter()
        mine = trajs if shard is None else [trajs[i] for i in shard]
        check_tokens(mine, exhaustive=self.cfg.train.check_tokens == "exhaustive")
        mbs = self.micro_batches(mine)
        denoms = algo.step_denominators([mb.mask_bt for mb in mbs], [self._group_ids(mb, mine) for mb in mbs])
        denoms = denoms.all_reduced(parallel.all_reduce_sum)
        num_mbs = parallel.all_reduce_max(len(mbs))  # before any forward: FSDP collectives must line up
        values, model_metrics = None, {}
        teacher_kl = self._teacher_kl(mbs, mine, model_metrics, num_mbs) if self.teacher is not None else None
        if self.critic is not None:  # the critic updates here, before the policy (`Critic.train`)
            lengths, returns = [len(t.tokens) for t in mine], self._critic_returns(mine, teacher_kl)
            values, critic_metrics = self.critic.train(mbs, lengths, returns, denoms, num_mbs)
            model_metrics |= critic_metrics
        if shard is not None:  # each rank scored its own samples; the advantages see the whole batch
            values, teacher_kl = parallel.gather_samples(shard, len(trajs), values, teacher_kl)
        advantages, adv_metrics = self.advantages(trajs, values, teacher_kl)
        if shard is not None:
            advantages = [advantages[i] for i in shard]
        sums: dict[str, float] = {"micro_batches": len(mbs)}
        self.step_tokens = int(parallel.all_reduce_sum(torch.tensor(sum(mb.packed.num_tokens for mb in mbs))))
        for mb in mbs:
            self._backward(mb, mine, advantages, denoms, sums)
        for _ in range(num_mbs - len(mbs)):
            self._backward(mbs[-1], mine, advantages, denoms, {}, scale=0.0)
        parallel.reshard(self.model)  # a no-grad forward (MoE routing diagnostics) leaves the root unsharded
        parallel.sum_replicated_grads(list(self.trainable()))  # LoRA adapters beside a sharded base
        grad_norm, stepped = clip_and_step(self.opt, self.trainable(), self.cfg.train.grad_clip, self.scaler)
        self.num_skipped_steps += not stepped
        if shard is not None:
            sums = parallel.all_reduce_sums(sums)  # MoE sums hold a load tensor
        lr = self.schedule.get_last_lr()[0]
        self.schedule.step()
        metrics = self._step_metrics(trajs, sums, adv_metrics) | model_metrics
        metrics |= self._adapt_kl(metrics.get("train/kl", 0.0), len(trajs))
        self.version += 1
        dt = time.perf_counter() - t0
        return metrics | {
            "train/grad_norm": float(grad_norm),
            "train/lr": lr,
            "train/skipped_steps": self.num_skipped_steps,
            "train/tokens_per_s": sum(len(t.tokens) for t in trajs) / dt,
            "time/train_s": dt,
        }

    def _adapt_kl(self, kl: float, num_samples: int) -> dict[str, float]:
        """`train/kl_coef`, the coefficient this step used; the controller (`--algo.kl_target`) updates the next's."""
        if not self.cfg.algo.kl_coef:
            return {}
        used = self.objective.kl_loss_coef
        self.objective = dataclasses.replace(self.objective, kl_loss_coef=self.kl_control.update(kl, num_samples))
        return {"train/kl_coef": used}

    @torch.no_grad()
    def _teacher_kl(self, mbs: list[MicroBatch], trajs, metrics: dict, num_mbs: int = 0) -> list[list[float]]:
        """Per token, the reverse KL to the teacher on the sampled token: log pi(a_t) - log teacher(a_t), with
        pi the engine's recorded log-prob (the distribution that sampled it); 0 off the loss mask. A sharded
        teacher repeats the last micro-batch's forward up to `num_mbs`, so the ranks' collectives line up."""
        t0, device = time.perf_counter(), self.cfg.runtime.device
        temp, chunk = self.cfg.rollout.temperature, self.cfg.train.logprob_chunk_tokens
        kl: list[list[float]] = [[] for _ in trajs]
        for mb in mbs:
            with self.precision.autocast():
                teacher_bt = mb.unpack(teacher_logprobs(self.teacher, mb.packed.to(device), temp, chunk))
            rollout_bt = per_sample([t.rollout_logprobs for t in trajs], mb).to(device)
            kl_bt = algo.kl_estimate("k1", rollout_bt, teacher_bt, mb.mask_bt.to(device))
            for b, i in enumerate(mb.samples):
                kl[i] = kl_bt[b, : len(trajs[i].tokens)].tolist()
        for _ in range(num_mbs - len(mbs)):
            teacher_logprobs(self.teacher, mbs[-1].packed.to(device), temp, chunk)
        metrics["time/teacher_s"] = time.perf_counter() - t0
        return kl

    @staticmethod
    def _group_ids(mb: MicroBatch, trajs: list[Trajectory]) -> torch.Tensor:
        return torch.tensor([trajs[i].group_id for i in mb.samples])

    def _backward(self, mb: MicroBatch, trajs, advantages, denoms, sums: dict[str, float], scale=1.0) -> None:
        device = self.cfg.runtime.device
        packed = mb.packed.to(device)
        moe_routing = routing.forward_routing(packed, self.cfg.algo.routing_replay) if self.moe_shape[0] else None
        logp_bt, entropy_bt, ref_logp_bt = self._logprobs(mb, packed, moe_routing)
        bonus_bt = entropy_bt if self.objective.entropy_coef else None  # with grad: the loss subtracts coef * H
        mask_bt = mb.mask_bt.to(device)
        rollout_logp_bt = per_sample([t.rollout_logprobs for t in trajs], mb).to(device)
        batch = algo.PolicyBatch(
            logp_bt=logp_bt,
            mask_bt=mask_bt,
            advantages_bt=per_sample(advantages, mb).to(device),
            rollout_logp_bt=rollout_logp_bt,
            ref_logp_bt=ref_logp_bt,
            entropy_bt=bonus_bt,
            group_ids_b=self._group_ids(mb, trajs).to(device),
        )
        loss, metrics = algo.policy_objective(batch, denoms, self.objective)
        if moe_routing is not None:  # Switch load-balancing loss, weighted by this micro-batch's share of tokens
            aux = routing.routing_stats(moe_routing, packed, sums) * (packed.num_tokens / max(self.step_tokens, 1))
            _add(sums, moe_aux=aux.detach())
            if self.cfg.algo.moe_aux_coef > 0:
                loss = loss + self.cfg.algo.moe_aux_coef * aux
        (self.scaler.scale(loss * scale) if self.scaler is not None else loss * scale).backward()
        fresh_bt = (per_sample([t.versions for t in trajs], mb).to(device) == self.version) * mask_bt
        diff_bt = (logp_bt.detach() - rollout_logp_bt).abs()
        _add(sums, loss=loss.detach(), abs_diff=diff_bt * mask_bt, fresh_diff=diff_bt * fresh_bt, fresh=fresh_bt)
        _add(sums, entropy=entropy_bt.detach() * mask_bt, tokens=mask_bt)
        if moe_routing is not None:  # MoE: |diff| with replayed and live routing (the other mode: a no-grad forward)
            other_logp = lambda r: self._logprobs(mb, packed, r, reference=False)[0]  # noqa: E731
            routing.logprob_diffs(sums, packed, self.cfg.algo, batch, other_logp)
        n = float(mask_bt.sum())
        for key, value in metrics.items():
            sums[f"w_{key}"] = sums.get(f"w_{key}", 0.0) + float(value) * n

    def _logprobs(self, mb: MicroBatch, packed: PackedBatch, moe_routing, reference: bool = True):
        """(log-probs, entropies, reference log-probs or None), each [b, T] per sample, in the compute dtype.
        Entropies keep their graph (the entropy bonus); callers detach them otherwise."""
        temp, chunk = self.cfg.rollout.temperature, self.cfg.train.logprob_chunk_tokens
        trained_only = moe_routing is None  # dense models compute only the trained positions
        with self.precision.autocast():
            logp, entropy = token_logprobs_entropy(self.model, packed, temp, moe_routing, trained_only, chunk)
            ref_logp_bt = None
            if reference and self.cfg.algo.kl_coef > 0:  # the frozen copy, or with LoRA the model with adapters off
                ref = self.model if self.ref is None else self.ref
                with torch.no_grad(), self.lora.disabled() if self.ref is None else contextlib.nullcontext():
                    ref_logp_bt = mb.unpack(token_logprobs(ref, packed, temp, None, trained_only, chunk))
        return mb.unpack(logp), mb.unpack(entropy), ref_logp_bt

    def _step_metrics(self, trajs, sums, adv_metrics) -> dict[str, float]:
        n = max(sums.get("tokens", 0.0), 1.0)
        staleness = [self.version - v for t in trajs for v, m in zip(t.versions, t.loss_mask, strict=True) if m]
        out = {f"train/{k[2:]}": v / n for k, v in sums.items() if k.startswith("w_")}
        shaped = adv_metrics.pop("reward_mean", None)  # the estimator's, of the shaped reward
        if shaped is not None and (self.shaping.clip or self.shaping.overlong_buffer):
            out["train/shaped_reward_mean"] = float(shaped)
        out |= {f"train/{k}": float(v) for k, v in adv_metrics.items()} | routing.routing_metrics(sums)
        rewards = {t.rollout_id: t.reward for t in trajs}  # one per rollout, whatever its number of segments
        if sums.get("fresh", 0.0) > 0:  # numerics alone: tokens the current weights sampled (absent when none)
            out["train/logprob_diff_fresh"] = sums["fresh_diff"] / sums["fresh"]
        return out | {
            "train/loss": sums.get("loss", 0.0),
            "train/logprob_diff": sums.get("abs_diff", 0.0) / n,
            "train/fresh_tokens": sums.get("fresh", 0.0),
            "train/entropy": sums.get("entropy", 0.0) / n,
            "train/reward_mean": sum(rewards.values()) / len(rewards),
            "train/staleness_mean": sum(staleness) / max(len(staleness), 1),
            "train/staleness_max": max(staleness, default=0),
            "train/num_samples": len(trajs),
            "train/num_micro_batches": int(sums["micro_batches"]),
            "train/packed_tokens": self.step_tokens,  # forward positions (shared prompts counted once)
            "train/action_tokens": sums.get("tokens", 0.0),
        }
