"""The sampler alone: rows independent of their batch, the uniforms' precision, refused temperatures."""

import math

import pytest
import torch

from molt.engine.interface import MIN_TEMPERATURE, SamplingParams
from molt.engine.sampling import RowParams, sample, uniform, uniforms


def rows(n: int, top_p: float = 1.0, top_k: int = 0, position: int = 0) -> RowParams:
    return RowParams([1.0] * n, [top_p] * n, [top_k] * n, list(range(n)), [position] * n, [False] * n, [])


def test_a_seeded_row_samples_the_same_token_whatever_its_neighbours_filter():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    for position in range(32):
        alone = sample(logits[:1], rows(1, position=position))
        params = rows(3, position=position)
        params.top_p[1], params.top_k[2] = 0.9, 5
        tokens, logprobs = sample(logits, params)
        assert (tokens[0], logprobs[0]) == (alone[0][0], alone[1][0]), position
        assert tokens[2] in logits[2].topk(5).indices.tolist()


def test_uniforms_have_53_bits_in_both_paths():
    seeds, positions = list(range(40)), list(range(100, 140))  # 40 pairs: the numpy path
    us = list(uniforms(seeds, positions))
    assert us == [uniform(s, p) for s, p in zip(seeds, positions, strict=True)]
    assert all(0 <= u < 1 for u in us) and any((u * 2**24) % 1 for u in us)


@pytest.mark.parametrize("temperature", [math.nan, math.inf, 1e-40, MIN_TEMPERATURE / 2, -1.0])
def test_a_temperature_is_zero_or_a_finite_number_the_logits_survive(temperature):
    with pytest.raises(ValueError, match="temperature must be 0 .greedy. or a finite number >= 0.0001"):
        SamplingParams(temperature=temperature)
    logits = 30 * torch.randn(1, 50, generator=torch.Generator().manual_seed(1))  # the lowest one stays finite
    params = RowParams([SamplingParams(temperature=MIN_TEMPERATURE).temperature], [1.0], [0], [0], [0], [False], [])
    tokens, logprobs = sample(logits, params)
    assert tokens == [int(logits.argmax())] and math.isfinite(logprobs[0])
