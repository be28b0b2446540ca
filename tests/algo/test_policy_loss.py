"""Surrogates and value loss: hand-derived numbers, gradients by autograd, NaN/inf tokens."""

import math

import pytest
import torch

from molt.algo import POLICY_LOSSES, SurrogateParams, value_loss

F64 = torch.float64


def vec(*values):
    return torch.tensor(values, dtype=F64)


def assert_exact(actual, expected):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=F64), rtol=0, atol=1e-12)


def ratio_inputs(ratios):
    """`logp` (leaf, with grad) and `old` such that exp(logp - old) = ratios, shape [1, T]."""
    old = torch.full((1, len(ratios)), math.log(0.5), dtype=F64)
    logp = (old + torch.log(vec(*ratios))).detach().requires_grad_(True)
    return logp, old


def loss_and_grad(name, logp, old, adv, mask, params):
    loss_bt, metrics = POLICY_LOSSES.get(name)(logp, old, adv, mask, params)
    (grad,) = torch.autograd.grad(loss_bt.sum(), logp)
    return loss_bt.detach(), grad, metrics


def test_ppo_asymmetric_clip_hand_numbers():
    # eps = (0.2, 0.28): band [0.8, 1.28].
    # r=0.5,A=+1: min(0.5, 0.8)=0.5 -> loss -0.5, grad -r*A=-0.5
    # r=0.5,A=-1: min(-0.5, -0.8)=-0.8 (clipped) -> loss 0.8, grad 0
    # r=1.5,A=+1: min(1.5, 1.28)=1.28 (clipped) -> loss -1.28, grad 0
    # r=1.5,A=-1: min(-1.5, -1.28)=-1.5 -> loss 1.5, grad +1.5
    # r=1.1,A=+1: 1.1 -> loss -1.1, grad -1.1
    logp, old = ratio_inputs([0.5, 0.5, 1.5, 1.5, 1.1])
    adv = vec(1, -1, 1, -1, 1).unsqueeze(0)
    loss, grad, metrics = loss_and_grad("ppo", logp, old, adv, torch.ones(1, 5), SurrogateParams(0.2, 0.28))
    assert_exact(loss, [[-0.5, 0.8, -1.28, 1.5, -1.1]])
    assert_exact(grad, [[-0.5, 0.0, 0.0, 1.5, -1.1]])
    assert metrics["clip_frac"].item() == pytest.approx(0.4)
    assert metrics["dual_clip_frac"].item() == 0.0


def test_ppo_dual_clip_caps_negative_advantage_loss():
    # c = 3, band [0.8, 1.2]:
    # r=4,A=-1: min(-4, -1.2) = -4 < 3 * -1 -> -3: loss 3, grad 0 (dual clip)
    # r=2,A=-1: min(-2, -1.2) = -2 > -3: loss 2, grad 2
    # r=4,A=+1: min(4, 1.2) = 1.2 (clipped; dual clip only acts for A < 0): loss -1.2, grad 0
    logp, old = ratio_inputs([4.0, 2.0, 4.0])
    adv = vec(-1, -1, 1).unsqueeze(0)
    params = SurrogateParams(0.2, 0.2, dual_clip=3.0)
    loss, grad, metrics = loss_and_grad("ppo", logp, old, adv, torch.ones(1, 3), params)
    assert_exact(loss, [[3.0, 2.0, -1.2]])
    assert_exact(grad, [[0.0, 2.0, 0.0]])
    assert metrics["dual_clip_frac"].item() == pytest.approx(1 / 3)
    assert metrics["clip_frac"].item() == pytest.approx(1 / 3)


