"""Loss and reward knobs in the trainer: adaptive KL (logged, checkpointed), reward clipping, overlong penalty."""

import copy

import pytest
from test_trainer import _cfg, _model, _trajs  # noqa: I001 - tests/train/test_trainer.py

from molt.algo import adaptive_kl_coef
from molt.train.trainer import Trainer

ADAPTIVE = ("--algo.kl_coef", "0.5", "--algo.kl_target", "1e-4", "--algo.kl_horizon", "24", "--train.lr", "1e-2")


def test_adaptive_kl_coefficient_follows_the_measured_kl_each_step_and_resumes():
    model = _model()
    trajs = _trajs(model)  # 12 samples
    trainer = Trainer(model, _cfg(*ADAPTIVE))
    steps = [trainer.step(trajs) for _ in range(3)]
    assert steps[0]["train/kl_coef"] == 0.5
    for before, after in zip(steps, steps[1:], strict=False):
        expect = adaptive_kl_coef(before["train/kl_coef"], before["train/kl"], 1e-4, len(trajs), 24)
        assert after["train/kl_coef"] == pytest.approx(expect)
    assert steps[2]["train/kl_coef"] > steps[1]["train/kl_coef"]  # the KL is above target once the policy moved
    resumed = Trainer(copy.deepcopy(model), _cfg(*ADAPTIVE))
    resumed.load_extra_state(trainer.extra_state())
    assert resumed.step(trajs)["train/kl_coef"] == trainer.step(trajs)["train/kl_coef"] != 0.5
    assert "train/kl_coef" in Trainer(_model(), _cfg("--algo.kl_coef", "0.1")).step(trajs)  # fixed: logged too


def test_advantages_see_the_clipped_and_overlong_penalised_reward():
    """GRPO on shaped rewards equals GRPO on rewards shaped by hand: penalty on each rollout's generated tokens
    (max_tokens 32, buffer 30: -(n - 2) / 30 * 0.5 for n generated tokens), then clipping to +-0.4."""
    model = _model()
    trajs = _trajs(model)
    flags = ("--algo.overlong_buffer", "30", "--algo.overlong_coef", "0.5", "--algo.reward_clip", "0.4")
    shaped = Trainer(copy.deepcopy(model), _cfg(*flags))
    by_hand = copy.deepcopy(trajs)
    for traj in by_hand:
        penalty = -0.5 * min(max(traj.num_action_tokens - 2, 0) / 30, 1.0)
        traj.reward = min(max(traj.reward + penalty, -0.4), 0.4)
    rewards, metrics = shaped.rewards(trajs)
    assert rewards.tolist() == pytest.approx([t.reward for t in by_hand])
    assert {"overlong_penalty_mean", "reward_clip_frac"} <= set(metrics)
    advantages, _ = shaped.advantages(trajs)
    expect, _ = Trainer(copy.deepcopy(model), _cfg()).advantages(by_hand)
    assert [a for row in advantages for a in row] == pytest.approx([a for row in expect for a in row], abs=1e-6)
    assert "train/reward_clip_frac" in shaped.step(trajs)
