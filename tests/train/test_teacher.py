"""On-policy distillation (`--algo.teacher`): the teacher scores the sampled tokens; reverse KL as the advantage."""

import pytest
import torch
from test_trainer import _cfg, _model, _trajs, _true_logprobs  # noqa: I001 - tests/train/test_trainer.py

from molt.config import AlgoConfig, ConfigError
from molt.models import Transformer, preset, save_pretrained
from molt.train.trainer import Trainer


def _teacher_folder(tmp_path, model):
    return str(save_pretrained(model, tmp_path / "teacher"))


def test_teacher_identical_to_the_policy_gives_zero_advantage(tmp_path):
    model = _model()
    teacher = _teacher_folder(tmp_path, model)
    trainer = Trainer(model, _cfg("--algo.estimator", "on_policy_distill", "--algo.teacher", teacher))
    trajs = _trajs(model)
    kl = trainer._teacher_kl(trainer.micro_batches(trajs), trajs, {})
    advantages, metrics = trainer.advantages(trajs, teacher_kl=kl)
    assert max(abs(a) for row in advantages for a in row) <= 1e-5
    step = trainer.step(trajs)
    assert abs(step["train/distill_kl"]) <= 1e-5 and "time/teacher_s" in step


def test_reverse_kl_advantage_matches_a_hand_computation_with_a_different_teacher(tmp_path):
    """A smaller, differently shaped teacher: A_t = -coef * (rollout logp_t - teacher logp_t) on action tokens."""
    model = _model()
    small = preset("tiny", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, head_dim=8)
    teacher_model = Transformer(small).init_weights(0.3, torch.Generator().manual_seed(7))
    flags = ("--algo.estimator", "on_policy_distill", "--algo.teacher_coef", "0.5")
    trainer = Trainer(model, _cfg(*flags, "--algo.teacher", _teacher_folder(tmp_path, teacher_model)))
    trajs = _trajs(model, num_groups=1, n=2)
    kl = trainer._teacher_kl(trainer.micro_batches(trajs), trajs, {})
    advantages, _ = trainer.advantages(trajs, teacher_kl=kl)
    for traj, adv in zip(trajs, advantages, strict=True):
        teacher_lp = _true_logprobs(teacher_model, traj.tokens, 1.0)
        expect = [-0.5 * (r - t) * m for r, t, m in zip(traj.rollout_logprobs, teacher_lp, traj.loss_mask, strict=True)]
        assert adv == pytest.approx(expect, abs=1e-5)
        assert any(abs(a) > 1e-3 for a in adv)


def test_teacher_kl_is_added_to_a_task_estimator(tmp_path):
    model = _model()
    teacher_model = _model(seed=3)
    flags = ("--algo.teacher", _teacher_folder(tmp_path, teacher_model), "--algo.teacher_coef", "2.0")
    trainer, plain = Trainer(model, _cfg(*flags)), Trainer(_model(), _cfg())
    trajs = _trajs(model)
    kl = trainer._teacher_kl(trainer.micro_batches(trajs), trajs, {})
    mixed, metrics = trainer.advantages(trajs, teacher_kl=kl)
    task, _ = plain.advantages(trajs)
    for m_row, t_row, k_row, traj in zip(mixed, task, kl, trajs, strict=True):
        expect = [(t - 2.0 * k) * m for t, k, m in zip(t_row, k_row, traj.loss_mask, strict=True)]
        assert m_row == pytest.approx(expect, abs=1e-5)
    assert "distill_kl" in metrics
    assert abs(trainer.step(trajs)["train/distill_kl"]) > 1e-3  # k1 on random tokens: any sign


def test_distill_needs_an_existing_teacher_folder(tmp_path):
    with pytest.raises(ConfigError, match="algo.teacher"):
        AlgoConfig(estimator="on_policy_distill")
    with pytest.raises(ConfigError, match="does not exist"):
        AlgoConfig(teacher=str(tmp_path / "missing"))
