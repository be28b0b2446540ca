"""Masked primitives: the doubling scan equals the sequential recursion; indices; whitening."""

import math

import torch

from molt.algo.masked import (
    last_action_index,
    masked_mean,
    masked_whiten,
    next_action_index,
    reverse_linear_scan,
    sanitized_log_ratio,
)

F64 = torch.float64


def sequential_scan(b, a):
    out = torch.zeros_like(b)
    carry = torch.zeros(b.shape[0], dtype=b.dtype)
    for t in reversed(range(b.shape[1])):
        carry = b[:, t] + a[:, t] * carry
        out[:, t] = carry
    return out


def test_reverse_scan_matches_sequential_recursion():
    gen = torch.Generator().manual_seed(0)
    for num_t in (1, 2, 5, 8, 37):
        b = torch.randn(4, num_t, generator=gen, dtype=F64)
        a = torch.rand(4, num_t, generator=gen, dtype=F64) * 1.2
        torch.testing.assert_close(reverse_linear_scan(b, a), sequential_scan(b, a), rtol=0, atol=1e-12)


def test_reverse_scan_hand_numbers():
    # x_2 = 1; x_1 = 2 + 0.5 * 1 = 2.5; x_0 = 3 + 0.1 * 2.5 = 3.25
    b = torch.tensor([[3.0, 2.0, 1.0]], dtype=F64)
    a = torch.tensor([[0.1, 0.5, 7.0]], dtype=F64)  # a at the last position multiplies x_T = 0
    assert reverse_linear_scan(b, a).tolist() == [[3.25, 2.5, 1.0]]


def test_last_and_next_action_index():
    mask = torch.tensor([[0, 1, 1, 0, 1], [0, 0, 0, 0, 0], [1, 0, 0, 0, 0]])
    last, has = last_action_index(mask)
    assert last.tolist() == [4, 0, 0] and has.tolist() == [True, False, True]
    assert next_action_index(mask).tolist() == [[1, 2, 4, 4, 5], [5, 5, 5, 5, 5], [5, 5, 5, 5, 5]]


def test_masked_mean_and_whiten_ignore_off_mask_garbage():
    x = torch.tensor([[-1.0, -1.0, math.nan], [1.0, math.inf, 0.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert masked_mean(x, mask).item() == -1 / 3
    # tokens [-1, -1, 1]: mean -1/3, population var (4/9 + 4/9 + 16/9) / 3 = 8/9, std 2*sqrt(2)/3
    s = math.sqrt(2)
    expected = torch.tensor([[-1 / s, -1 / s, 0.0], [s, 0.0, 0.0]], dtype=F64)
    torch.testing.assert_close(masked_whiten(x, mask), expected, rtol=0, atol=1e-12)


def test_whiten_of_empty_mask_is_zero():
    x = torch.randn(2, 3, dtype=F64)
    assert masked_whiten(x, torch.zeros(2, 3)).abs().sum() == 0


def test_sanitized_log_ratio_drops_nonfinite_and_clamps():
    logp = torch.tensor([[0.0, math.nan, -math.inf, 50.0, 1.0]], dtype=F64)
    old = torch.tensor([[-1.0, 0.0, 0.0, 0.0, math.nan]], dtype=F64)
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    diff, valid = sanitized_log_ratio(logp, old, mask)
    assert diff.tolist() == [[1.0, 0.0, 0.0, 30.0, 0.0]]
    assert valid.tolist() == [[True, False, False, True, False]]
