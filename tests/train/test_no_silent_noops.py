"""No silent no-ops (issue 24, item 6): every `--algo.*` and `--train.*` field, changed from its default, changes
the gradient or the update of two trainer steps on a fixed batch, or is rejected at start-up saying why.

Each field has cases `(context, change, expect)`: `context` flags are set in both runs, `change` flags only in the
second. `ACTS`: some step's gradient or the synced weights' update differs (relative to its size) by more than
`ACTS_TOL`. A string: start-up (config or trainer construction) fails with a message matching it. `SAME`: the
explicit exemptions below, whose contract is to leave the math alone; the test checks they do. A field rejected
in one context also has a context where it applies and acts, so a rejection is never broader than its reason.
The fixed batch has varied rewards and rollout log-probs from another model (stale tokens), so the IS correction
and reward shaping have something to act on.
"""

from __future__ import annotations

import copy
import dataclasses
import random
import re
import typing

import pytest
import torch
from conftest import moe_rollouts  # noqa: I001 - tests/conftest.py
from test_moe_train import _model as _moe_model
from test_trainer import _trajs

from molt import algo
from molt.cli.main import parse_config
from molt.config import AlgoConfig, ConfigError, TrainConfig
from molt.models import Transformer, preset, save_pretrained
from molt.train.trainer import Trainer

ACTS, SAME = "acts", "same"
ACTS_TOL = 1e-3  # relative difference a change must make to some step's gradient or to the update
SAME_TOL = (1e-5, 1e-3)  # gradients, update: fp32 reorderings (micro-batch splits, chunks) stay ~1e-7, ~1e-5
BASE = ["--data.max_len", "64", "--rollout.max_len", "64", "--train.lr", "1e-3", "--train.max_steps", "4",
        "--train.warmup_steps", "0"]  # fmt: skip
MOE = ("--model.preset", "tiny-moe")
GAE = ("--algo.estimator", "gae")
TEACHER = ("--algo.teacher", "{teacher}")
KL = ("--algo.kl_coef", "1.0")
LORA = ("--train.lora_rank", "4")
DENSE_ONLY = "needs a mixture-of-experts model"
ONE_STEP = "the ratio is exactly 1"
Case = tuple[tuple[str, ...], tuple[str, ...], str]


def _acts(*change: str, context: tuple[str, ...] = ()) -> Case:
    return context, change, ACTS


ONE_TURN = ("--rollout.max_turns", "1")  # the overlong penalty's default budget: one turn's 32 tokens
STEP_12 = ("--rollout.prompts_per_step", "3", "--rollout.n_samples_per_prompt", "4")  # the batch's 12 samples


def _rejected(match: str, *change: str, context: tuple[str, ...] = ()) -> Case:
    return context, change, match


# Exemptions: fields whose contract is to leave the loss and gradient of a step exactly as they are (each is
# checked to do so). Their effect lies elsewhere, named in the comment.
EXEMPT: dict[str, Case] = {
    # memory / speed: gradient accumulation over micro-batches with step-global denominators is exact (on a dense
    # model: the MoE load-balancing loss, --algo.moe_aux_coef, is per micro-batch; tests/train/test_moe_train.py)
    "train.micro_batch_tokens": ((), ("--train.micro_batch_tokens", "64"), SAME),
    # speed: a group's prompt laid out once in the packed forward gives the same log-probs and gradients (dense, as
    # above: the load-balancing loss counts the packed positions)
    "train.share_prefix": ((), ("--train.no_share_prefix",), SAME),
    # memory: recomputing activations in backward changes no number
    "train.activation_checkpointing": ((), ("--train.activation_checkpointing",), SAME),
    # memory: the LM head + log-softmax in chunks of this many tokens changes no number
    "train.logprob_chunk_tokens": ((), ("--train.logprob_chunk_tokens", "16"), SAME),
    # a verification level: compares full token ids instead of hashes, and raises on a tampered batch
    "train.check_tokens": ((), ("--train.check_tokens", "exhaustive"), SAME),
    # the run's randomness (init, data order, sampling); a trainer step on a fixed batch draws no random numbers
    "train.seed": ((), ("--train.seed", "7"), SAME),
    # speed: regional torch.compile of the decoder layers (the wiring, with dynamo's eager backend; the compiled
    # numerics, aot_eager and inductor: tests/train/test_train_compile.py)
    "train.compile": ((), ("--train.compile", "on", "--train.compile_backend", "eager"), SAME),
    # a diagnostic: one more no-grad forward for the moe/logprob_diff_* metrics of a mixture-of-experts model
    "algo.moe_diff_both": (MOE, ("--algo.no_moe_diff_both",), SAME),
    # user code to import (it registers variants: they act once selected by the fields above); a module that
    # registers nothing leaves the step alone
    "algo.plugins": ((), ("--algo.plugins", "json"), SAME),
}

