"""Reward shaping before the estimator (`shape_rewards`): DAPO overlong penalty per rollout, then clipping."""

import pytest
import torch

from molt.algo import RewardShapingParams, rollout_totals, shape_rewards


def test_overlong_penalty_then_clip_hand_numbers():
    """max_len 10, buffer 4: 0 up to 6 tokens, -coef * (len - 6) / 4 up to 10, -coef beyond; then clip to +-1."""
    rewards = torch.tensor([3.0, 1.0, 1.0, 0.5, -2.0])
    lengths = torch.tensor([2.0, 6.0, 8.0, 10.0, 30.0])
    params = RewardShapingParams(clip=1.0, overlong_buffer=4, overlong_max_len=10, overlong_coef=0.5)
    shaped, metrics = shape_rewards(rewards, lengths, params)
    # penalties 0, 0, -0.25, -0.5, -0.5; then 3.0 -> 1.0 and -2.5 -> -1.0 clipped
    assert shaped.tolist() == pytest.approx([1.0, 1.0, 0.75, 0.0, -1.0])
    assert metrics["overlong_penalty_mean"].item() == pytest.approx(-1.25 / 5)
    assert metrics["reward_clip_frac"].item() == pytest.approx(2 / 5)


def test_segments_of_a_rollout_share_its_length_and_its_shaped_reward():
    """Two segments of rollout 7 generated 3 + 5 = 8 tokens together: both get the penalty of 8, not of 3 or 5."""
    rewards = torch.tensor([1.0, 1.0, 1.0])
    lengths = torch.tensor([3.0, 5.0, 5.0])
    rollout_ids = torch.tensor([7, 7, 9])
    assert rollout_totals(lengths, rollout_ids).tolist() == [8.0, 8.0, 5.0]
    params = RewardShapingParams(overlong_buffer=4, overlong_max_len=10)
    shaped, metrics = shape_rewards(rewards, lengths, params, rollout_ids)
    assert shaped.tolist() == pytest.approx([0.5, 0.5, 1.0])
    assert metrics["overlong_penalty_mean"].item() == pytest.approx(-0.25)  # per rollout: (-0.5 + 0) / 2


def test_defaults_leave_rewards_alone_and_bad_params_are_errors():
    rewards = torch.tensor([12.0, -0.5])
    shaped, metrics = shape_rewards(rewards, torch.tensor([1000.0, 1.0]), RewardShapingParams())
    assert torch.equal(shaped, rewards) and metrics == {}
    with pytest.raises(ValueError, match="overlong_buffer <= overlong_max_len"):
        RewardShapingParams(overlong_buffer=5, overlong_max_len=4)
    with pytest.raises(ValueError, match="clip >= 0"):
        RewardShapingParams(clip=-1.0)
