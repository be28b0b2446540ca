"""KL estimators (hand numbers, clamps, unbiasedness) and coefficient controllers."""

import math

import pytest
import torch

from molt.algo import AdaptiveKLController, FixedKLController, kl_estimate, make_kl_controller

F64 = torch.float64


def test_estimators_hand_numbers_and_guards():
    # x = logp - ref = [0.5, -0.5, 0, +inf -> 30, NaN -> 0, masked]
    logp = torch.tensor([[0.5, -0.5, 1.0, 0.0, math.nan, 123.0]], dtype=F64)
    ref = torch.tensor([[0.0, 0.0, 1.0, -math.inf, 0.0, math.nan]], dtype=F64)
    mask = torch.tensor([[1, 1, 1, 1, 1, 0]])
    k1 = kl_estimate("k1", logp, ref, mask)
    k2 = kl_estimate("k2", logp, ref, mask)
    k3 = kl_estimate("k3", logp, ref, mask)
    torch.testing.assert_close(k1, torch.tensor([[0.5, -0.5, 0.0, 30.0, 0.0, 0.0]], dtype=F64))
    torch.testing.assert_close(k2, torch.tensor([[0.125, 0.125, 0.0, 10.0, 0.0, 0.0]], dtype=F64))
    # k3 = exp(-x) - 1 + x: exp(-0.5) - 0.5 = 0.1065307; exp(0.5) - 1.5 = 0.1487213; capped at 10
    expected_k3 = [[math.exp(-0.5) - 0.5, math.exp(0.5) - 1.5, 0.0, 10.0, 0.0, 0.0]]
    torch.testing.assert_close(k3, torch.tensor(expected_k3, dtype=F64), rtol=0, atol=1e-12)


def test_k1_keeps_a_finite_log_ratio_past_the_inf_cap_and_k3_stays_finite_with_its_gradient():
    """k1 (the reward of KL penalties and teacher distillation) is not capped: a teacher at log-prob -45 below the
    policy gives 45, not 30. k3 clamps x first, so exp(-x) of a large negative x has a finite (zero) gradient."""
    logp = torch.tensor([[0.0, -45.0]], dtype=F64, requires_grad=True)
    ref = torch.tensor([[-45.0, 0.0]], dtype=F64)
    torch.testing.assert_close(kl_estimate("k1", logp, ref, torch.ones(1, 2)), torch.tensor([[45.0, -45.0]], dtype=F64))
    k3 = kl_estimate("k3", logp, ref, torch.ones(1, 2))
    (grad,) = torch.autograd.grad(k3.sum(), logp)
    assert k3.tolist() == [[10.0, 10.0]] and grad.tolist() == [[0.0, 0.0]]


def test_k3_gradient_and_nonnegativity():
    gen = torch.Generator().manual_seed(0)
    ref = torch.randn(3, 5, generator=gen, dtype=F64)
    logp = (ref + torch.randn(3, 5, generator=gen, dtype=F64)).requires_grad_(True)
    k3 = kl_estimate("k3", logp, ref, torch.ones(3, 5))
    (grad,) = torch.autograd.grad(k3.sum(), logp)
    assert (k3 >= 0).all()
    x = logp.detach() - ref
    torch.testing.assert_close(grad, torch.where(k3 < 10, 1 - torch.exp(-x), 0.0))


@pytest.mark.parametrize("name", ["k1", "k3"])
def test_unbiased_estimators_match_the_exact_kl(name):
    # Sample tokens from p; the mean estimate approaches KL(p || q) = sum p log(p / q).
    p = torch.tensor([0.5, 0.3, 0.2], dtype=F64)
    q = torch.tensor([0.2, 0.3, 0.5], dtype=F64)
    exact = (p * (p / q).log()).sum().item()
    tokens = torch.multinomial(p, 200_000, replacement=True, generator=torch.Generator().manual_seed(0))
    estimate = kl_estimate(name, p.log()[tokens][None], q.log()[tokens][None], torch.ones(1, tokens.numel()))
    assert estimate.mean().item() == pytest.approx(exact, abs=5e-3)


def test_fixed_controller_never_moves():
    controller = make_kl_controller("fixed", coef=0.05)
    assert isinstance(controller, FixedKLController)
    assert controller.update(kl=100.0, num_samples=1000) == 0.05


def test_adaptive_controller_hand_numbers():
    controller = make_kl_controller("adaptive", coef=0.1, target=1.0, horizon=100)
    assert isinstance(controller, AdaptiveKLController)
    # kl 1.5: error clip(0.5, +-0.2) = 0.2 -> 0.1 * (1 + 0.2 * 10 / 100) = 0.102
    assert controller.update(kl=1.5, num_samples=10) == pytest.approx(0.102)
    # kl 0.9: error -0.1 -> 0.102 * (1 - 0.1 * 10 / 100) = 0.10098
    assert controller.update(kl=0.9, num_samples=10) == pytest.approx(0.10098)


def test_controller_errors():
    with pytest.raises(ValueError, match="target, horizon > 0"):
        AdaptiveKLController(coef=0.1, target=0.0)
    with pytest.raises(ValueError, match="unknown KL controller"):
        make_kl_controller("pid", coef=0.1)
    with pytest.raises(ValueError, match="unknown KL estimator"):
        kl_estimate("k4", torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1))


def test_adaptive_coef_pure_function_hand_numbers():
    """beta * (1 + clip(kl / target - 1, +-0.2) * min(n / horizon, 1)): the error is clipped at 0.2 both ways."""
    from molt.algo import adaptive_kl_coef

    assert adaptive_kl_coef(0.1, kl=1.1, target=1.0, num_samples=50, horizon=100) == pytest.approx(0.1 * 1.05)
    assert adaptive_kl_coef(0.1, kl=9.0, target=1.0, num_samples=50, horizon=100) == pytest.approx(0.1 * 1.1)
    assert adaptive_kl_coef(0.1, kl=0.0, target=1.0, num_samples=50, horizon=100) == pytest.approx(0.1 * 0.9)
    # more samples than the horizon (segments of long rollouts): capped at 20% a step, so beta stays positive
    assert adaptive_kl_coef(0.1, kl=0.0, target=1.0, num_samples=800, horizon=100) == pytest.approx(0.1 * 0.8)