CASES: dict[str, list[Case]] = {
    "algo.estimator": [
        *[
            _acts("--algo.estimator", name)
            for name in algo.ESTIMATORS.names()
            if name not in ("grpo", "on_policy_distill")
        ],
        _rejected("needs --algo.teacher", "--algo.estimator", "on_policy_distill"),
        _acts("--algo.estimator", "on_policy_distill", context=TEACHER),
    ],
    "algo.policy_loss": [_rejected(ONE_STEP, "--algo.policy_loss", name) for name in ("gspo", "cispo", "pg")],
    "algo.loss_agg": [
        *[_acts("--algo.loss_agg", name) for name in ("seq-mean-token-mean", "prompt-mean-token-mean")],
        # token-mean times the step's N_tokens / N_seqs: the same direction, so only unclipped magnitudes differ
        _acts("--algo.loss_agg", "seq-mean-token-sum", context=("--train.grad_clip", "0")),
        _rejected("algo.norm_len", "--algo.loss_agg", "seq-mean-token-sum-norm"),
        _acts(
            "--algo.loss_agg", "seq-mean-token-sum-norm", "--algo.norm_len", "64", context=("--train.grad_clip", "0")
        ),
    ],
    "algo.norm_len": [
        _rejected("divides by no constant", "--algo.norm_len", "64"),
        _acts(
            "--algo.norm_len",
            "16",
            context=("--algo.loss_agg", "seq-mean-token-sum-norm", "--algo.norm_len", "64", "--train.grad_clip", "0"),
        ),  # fmt: skip
    ],
    "algo.clip_low": [_rejected(ONE_STEP, "--algo.clip_low", "0.1")],
    "algo.clip_high": [_rejected(ONE_STEP, "--algo.clip_high", "0.2")],
    "algo.dual_clip": [_rejected(ONE_STEP, "--algo.dual_clip", "3.0")],
    "algo.whiten": [_acts("--algo.whiten", "True"), _acts("--algo.whiten", "False", context=GAE)],
    "algo.is_level": [
        _acts("--algo.is_level", "seq"),
        _acts("--algo.is_level", "none"),
        _rejected("geo", "--algo.is_level", "geo"),  # a geometric mean is a filter: it cannot truncate
        _acts("--algo.is_level", "geo", context=("--algo.is_mode", "mask")),
    ],
    "algo.is_mode": [_acts("--algo.is_mode", "mask"), _acts("--algo.is_mode", "clip")],
    "algo.is_low": [
        _rejected("trunc only caps at is_high", "--algo.is_low", "0.9"),
        _acts("--algo.is_low", "0.9", context=("--algo.is_mode", "clip")),
    ],
    "algo.is_high": [
        _acts("--algo.is_high", "1.2"),
        _rejected("turns the IS correction off", "--algo.is_high", "1.2", context=("--algo.is_level", "none")),
    ],
    "algo.kl_coef": [_acts("--algo.kl_coef", "0.5")],
    "algo.kl_estimator": [
        _rejected("the KL loss is off", "--algo.kl_estimator", "k1"),
        _rejected("k1 cannot be the KL loss: its expected gradient is 0", "--algo.kl_estimator", "k1", context=KL),
        _acts("--algo.kl_estimator", "k2", context=KL),
    ],
    "algo.kl_target": [
        _rejected("the KL loss is off", "--algo.kl_target", "0.01"),
        _acts("--algo.kl_target", "0.01", "--algo.kl_horizon", "12", context=(*KL, *STEP_12)),  # it moves at once
    ],
    "algo.kl_horizon": [
        _rejected("the KL coefficient is fixed", "--algo.kl_horizon", "12"),
        _acts("--algo.kl_horizon", "12", context=(*KL, *STEP_12, "--algo.kl_target", "0.01")),
    ],
    "algo.reward_clip": [_acts("--algo.reward_clip", "0.5")],
    "algo.overlong_buffer": [_acts("--algo.overlong_buffer", "30", context=ONE_TURN)],
    "algo.overlong_max_len": [
        _rejected("the overlong penalty is off", "--algo.overlong_max_len", "12"),
        _acts("--algo.overlong_max_len", "12", context=(*ONE_TURN, "--algo.overlong_buffer", "8")),
    ],
    "algo.overlong_coef": [
        _rejected("the overlong penalty is off", "--algo.overlong_coef", "3"),
        _acts("--algo.overlong_coef", "3", context=(*ONE_TURN, "--algo.overlong_buffer", "30")),
    ],
    "algo.entropy_coef": [_acts("--algo.entropy_coef", "0.05")],
    "algo.routing_replay": [
        _rejected(DENSE_ONLY, "--algo.routing_replay"),
        _acts("--algo.routing_replay", context=MOE),
    ],
    "algo.moe_aux_coef": [
        _rejected(DENSE_ONLY, "--algo.moe_aux_coef", "0.1"),
        _acts("--algo.moe_aux_coef", "0.1", context=MOE),
    ],
    "algo.gamma": [
        _rejected(r"read it \(gae, reinforce\)", "--algo.gamma", "0.9"),
        _acts("--algo.gamma", "0.9", context=GAE),
    ],
    "algo.lam": [
        _rejected(r"applies to the estimators that read it \(gae\)", "--algo.lam", "0.5"),
        _rejected(
            "reinforce is gae with V = 0 and lambda 1", "--algo.lam", "0.5", context=("--algo.estimator", "reinforce")
        ),
        _acts("--algo.lam", "0.5", context=GAE),
    ],
    "algo.teacher": [_acts(*TEACHER)],
    "algo.teacher_coef": [
        _rejected("there is no teacher", "--algo.teacher_coef", "3"),
        _acts("--algo.teacher_coef", "3", context=TEACHER),
    ],
    "train.lr": [_acts("--train.lr", "3e-3")],
    "train.min_lr_ratio": [_acts("--train.min_lr_ratio", "0.9")],
    "train.warmup_steps": [_acts("--train.warmup_steps", "2")],
    "train.max_steps": [_acts("--train.max_steps", "8")],
    "train.batch_size": [_rejected("molt sft's batch", "--train.batch_size", "8")],
    "train.weight_decay": [_acts("--train.weight_decay", "0.5")],
    "train.betas": [_acts("--train.betas", "0.5", "0.9")],
    "train.grad_clip": [_acts("--train.grad_clip", "1e-3")],
    "train.freeze_router": [
        _rejected(DENSE_ONLY, "--train.freeze_router"),
        _rejected(
            "LoRA trains only its", "--train.freeze_router", context=(*MOE, *LORA, "--model.warmstart_steps", "0")
        ),
        _acts("--train.freeze_router", context=MOE),
    ],
    "train.precision": [
        _rejected("compute dtype .* is float32", "--train.precision", "pure"),
        _acts("--train.precision", "pure", context=("--model.dtype", "bfloat16")),
    ],
    # only rejected here: where it applies (train.compile on) it picks the compiler, math-neutral like train.compile
    # (tests/train/test_train_compile.py), and an inductor compile takes tens of seconds
    "train.compile_backend": [_rejected("train.compile is off", "--train.compile_backend", "aot_eager")],
    "train.lora_rank": [_acts(*LORA)],
    "train.lora_alpha": [
        _rejected("LoRA is off", "--train.lora_alpha", "64"),
        _acts("--train.lora_alpha", "64", context=LORA),
    ],
    "train.lora_targets": [
        _rejected("LoRA is off", "--train.lora_targets", "q", "v"),
        _acts("--train.lora_targets", "q", "v", context=LORA),
    ],
}


