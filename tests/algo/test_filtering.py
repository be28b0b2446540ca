"""Group filters (DAPO dynamic sampling), overlong shaping/masking and reward clipping."""

import math

import pytest
import torch

from molt.algo import FilterParams, clip_rewards, filter_groups, mask_truncated, overlong_penalty


def test_all_equal_and_nonfinite_groups_are_dropped_whole():
    # groups: 0 = [1, 1, 1] all equal; 1 = [0, 1] kept; 2 = [0, 0] all equal; 3 = [1] singleton;
    # 4 = [NaN, 1] non-finite.
    scores = torch.tensor([1, 1, 1, 0, 1, 0, 0, 1, math.nan, 1.0])
    group_ids = torch.tensor([0, 0, 0, 1, 1, 2, 2, 3, 4, 4])
    keep, metrics = filter_groups(scores, group_ids)
    assert keep.tolist() == [False] * 3 + [True] * 2 + [False] * 5
    assert metrics["filter_all_equal_frac"].item() == pytest.approx(3 / 5)
    assert metrics["filter_nonfinite_frac"].item() == pytest.approx(1 / 5)
    assert metrics["filter_keep_frac"].item() == pytest.approx(1 / 5)


def test_score_range_counts_each_rollout_once():
    # Group 5: rollouts r0 (score 1, two segments), r1 = 1, r2 = 0 -> mean 2/3 over rollouts
    # (3/4 if segments were counted). Group 6: [0, 0, 1] -> mean 1/3.
    scores = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0])
    group_ids = torch.tensor([5, 5, 5, 5, 6, 6, 6])
    rollout_ids = torch.tensor([0, 0, 1, 2, 3, 4, 5])
    params = FilterParams(score_range=(0.5, 0.7))
    keep, metrics = filter_groups(scores, group_ids, rollout_ids, filters=["score-range"], params=params)
    assert keep.tolist() == [True] * 4 + [False] * 3
    assert metrics["filter_score_range_frac"].item() == pytest.approx(0.5)
    keep_by_sample, _ = filter_groups(scores, group_ids, None, filters=["score-range"], params=params)
    assert keep_by_sample.tolist() == [False] * 7  # without rollout ids group 5's mean is 0.75


def test_score_range_bounds_are_exclusive():
    """DAPO's 0 < mean < 1: groups all failed (mean 0) or all solved (mean 1) are dropped, a mixed one kept."""
    scores = torch.tensor([0.0, 0.0, 1.0, 1.0, 0.0, 1.0])
    keep, _ = filter_groups(scores, torch.tensor([0, 0, 1, 1, 2, 2]), filters=["score-range"])
    assert keep.tolist() == [False, False, False, False, True, True]


def test_unknown_filter_is_an_error():
    with pytest.raises(ValueError, match="unknown group filter"):
        filter_groups(torch.zeros(2), torch.zeros(2, dtype=torch.long), filters=["bogus"])


def test_auto_beside_other_filters_is_the_estimators_set_and_those():
    """`--rollout.filters auto my-filter` adds a (plugin's) filter to the default set; it was refused."""
    from molt.config import ConfigError
    from molt.config.rl import RolloutConfig, check_filter_names

    both = RolloutConfig(filters=("auto", "score-range"))
    check_filter_names(both)
    assert both.group_filters("grpo") == ("nonfinite", "all-equal", "score-range")
    assert both.group_filters("reinforce") == ("nonfinite", "score-range")
    assert RolloutConfig(filters=("nonfinite", "auto")).group_filters("grpo") == ("nonfinite", "all-equal")
    with pytest.raises(ConfigError, match=r"rollout.filters: unknown \['nope'\]; choose from auto, "):
        check_filter_names(RolloutConfig(filters=("auto", "nope")))


def test_overlong_penalty_dapo_shape():
    # max 10, buffer 4: free up to 6 tokens, then linear to -1 at 10, -1 beyond.
    lengths = torch.tensor([5, 6, 8, 10, 12])
    assert overlong_penalty(lengths, max_len=10, buffer_len=4).tolist() == [0.0, 0.0, -0.5, -1.0, -1.0]
    assert overlong_penalty(lengths, 10, 4, factor=0.5).tolist() == [0.0, 0.0, -0.25, -0.5, -0.5]
    with pytest.raises(ValueError, match="buffer_len"):
        overlong_penalty(lengths, max_len=10, buffer_len=0)


def test_mask_truncated_zeroes_only_truncated_rows():
    mask = torch.tensor([[1, 1, 0], [0, 1, 1]])
    new_mask, metrics = mask_truncated(mask, torch.tensor([False, True]))
    assert new_mask.tolist() == [[1, 1, 0], [0, 0, 0]] and mask.tolist() == [[1, 1, 0], [0, 1, 1]]
    assert metrics["overlong_frac"].item() == 0.5


def test_clip_rewards():
    clipped, metrics = clip_rewards(torch.tensor([-20.0, 0.5, 15.0]), -10.0, 10.0)
    assert clipped.tolist() == [-10.0, 0.5, 10.0]
    assert metrics["reward_clip_frac"].item() == pytest.approx(2 / 3)
