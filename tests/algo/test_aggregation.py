"""Loss aggregation: hand-derived numbers and micro-batch / data-parallel invariance of every mode."""

import math

import pytest
import torch

from molt.algo import AGGREGATIONS, aggregate, step_denominators

F64 = torch.float64
NAN = math.nan

# Row sums 6, 4, 10 over 3, 1, 2 action tokens; row 3 has no action tokens (and NaN losses).
LOSS = torch.tensor([[1, 2, 3, NAN], [4, NAN, NAN, NAN], [5, 5, NAN, NAN], [NAN] * 4], dtype=F64)
MASK = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0]])
GROUPS = torch.tensor([0, 0, 1, 2])  # group 0: 4 tokens; group 1: 2 tokens; group 2: none


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("token-mean", 20 / 6),  # (6 + 4 + 10) / 6 tokens
        ("seq-mean-token-sum", 20 / 3),  # 3 sequences with tokens
        ("seq-mean-token-sum-norm", 20 / (3 * 4)),  # norm_len = 4
        ("seq-mean-token-mean", (6 / 3 + 4 / 1 + 10 / 2) / 3),
        ("prompt-mean-token-mean", ((6 + 4) / 4 + 10 / 2) / 2),  # group 2 has no tokens: 2 prompts
    ],
)
def test_hand_numbers(name, expected):
    denoms = step_denominators([MASK], [GROUPS])
    loss = aggregate(name, LOSS, MASK, denoms, group_ids_b=GROUPS, norm_len=4)
    assert loss.item() == pytest.approx(expected, abs=1e-12)


def test_denominators_count_the_whole_step():
    denoms = step_denominators([MASK[:2], MASK[2:]], [GROUPS[:2], GROUPS[2:]])
    assert denoms.scalars().tolist() == [6.0, 3.0, 2.0]
    assert denoms.group_ids_g.tolist() == [0, 1, 2] and denoms.group_tokens_g.tolist() == [4.0, 2.0, 0.0]


def random_step(seed):
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(9, 7, generator=gen) > 0.35
    mask[4] = False  # a sequence without action tokens
    group_ids = torch.tensor([3, 3, 3, 8, 8, 8, 1, 1, 1])  # groups straddle micro-batches
    weights = torch.randn(9, 7, generator=gen, dtype=F64)
    theta = torch.randn(9, 7, generator=gen, dtype=F64, requires_grad=True)
    return mask, group_ids, weights, theta


def per_token_loss(theta, weights):
    return weights * theta.exp() + theta**2  # any non-linear per-token function


@pytest.mark.parametrize("name", AGGREGATIONS.names())
def test_micro_batch_gradients_sum_to_the_full_batch_gradient(name):
    mask, group_ids, weights, theta = random_step(0)
    full = step_denominators([mask], [group_ids])
    full_loss = aggregate(name, per_token_loss(theta, weights), mask, full, group_ids_b=group_ids, norm_len=7)
    (full_grad,) = torch.autograd.grad(full_loss, theta)

    splits = [slice(0, 2), slice(2, 5), slice(5, 9)]
    step = step_denominators([mask[s] for s in splits], [group_ids[s] for s in splits])
    summed_grad, summed_loss = torch.zeros_like(theta), 0.0
    for s in splits:
        micro = aggregate(
            name, per_token_loss(theta[s], weights[s]), mask[s], step, group_ids_b=group_ids[s], norm_len=7
        )
        (grad,) = torch.autograd.grad(micro, theta)
        summed_grad += grad
        summed_loss += micro.item()
    assert full_grad.abs().sum() > 0
    torch.testing.assert_close(summed_grad, full_grad, rtol=0, atol=1e-6)
    assert summed_loss == pytest.approx(full_loss.item(), abs=1e-9)


def test_local_denominators_would_break_invariance():
    # The control for the test above: per-micro-batch counts give a different gradient.
    mask, _, weights, theta = random_step(0)
    full_loss = aggregate("token-mean", per_token_loss(theta, weights), mask, step_denominators([mask]))
    (full_grad,) = torch.autograd.grad(full_loss, theta)
    local_grad = torch.zeros_like(theta)
    for s in (slice(0, 2), slice(2, 9)):
        local = step_denominators([mask[s]])
        micro = aggregate("token-mean", per_token_loss(theta[s], weights[s]), mask[s], local)
        local_grad += torch.autograd.grad(micro, theta)[0]
    assert (local_grad - full_grad).abs().max() > 1e-3


@pytest.mark.parametrize("name", AGGREGATIONS.names())
def test_data_parallel_ranks_sum_to_the_full_batch(name):
    # Two "ranks" holding whole groups; all_reduced() sums their scalar counts.
    mask, group_ids, weights, theta = random_step(1)
    full = step_denominators([mask], [group_ids])
    full_loss = aggregate(name, per_token_loss(theta, weights), mask, full, group_ids_b=group_ids, norm_len=7)
    ranks = [slice(0, 3), slice(3, 9)]
    local = [step_denominators([mask[r]], [group_ids[r]]) for r in ranks]
    total = sum(d.scalars() for d in local)
    summed = sum(
        aggregate(
            name,
            per_token_loss(theta[r], weights[r]),
            mask[r],
            d.all_reduced(lambda _, total=total: total),
            group_ids_b=group_ids[r],
            norm_len=7,
        )
        for r, d in zip(ranks, local, strict=True)
    )
    assert summed.item() == pytest.approx(full_loss.item(), abs=1e-12)


@pytest.mark.parametrize("name", AGGREGATIONS.names())
def test_empty_mask_gives_zero_and_zero_gradient(name):
    mask = torch.zeros(2, 3)
    theta = torch.full((2, 3), NAN, dtype=F64, requires_grad=True)
    denoms = step_denominators([mask], [torch.tensor([0, 1])])
    loss = aggregate(name, theta * 2, mask, denoms, group_ids_b=torch.tensor([0, 1]), norm_len=3)
    (grad,) = torch.autograd.grad(loss, theta)
    assert loss.item() == 0.0 and grad.abs().sum() == 0


def test_missing_inputs_are_errors():
    denoms = step_denominators([MASK])
    with pytest.raises(ValueError, match="needs group ids"):
        aggregate("prompt-mean-token-mean", LOSS, MASK, denoms, group_ids_b=GROUPS)
    with pytest.raises(ValueError, match="needs norm_len"):
        aggregate("seq-mean-token-sum-norm", LOSS, MASK, denoms)
    other = step_denominators([MASK], [torch.tensor([5, 5, 6, 6])])
    with pytest.raises(ValueError, match="missing from the step denominators"):
        aggregate("prompt-mean-token-mean", LOSS, MASK, other, group_ids_b=GROUPS)
    with pytest.raises(ValueError, match="unknown loss aggregation"):
        aggregate("token-sum", LOSS, MASK, denoms)