def _fields(cls: type, group: str) -> set[str]:
    hints = typing.get_type_hints(cls)
    return {f"{group}.{f.name}" for f in dataclasses.fields(cls) if not dataclasses.is_dataclass(hints[f.name])}


def test_every_algo_and_train_field_has_a_probe():
    fields = _fields(AlgoConfig, "algo") | _fields(TrainConfig, "train")
    assert fields == set(CASES) | set(EXEMPT), (fields - set(CASES) - set(EXEMPT), set(CASES) | set(EXEMPT) - fields)
    assert not {k for k in EXEMPT if k in CASES and any(expect == ACTS for *_, expect in CASES[k])}
    assert len(EXEMPT) <= 9  # keep the exemptions few: a new field gets a probe, not an exemption


@pytest.fixture(scope="module")
def batches(tmp_path_factory):
    """(model, fixed batch) for dense and MoE runs, and a teacher folder (another random model)."""
    dense = Transformer(preset("tiny", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, head_dim=8))
    dense.init_weights(0.05, torch.Generator().manual_seed(0))
    stale = Transformer(dense.cfg).init_weights(0.05, torch.Generator().manual_seed(1))
    trajs = _trajs(stale, num_groups=3, n=4)  # rollout log-probs of another policy: IS weights far from 1
    rng = random.Random(0)
    for traj in trajs:
        traj.reward = rng.choice([-2.0, 0.0, 0.25, 1.0, 3.0])
    moe = _moe_model()
    moe_trajs = moe_rollouts(_moe_model(seed=1))  # recorded routing of another router: replay differs from live
    teacher = Transformer(dense.cfg).init_weights(0.05, torch.Generator().manual_seed(2))
    folder = str(save_pretrained(teacher, tmp_path_factory.mktemp("noops") / "teacher"))
    return {"dense": (dense, trajs), "moe": (moe, moe_trajs), "teacher": folder, "effects": {}}


