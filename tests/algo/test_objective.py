"""The composed micro-batch loss: decoupled PPO, KL/entropy terms, and micro-batch invariance."""

import math

import pytest
import torch

from molt.algo import (
    AGGREGATIONS,
    ISCorrectionParams,
    ObjectiveParams,
    PolicyBatch,
    SurrogateParams,
    policy_objective,
    step_denominators,
)

F64 = torch.float64


def test_decoupled_ppo_clips_against_proximal_and_weights_by_behaviour():
    # token 0: current/proximal = 1.5 (clipped at 1.2, A > 0 -> no gradient) although
    #          current/behaviour = 1.5 * 0.8 = 1.2 would sit inside the band; w = 0.8.
    #          loss = -w * 1.2 * A = -0.96
    # token 1: current = proximal (ratio 1); proximal/behaviour = 2 -> w = 2 (trunc at 5).
    #          loss = -2 * 1 * 1 = -2, d/dlogp = -w * r * A = -2
    # token-mean over 2 tokens: -1.48, gradient [0, -1].
    proximal = torch.tensor([[-1.0, -1.0]], dtype=F64)
    logp = (proximal + torch.tensor([[math.log(1.5), 0.0]], dtype=F64)).requires_grad_(True)
    behaviour = proximal - torch.tensor([[math.log(0.8), math.log(2.0)]], dtype=F64)
    mask = torch.ones(1, 2)
    adv = torch.ones(1, 2, dtype=F64)
    batch = PolicyBatch(logp, mask, adv, old_logp_bt=proximal, rollout_logp_bt=behaviour)
    params = ObjectiveParams(is_correction=ISCorrectionParams("token", "trunc", high=5.0))
    loss, metrics = policy_objective(batch, step_denominators([mask]), params)
    (grad,) = torch.autograd.grad(loss, logp)
    assert loss.item() == pytest.approx(-1.48, abs=1e-12)
    torch.testing.assert_close(grad, torch.tensor([[0.0, -1.0]], dtype=F64), rtol=0, atol=1e-12)
    assert metrics["clip_frac"].item() == 0.5
    assert metrics["is_weight_mean"].item() == pytest.approx(1.4)


def test_on_policy_default_has_unit_ratio():
    logp = torch.tensor([[-0.3, -2.0, -1.0]], dtype=F64, requires_grad=True)
    adv = torch.tensor([[1.0, -2.0, 5.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 0]])
    batch = PolicyBatch(logp, mask, adv)
    loss, metrics = policy_objective(batch, step_denominators([mask]), ObjectiveParams())
    (grad,) = torch.autograd.grad(loss, logp)
    # ratio 1 -> loss = -(1 - 2) / 2 = 0.5; gradient -A / N on the mask
    assert loss.item() == pytest.approx(0.5)
    torch.testing.assert_close(grad, torch.tensor([[-0.5, 1.0, 0.0]], dtype=F64))
    assert metrics["policy_loss"].item() == pytest.approx(0.5)


def test_kl_loss_and_entropy_bonus_are_added_with_the_step_denominator():
    logp = torch.tensor([[-1.0, -1.0]], dtype=F64, requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0]], dtype=F64)  # k1 = [0.5, 0]
    entropy = torch.tensor([[2.0, 4.0]], dtype=F64, requires_grad=True)
    mask = torch.ones(1, 2)
    batch = PolicyBatch(logp, mask, torch.zeros(1, 2, dtype=F64), ref_logp_bt=ref, entropy_bt=entropy)
    params = ObjectiveParams(kl_estimator="k1", kl_loss_coef=0.1, entropy_coef=0.01)
    loss, metrics = policy_objective(batch, step_denominators([mask, torch.ones(1, 2)]), params)
    # A = 0; N = 4 tokens in the step: 0.1 * 0.5 / 4 - 0.01 * 6 / 4 = 0.0125 - 0.015
    assert loss.item() == pytest.approx(-0.0025, abs=1e-12)
    assert metrics["kl"].item() == pytest.approx(0.25) and metrics["entropy"].item() == pytest.approx(3.0)