def test_gspo_sequence_ratio_hand_numbers():
    # log-ratios 0.1 and 0.3 -> s = exp(0.2) = 1.2214 for both tokens; A = 1.
    # clip_high 0.28: unclipped, loss -s per token, grad -s per token (gradient through each token).
    # clip_high 0.2: s > 1.2 is clipped, loss -1.2, grad 0.
    old = torch.zeros(1, 2, dtype=F64)
    logp = vec(0.1, 0.3).unsqueeze(0).requires_grad_(True)
    adv, mask, s = torch.ones(1, 2, dtype=F64), torch.ones(1, 2), math.exp(0.2)
    loss, grad, _ = loss_and_grad("gspo", logp, old, adv, mask, SurrogateParams(0.2, 0.28))
    assert_exact(loss, [[-s, -s]])
    assert_exact(grad, [[-s, -s]])
    loss, grad, metrics = loss_and_grad("gspo", logp, old, adv, mask, SurrogateParams(0.2, 0.2))
    assert_exact(loss, [[-1.2, -1.2]])
    assert_exact(grad, [[0.0, 0.0]])
    assert metrics["clip_frac"].item() == 1.0


def test_gspo_with_equal_token_ratios_equals_ppo():
    gen = torch.Generator().manual_seed(0)
    mask = torch.tensor([[1, 1, 1, 0], [0, 1, 1, 1], [1, 0, 0, 0]])
    old = torch.randn(3, 4, generator=gen, dtype=F64)
    shift_b = vec(0.35, -0.4, 0.05).unsqueeze(1)  # one log-ratio per sequence, some clipped
    logp = torch.where(mask.bool(), old + shift_b, math.nan).requires_grad_(True)
    adv = torch.randn(3, 4, generator=gen, dtype=F64)
    params = SurrogateParams(0.2, 0.28, dual_clip=1.5)
    ppo_loss, ppo_grad, _ = loss_and_grad("ppo", logp, old, adv, mask, params)
    gspo_loss, gspo_grad, _ = loss_and_grad("gspo", logp, old, adv, mask, params)
    assert ppo_grad.abs().sum() > 0
    torch.testing.assert_close(gspo_loss, ppo_loss, rtol=0, atol=1e-12)
    torch.testing.assert_close(gspo_grad, ppo_grad, rtol=0, atol=1e-12)


def test_cispo_gradient_is_clipped_weight_times_advantage():
    # weights sg[min(r, 1.2)]: r = 0.5 -> 0.5, r = 2 -> 1.2; grad of -w*A*logp is -w*A,
    # so a clipped token (r = 2) still gets a gradient, unlike PPO.
    logp, old = ratio_inputs([0.5, 2.0])
    adv = vec(1.0, -1.0).unsqueeze(0)
    loss, grad, metrics = loss_and_grad("cispo", logp, old, adv, torch.ones(1, 2), SurrogateParams(0.2, 0.2))
    assert_exact(grad, [[-0.5, 1.2]])
    assert_exact(loss, -vec(0.5, -1.2).unsqueeze(0) * logp.detach())
    assert metrics["clip_frac"].item() == 0.5


def test_cispo_gradient_on_random_batch():
    gen = torch.Generator().manual_seed(3)
    mask = torch.rand(4, 6, generator=gen) > 0.3
    old = torch.randn(4, 6, generator=gen, dtype=F64)
    logp = (old + 0.5 * torch.randn(4, 6, generator=gen, dtype=F64)).requires_grad_(True)
    adv = torch.randn(4, 6, generator=gen, dtype=F64)
    _, grad, _ = loss_and_grad("cispo", logp, old, adv, mask, SurrogateParams(0.2, 0.1))
    ratio = (logp.detach() - old).exp()
    expected = torch.where(mask, -ratio.clamp(max=1.1) * adv, 0.0)
    assert_exact(grad, expected)


def test_plain_pg_is_reinforce():
    logp = vec(-1.0, -2.0, -3.0).unsqueeze(0).requires_grad_(True)
    adv = vec(2.0, -1.0, 5.0).unsqueeze(0)
    mask = torch.tensor([[1, 1, 0]])
    # -A * logp: [2, -2, masked 0]; grad -A on the mask.
    loss, grad, _ = loss_and_grad("pg", logp, logp.detach() + 7.0, adv, mask, SurrogateParams())
    assert_exact(loss, [[2.0, -2.0, 0.0]])
    assert_exact(grad, [[-2.0, 1.0, 0.0]])


