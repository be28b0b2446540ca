"""Advantage estimators: hand-derived numbers, rollout de-duplication, and documented edge cases."""

import math

import pytest
import torch

from molt.algo import ESTIMATORS, AdvantageInputs, AdvantageParams, add_teacher_kl, compute_advantages

F64 = torch.float64


def vec(*values):
    return torch.tensor(values, dtype=F64)


def assert_exact(actual, expected):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=F64), rtol=0, atol=1e-12)


# Rewards of group 0 are 1, 2, 3 (mean 2, sample std sqrt((1 + 0 + 1) / 2) = 1); group 1 is a
# singleton with reward 5. The reward-1 rollout is split into two segments (samples 0 and 1).
GROUPS = dict(
    mask_bt=torch.tensor([[1, 1, 0], [0, 1, 0], [1, 0, 0], [1, 1, 1], [1, 0, 0]]),
    rewards_b=vec(1, 1, 2, 3, 5),
    group_ids_b=torch.tensor([7, 7, 7, 7, 9]),
    rollout_ids_b=torch.tensor([0, 0, 1, 2, 3]),
)


def broadcast(per_sample, mask):
    return torch.as_tensor(per_sample, dtype=F64).unsqueeze(1) * mask.to(F64)


def test_grpo_sample_std_and_epsilon():
    adv, returns, _ = compute_advantages("grpo", AdvantageInputs(**GROUPS))
    # (r - 2) / (1 + 1e-6); the singleton group has std 0 and r - mean = 0.
    eps_scale = 1 / (1 + 1e-6)
    expected = broadcast([-eps_scale, -eps_scale, 0.0, eps_scale, 0.0], GROUPS["mask_bt"])
    assert_exact(adv, expected)
    assert_exact(returns, expected)


def test_segments_of_one_rollout_count_once():
    # Counting samples instead of rollouts would give group 7 rewards [1, 1, 2, 3], mean 1.75.
    adv, _, _ = compute_advantages("dr_grpo", AdvantageInputs(**GROUPS))
    assert_exact(adv, broadcast([-1.0, -1.0, 0.0, 1.0, 0.0], GROUPS["mask_bt"]))
    without_ids = dict(GROUPS, rollout_ids_b=None)
    adv_per_sample, _, _ = compute_advantages("dr_grpo", AdvantageInputs(**without_ids))
    assert_exact(adv_per_sample, broadcast([-0.75, -0.75, 0.25, 1.25, 0.0], GROUPS["mask_bt"]))


def test_rloo_leave_one_out_and_singleton_keeps_reward():
    # r=1: baseline (2 + 3) / 2 = 2.5 -> -1.5; r=2: (1 + 3) / 2 -> 0; r=3: 1.5 -> 1.5; singleton: 5.
    adv, _, _ = compute_advantages("rloo", AdvantageInputs(**GROUPS))
    assert_exact(adv, broadcast([-1.5, -1.5, 0.0, 1.5, 5.0], GROUPS["mask_bt"]))


def test_reinforce_baseline_whitens_over_action_tokens():
    # One group, rewards 0 and 2 -> r - mean = [-1, 1]; tokens [-1, -1, 1] (first row has two):
    # mean -1/3, population std 2*sqrt(2)/3 -> [-1/sqrt2, -1/sqrt2, sqrt2].
    inputs = AdvantageInputs(
        mask_bt=torch.tensor([[1, 1, 0], [0, 1, 0]]), rewards_b=vec(0, 2), group_ids_b=torch.tensor([0, 0])
    )
    adv, returns, _ = compute_advantages("reinforce_baseline", inputs)
    s = 1 / math.sqrt(2)
    assert_exact(adv, [[-s, -s, 0.0], [0.0, math.sqrt(2), 0.0]])
    assert_exact(returns, [[-1.0, -1.0, 0.0], [0.0, 1.0, 0.0]])
    raw, _, _ = compute_advantages("reinforce_baseline", inputs, AdvantageParams(whiten=False))
    assert_exact(raw, returns)


def test_reinforce_kl_penalty_transparent_observations_and_discount():
    # Action tokens at 1, 2, 4 (3 is an observation). beta = 0.1, gamma = 0.9, reward 1:
    # r_1 = -0.05, r_2 = -0.02, r_4 = 1 - 0.01 = 0.99 (kl 9 at observations is ignored)
    # G_4 = 0.99; G_2 = -0.02 + 0.9 * 0.99 = 0.871; G_1 = -0.05 + 0.9 * 0.871 = 0.7339
    inputs = AdvantageInputs(
        mask_bt=torch.tensor([[0, 1, 1, 0, 1]]),
        rewards_b=vec(1.0),
        kl_bt=vec(9.0, 0.5, 0.2, 9.0, 0.1).unsqueeze(0),
    )
    params = AdvantageParams(gamma=0.9, kl_coef=0.1, whiten=False)
    adv, returns, _ = compute_advantages("reinforce", inputs, params)
    assert_exact(returns, [[0.0, 0.7339, 0.871, 0.0, 0.99]])
    assert_exact(adv, returns)