def test_a_nonfinite_token_is_dropped_from_the_entropy_bonus_as_from_the_surrogate():
    logp = torch.tensor([[-1.0, math.nan]], dtype=F64, requires_grad=True)
    entropy = torch.tensor([[2.0, math.nan]], dtype=F64, requires_grad=True)
    mask = torch.ones(1, 2)
    batch = PolicyBatch(logp, mask, torch.ones(1, 2, dtype=F64), entropy_bt=entropy)
    loss, metrics = policy_objective(batch, step_denominators([mask]), ObjectiveParams(entropy_coef=0.1))
    (grad,) = torch.autograd.grad(loss, entropy)
    # the NaN token adds nothing but still counts in the denominator: (-1 - 0.1 * 2) / 2
    assert loss.item() == pytest.approx(-0.6, abs=1e-12) and grad.tolist() == [[-0.05, 0.0]]
    assert metrics["entropy"].item() == pytest.approx(1.0) and metrics["nonfinite_frac"].item() == 0.5


def test_nonfinite_frac_is_zero_without_action_tokens():
    logp = torch.tensor([[-1.0, -2.0]], dtype=F64, requires_grad=True)
    mask = torch.zeros(1, 2)
    _, metrics = policy_objective(PolicyBatch(logp, mask, torch.ones(1, 2, dtype=F64)), step_denominators([mask]),
                                  ObjectiveParams())  # fmt: skip
    assert metrics["nonfinite_frac"].item() == 0.0


@pytest.mark.parametrize("loss_agg", AGGREGATIONS.names())
@pytest.mark.parametrize("policy_loss", ["ppo", "gspo", "cispo"])
def test_objective_is_micro_batch_invariant(loss_agg, policy_loss):
    gen = torch.Generator().manual_seed(2)
    num_b, num_t = 8, 6
    mask = torch.rand(num_b, num_t, generator=gen) > 0.3
    old = -torch.rand(num_b, num_t, generator=gen, dtype=F64) * 3
    theta = (old + 0.3 * torch.randn(num_b, num_t, generator=gen, dtype=F64)).requires_grad_(True)
    rollout = old + 0.2 * torch.randn(num_b, num_t, generator=gen, dtype=F64)
    ref = old + 0.5 * torch.randn(num_b, num_t, generator=gen, dtype=F64)
    adv = torch.randn(num_b, num_t, generator=gen, dtype=F64)
    group_ids = torch.arange(num_b) // 3
    params = ObjectiveParams(
        policy_loss=policy_loss,
        loss_agg=loss_agg,
        surrogate=SurrogateParams(0.2, 0.28, dual_clip=None if policy_loss == "cispo" else 3.0),
        is_correction=ISCorrectionParams("token", "mask", 0.7, 1.4),
        kl_loss_coef=0.05,
        norm_len=num_t,
    )

    def loss_of(rows, denoms):
        batch = PolicyBatch(theta[rows], mask[rows], adv[rows], old[rows], rollout[rows], ref[rows])
        batch.group_ids_b = group_ids[rows]
        return policy_objective(batch, denoms, params)[0]

    (full_grad,) = torch.autograd.grad(loss_of(slice(None), step_denominators([mask], [group_ids])), theta)
    splits = [slice(0, 2), slice(2, 5), slice(5, 8)]
    step = step_denominators([mask[s] for s in splits], [group_ids[s] for s in splits])
    summed = sum(torch.autograd.grad(loss_of(s, step), theta)[0] for s in splits)
    assert full_grad.abs().sum() > 0
    torch.testing.assert_close(summed, full_grad, rtol=0, atol=1e-6)


def test_unknown_names_fail_at_construction():
    with pytest.raises(ValueError, match="unknown policy loss 'trpo'"):
        ObjectiveParams(policy_loss="trpo")
    with pytest.raises(ValueError, match="unknown loss aggregation"):
        ObjectiveParams(loss_agg="sum")
    with pytest.raises(ValueError, match="unknown KL estimator"):
        ObjectiveParams(kl_estimator="k5")


def test_is_correction_without_rollout_logprobs_is_an_error():
    logp, mask = torch.zeros(1, 2, dtype=F64, requires_grad=True), torch.ones(1, 2)
    params = ObjectiveParams(is_correction=ISCorrectionParams("token", "trunc", high=2.0))
    with pytest.raises(ValueError, match="needs rollout_logp_bt"):
        policy_objective(PolicyBatch(logp, mask, torch.ones(1, 2)), step_denominators([mask]), params)