@pytest.mark.parametrize("name", POLICY_LOSSES.names())
def test_nonfinite_logprobs_are_dropped_and_counted(name):
    # token 0 fine; token 1 NaN logp; token 2 +inf old; token 3 NaN advantage; token 4 masked NaN.
    logp = vec(-1.0, math.nan, -1.0, -1.0, math.nan).unsqueeze(0).requires_grad_(True)
    old = vec(-1.1, -1.0, math.inf, -1.0, math.nan).unsqueeze(0)
    adv = vec(1.0, 1.0, 1.0, math.nan, 1.0).unsqueeze(0)
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    loss, grad, metrics = loss_and_grad(name, logp, old, adv, mask, SurrogateParams())
    assert torch.isfinite(loss).all() and torch.isfinite(grad).all()
    assert loss[0, 1:].abs().sum() == 0 and grad[0, 1:].abs().sum() == 0
    assert grad[0, 0] != 0
    assert metrics["nonfinite_frac"].item() == pytest.approx(0.75)


@pytest.mark.parametrize("name", POLICY_LOSSES.names())
def test_empty_mask_gives_zero_loss_and_finite_metrics(name):
    logp = torch.randn(2, 3, dtype=F64, requires_grad=True)
    loss, grad, metrics = loss_and_grad(
        name, logp, logp.detach(), torch.ones(2, 3), torch.zeros(2, 3), SurrogateParams()
    )
    assert loss.abs().sum() == 0 and grad.abs().sum() == 0
    assert all(math.isfinite(float(v)) for v in metrics.values())


def test_invalid_clip_params_are_errors():
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        SurrogateParams(dual_clip=1.0)
    with pytest.raises(ValueError, match="clip_low"):
        SurrogateParams(clip_low=-0.1)


def test_value_loss_clipped_hand_numbers():
    # t0: (V - R)^2 = 1; V_old + clip(0.5, 0.2) = 0.7 -> (0.7 - 2)^2 = 1.69 > 1 -> 0.845, clipped, grad 0
    # t1: V - V_old = 0.1 inside the band -> both terms (2 - 1)^2 -> 0.5, grad V - R = 1
    values = vec(1.0, 2.0).unsqueeze(0).requires_grad_(True)
    old, returns, mask = vec(0.5, 1.9).unsqueeze(0), vec(2.0, 1.0).unsqueeze(0), torch.ones(1, 2)
    loss, metrics = value_loss(values, old, returns, mask, clip=0.2)
    (grad,) = torch.autograd.grad(loss.sum(), values)
    assert_exact(loss.detach(), [[0.845, 0.5]])
    assert_exact(grad, [[0.0, 1.0]])
    assert metrics["value_clip_frac"].item() == 0.5
    assert metrics["value_loss"].item() == pytest.approx(0.6725)
    unclipped, metrics = value_loss(values, old, returns, mask, clip=None)
    assert_exact(unclipped.detach(), [[0.5, 0.5]])
    assert "value_clip_frac" not in metrics


def test_value_loss_ignores_nan_off_the_mask_in_its_gradient():
    nan = math.nan
    values = torch.tensor([[0.5, nan], [nan, nan]], requires_grad=True)
    old, returns = torch.tensor([[0.6, nan], [nan, 1.0]]), torch.tensor([[1.0, nan], [0.0, nan]])
    mask = torch.tensor([[1.0, 0.0], [0.0, 0.0]])
    for clip in (0.2, None):
        loss, _ = value_loss(values, old, returns, mask, clip=clip)
        (grad,) = torch.autograd.grad(loss.sum(), values)
        assert loss.tolist() == [[0.125, 0.0], [0.0, 0.0]] and grad.tolist() == [[-0.5, 0.0], [0.0, 0.0]]