def test_gae_hand_numbers_with_masked_positions_transparent():
    # V = 0.5 on actions 1, 2, 4; reward 1 at 4; gamma 0.9, lambda 0.8 (gamma * lambda = 0.72):
    # d_4 = 1 - 0.5 = 0.5;            A_4 = 0.5
    # d_2 = 0.9 * 0.5 - 0.5 = -0.05;  A_2 = -0.05 + 0.72 * 0.5 = 0.31
    # d_1 = -0.05;                    A_1 = -0.05 + 0.72 * 0.31 = 0.1732
    inputs = AdvantageInputs(
        mask_bt=torch.tensor([[0, 1, 1, 0, 1]]),
        rewards_b=vec(1.0),
        values_bt=vec(100.0, 0.5, 0.5, 100.0, 0.5).unsqueeze(0),
    )
    adv, returns, _ = compute_advantages("gae", inputs, AdvantageParams(gamma=0.9, lam=0.8, whiten=False))
    assert_exact(adv, [[0.0, 0.1732, 0.31, 0.0, 0.5]])
    assert_exact(returns, [[0.0, 0.6732, 0.81, 0.0, 1.0]])


def sequential_gae(rewards, values, mask, gamma, lam):
    """Reference: the transparent-mask recursion, one token at a time."""
    adv = torch.zeros_like(values)
    for b in range(values.shape[0]):
        next_value, running = 0.0, 0.0
        last = max([t for t in range(values.shape[1]) if mask[b, t]], default=None)
        for t in reversed(range(values.shape[1])):
            if mask[b, t]:
                reward = rewards[b] if t == last else 0.0
                running = reward + gamma * next_value - values[b, t] + gamma * lam * running
                next_value = values[b, t]
                adv[b, t] = running
    return adv


def test_gae_matches_sequential_reference_on_random_batch():
    gen = torch.Generator().manual_seed(1)
    mask = torch.rand(6, 13, generator=gen) > 0.4
    mask[2] = False  # an empty row
    values = torch.randn(6, 13, generator=gen, dtype=F64)
    rewards = torch.randn(6, generator=gen, dtype=F64)
    inputs = AdvantageInputs(mask_bt=mask, rewards_b=rewards, values_bt=values)
    adv, _, _ = compute_advantages("gae", inputs, AdvantageParams(gamma=0.95, lam=0.7, whiten=False))
    assert_exact(adv, sequential_gae(rewards, values, mask, 0.95, 0.7))


def test_on_policy_distill_is_negative_scaled_kl():
    inputs = AdvantageInputs(mask_bt=torch.tensor([[1, 1, 0]]), kl_bt=vec(0.3, -0.2, math.nan).unsqueeze(0))
    adv, returns, metrics = compute_advantages("on_policy_distill", inputs, AdvantageParams(kl_coef=2.0))
    assert_exact(adv, [[-0.6, 0.4, 0.0]])
    assert_exact(returns, adv)
    assert metrics["distill_kl"].item() == pytest.approx(0.05)


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "reinforce_baseline"])
def test_all_equal_rewards_and_group_of_one_give_zero(name):
    inputs = AdvantageInputs(
        mask_bt=torch.ones(4, 2), rewards_b=vec(1, 1, 1, 3), group_ids_b=torch.tensor([0, 0, 0, 1])
    )
    adv, _, _ = compute_advantages(name, inputs)
    assert torch.isfinite(adv).all() and adv.abs().max() == 0


@pytest.mark.parametrize(("size", "reward"), [(16, 0.7), (64, 0.7), (64, 0.9), (16, 3.7), (16, 100.7), (6, 0.1)])
def test_grpo_gives_an_equal_float32_group_zero(size, reward):
    """The trainer's rewards are float32, whose group mean can miss equal rewards by an ulp; GRPO divides that by a
    std of the same size, so the group would get +-0.1 to 0.9 each (e.g. rewards clipped to 0.7 by algo.reward_clip)."""
    inputs = AdvantageInputs(
        mask_bt=torch.ones(size, 2),
        rewards_b=torch.full((size,), reward, dtype=torch.float32),
        group_ids_b=torch.zeros(size, dtype=torch.long),
    )
    adv, _, _ = compute_advantages("grpo", inputs)
    assert adv.dtype == torch.float32 and adv.abs().max() <= 1e-6