def _start(batches, flags: list[str], capsys) -> tuple[Trainer, list] | str:
    """A trainer for BASE + flags on a copy of the right model, or the start-up error's message."""
    model, trajs = batches["moe" if "tiny-moe" in flags else "dense"]
    flags = [f.replace("{teacher}", batches["teacher"]) for f in flags]
    try:
        return Trainer(copy.deepcopy(model), parse_config([*BASE, *flags])), trajs
    except SystemExit:
        return capsys.readouterr().err
    except ConfigError as e:
        return str(e)


def _effect(trainer: Trainer, trajs: list, steps: int = 2) -> list[torch.Tensor]:
    """Flat gradient the optimizer stepped with, per step, then the flat update of the synced weights."""
    grads: list[torch.Tensor] = []
    params = [p for g in trainer.opt.param_groups for p in g["params"]]
    trainer.opt.register_step_pre_hook(lambda *_: grads.append(torch.cat([p.grad.flatten().float() for p in params])))
    before = trainer.weights()
    before = {k: v.clone() for k, v in before.items()}
    for _ in range(steps):
        trainer.step(trajs)
    after = trainer.weights()
    update = torch.cat([(after[k].float() - before[k].float()).flatten() for k in sorted(after)])
    return [*grads, update]


def _difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """Largest relative difference between corresponding tensors (inf where the shapes differ)."""
    worst = 0.0
    for x, y in zip(a, b, strict=True):
        if x.shape != y.shape:
            return float("inf")
        scale = max(float(x.abs().max()), float(y.abs().max()), 1e-12)
        worst = max(worst, float((x - y).abs().max()) / scale)
    return worst


def _check(batches, case: Case, capsys) -> None:
    context, change, expect = case
    started = _start(batches, [*context, *change], capsys)
    if expect not in (ACTS, SAME):
        assert isinstance(started, str), f"{change} in {context}: accepted, expected rejection ({expect})"
        assert re.search(expect, started), started
        return
    assert not isinstance(started, str), f"{change} in {context}: rejected: {started}"
    effects = batches["effects"]
    if context not in effects:
        base = _start(batches, list(context), capsys)
        assert not isinstance(base, str), f"context {context} rejected: {base}"
        effects[context] = _effect(*base)
    base, changed = effects[context], _effect(*started)
    grads, update = _difference(base[:-1], changed[:-1]), _difference(base[-1:], changed[-1:])
    if expect == ACTS:
        assert max(grads, update) > ACTS_TOL, f"{change} in {context}: silent no-op ({grads:.1e}, {update:.1e})"
    else:
        assert grads <= SAME_TOL[0] and update <= SAME_TOL[1], f"{change} in {context}: exempt, but changed the step"


@pytest.mark.parametrize("field", sorted(CASES))
def test_changing_a_field_acts_or_is_rejected_with_a_reason(field, batches, capsys):
    for case in CASES[field]:
        _check(batches, case, capsys)


@pytest.mark.parametrize("field", sorted(EXEMPT))
def test_exempt_fields_leave_the_step_unchanged(field, batches, capsys):
    _check(batches, EXEMPT[field], capsys)


@pytest.mark.parametrize(
    "params",
    [
        {"policy_loss": "gspo"},
        {"policy_loss": "cispo"},
        {"policy_loss": "pg"},
        {"surrogate": algo.SurrogateParams(0.05, 0.05, 1.5)},
    ],  # fmt: skip
    ids=["gspo", "cispo", "pg", "tight-clip"],
)
def test_the_rejected_surrogate_settings_really_are_no_ops_with_one_step_per_batch(params, batches, capsys):
    """The reason given for rejecting policy_loss/clip_low/clip_high/dual_clip holds: forced past the config check,
    they leave both steps' gradients and the update unchanged."""
    trainer, trajs = _start(batches, [], capsys)
    base = _effect(trainer, trajs)
    trainer, trajs = _start(batches, [], capsys)
    trainer.objective = dataclasses.replace(trainer.objective, **params)
    forced = _effect(trainer, trajs)
    assert _difference(base[:-1], forced[:-1]) <= SAME_TOL[0] and _difference(base[-1:], forced[-1:]) <= SAME_TOL[1]