@pytest.mark.parametrize("name", ESTIMATORS.names())
def test_empty_mask_gives_zeros_and_finite_metrics(name):
    inputs = AdvantageInputs(
        mask_bt=torch.zeros(2, 3),
        rewards_b=vec(1, 0),
        group_ids_b=torch.tensor([0, 0]),
        kl_bt=torch.full((2, 3), math.nan, dtype=F64),
        values_bt=torch.full((2, 3), math.nan, dtype=F64),
    )
    params = AdvantageParams(kl_coef=0.0)
    adv, returns, metrics = compute_advantages(name, inputs, params)
    assert adv.abs().sum() == 0 and returns.abs().sum() == 0
    assert all(math.isfinite(float(v)) for v in metrics.values())


def test_metrics_are_detached_scalars():
    _, _, metrics = compute_advantages("grpo", AdvantageInputs(**GROUPS))
    names = {"advantage_mean", "advantage_std", "return_mean", "reward_mean", "group_reward_std"}
    assert names <= set(metrics)
    assert all(v.dim() == 0 and not v.requires_grad for v in metrics.values())
    assert metrics["reward_mean"].item() == pytest.approx(11 / 4)  # rollouts 1, 2, 3, 5
    assert metrics["group_reward_std"].item() == pytest.approx(1.0)  # only group 7 has n > 1


def test_nonfinite_rewards_are_rejected():
    with pytest.raises(ValueError, match="non-finite rewards"):
        compute_advantages("grpo", AdvantageInputs(**dict(GROUPS, rewards_b=vec(1, 1, math.nan, 3, 5))))


def test_inconsistent_segments_are_rejected():
    with pytest.raises(ValueError, match="different rewards"):
        compute_advantages("grpo", AdvantageInputs(**dict(GROUPS, rewards_b=vec(1, 0, 2, 3, 5))))
    with pytest.raises(ValueError, match="different group ids"):
        compute_advantages("grpo", AdvantageInputs(**dict(GROUPS, group_ids_b=torch.tensor([7, 8, 7, 7, 9]))))


def test_missing_inputs_and_ignored_kl_are_errors():
    with pytest.raises(ValueError, match="'grpo' needs group_ids_b"):
        compute_advantages("grpo", AdvantageInputs(mask_bt=torch.ones(1, 1), rewards_b=vec(1)))
    with pytest.raises(ValueError, match="'gae' needs values_bt"):
        compute_advantages("gae", AdvantageInputs(mask_bt=torch.ones(1, 1), rewards_b=vec(1)))
    with pytest.raises(
        ValueError, match=r"ignores a per-token KL reward; add the KL as a loss term instead \(--algo.kl_coef\)"
    ):
        with_kl = AdvantageInputs(**GROUPS, kl_bt=torch.zeros(5, 3))
        compute_advantages("grpo", with_kl, AdvantageParams(kl_coef=0.1))
    with pytest.raises(ValueError, match="unknown advantage estimator"):
        compute_advantages("ppo", AdvantageInputs(**GROUPS))


def test_teacher_kl_is_subtracted_from_another_estimators_advantage_on_action_tokens():
    adv = torch.tensor([[0.0, 1.0, 1.0], [0.0, -1.0, 0.0]])
    kl = torch.tensor([[9.0, 0.5, -0.25], [9.0, 2.0, 9.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0], [0.0, 1.0, 0.0]])
    mixed, metrics = add_teacher_kl(adv, kl, mask, coef=2.0)
    assert torch.equal(mixed, torch.tensor([[0.0, 0.0, 1.5], [0.0, -5.0, 0.0]]))
    assert metrics["distill_kl"].item() == pytest.approx((0.5 - 0.25 + 2.0) / 3)
    assert metrics["advantage_mean"].item() == pytest.approx((0.0 + 1.5 - 5.0) / 3)  # of the advantage trained


def test_registry_says_which_estimators_use_a_group_baseline_and_reward_mean_counts_rollouts_once():
    baseline = {name for name in ESTIMATORS.names() if ESTIMATORS.info(name)["group_baseline"]}
    assert baseline == {"grpo", "dr_grpo", "rloo", "reinforce_baseline"}
    for name in ("reinforce", "dr_grpo"):  # rewards 1 (two segments), 2, 3, 5 -> 11 / 4, not 12 / 5
        _, _, metrics = compute_advantages(name, AdvantageInputs(**GROUPS))
        assert metrics["reward_mean"].item() == pytest.approx(11 / 4)
