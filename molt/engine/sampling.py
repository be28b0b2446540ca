"""Batched token sampling from logits: greedy, temperature, top-k, top-p, bans; with log-probs.

One call samples every row of a step with a handful of tensor ops, whatever mix of per-row parameters. The uniform
number that picks a row's token is a hash of (the sample's seed, the token's position), then inverse-CDF sampling: a
seeded request gives the same tokens whichever requests share its batch, and no per-request generator state exists.
Log-probs (`SamplingParams`: "scaled" or "processed") are computed in fp32 from the logits, as the trainer does, with
one device -> host copy per call. Knows nothing of models, caches or requests."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from molt.engine.transfer import to_device

MASK64 = (1 << 64) - 1


def splitmix64(x: int | np.ndarray) -> int | np.ndarray:
    """A 64-bit integer mix (SplitMix64 finaliser) of an int or a numpy uint64 array (its arithmetic wraps as
    `MASK64` does): well-spread bits from consecutive inputs."""
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def sample_seed(request_seed: int, sample_index: int) -> int:
    """The seed of sample `sample_index` of a request seeded with `request_seed`."""
    return splitmix64((request_seed & MASK64) ^ splitmix64(sample_index + 1))


def uniform(seed: int, position: int) -> float:
    """A uniform number in [0, 1) with 53 bits (a float64's precision), fixed by (seed, position)."""
    return (splitmix64(seed ^ splitmix64(position)) >> 11) / float(1 << 53)


def uniforms(seeds: Sequence[int], positions: Sequence[int]) -> Sequence[float]:
    """`uniform` of each (seed, position) pair; from a few dozen pairs on, at once in numpy."""
    if len(seeds) < 32:
        return [uniform(s, p) for s, p in zip(seeds, positions, strict=True)]
    x = splitmix64(np.array(seeds, dtype=np.uint64) ^ splitmix64(np.array(positions, dtype=np.uint64)))
    return (x >> 11).astype(np.float64) / float(1 << 53)


@dataclass
class RowParams:
    """Per-row sampling parameters of one batch (lists, one entry per logits row)."""

    temperature: list[float]
    top_p: list[float]
    top_k: list[int]  # 0: off
    seed: list[int]
    position: list[int]  # index of the token being sampled in its sequence
    processed: list[bool]  # report the "processed" log-prob instead of the "scaled" one
    banned: list[tuple[int, Sequence[int]]]  # (row, token ids) not allowed this step (min_tokens)


def _filtered(scaled_rv: torch.Tensor, top_p_r: torch.Tensor, top_k_r: torch.Tensor) -> torch.Tensor:
    """The logits with those outside top-k then top-p (smallest set with mass >= p) at -inf, per row; in
    vocabulary order, as unfiltered rows, so a row's token never depends on whether its batch filters."""
    vocab = scaled_rv.shape[-1]
    sorted_rv, order_rv = scaled_rv.sort(dim=-1, descending=True)
    rank_v = torch.arange(vocab, device=scaled_rv.device)
    keep_rv = rank_v[None, :] < torch.where(top_k_r > 0, top_k_r, vocab)[:, None]
    probs_rv = torch.softmax(sorted_rv.masked_fill(~keep_rv, float("-inf")), dim=-1)
    mass_before_rv = probs_rv.cumsum(dim=-1) - probs_rv
    keep_rv &= (mass_before_rv < top_p_r[:, None]) | (top_p_r[:, None] >= 1.0)
    keep_rv[:, 0] = True
    return scaled_rv.masked_fill(~torch.empty_like(keep_rv).scatter_(1, order_rv, keep_rv), float("-inf"))


def _inverse_cdf(logp_rv: torch.Tensor, u_r: torch.Tensor) -> torch.Tensor:
    """Index j per row with cdf[j-1] <= u * total < cdf[j] (never a zero-probability entry)."""
    cdf_rv = logp_rv.exp().double().cumsum(dim=-1)
    target_r1 = (u_r * cdf_rv[:, -1]).unsqueeze(-1)
    return torch.searchsorted(cdf_rv, target_r1, right=True).clamp(max=logp_rv.shape[-1] - 1).squeeze(-1)


TopLogprobs = list[tuple[int, float]]  # (token id, log-prob) of one row's most likely tokens, best first


def sample(logits_rv: torch.Tensor, params: RowParams) -> tuple[list[int], list[float]]:
    """(token id, log-prob) per row of `logits_rv` [R, V] (any float dtype), computed in fp32 on its device; the
    only device -> host copy is the final one."""
    token_r, logprob_r, _ = _sample_on_device(logits_rv, params)
    # one device -> host transfer per step: ids (< 2**53) travel exactly as float64 beside the log-probs
    token_f64, logprob_f64 = torch.stack((token_r.double(), logprob_r.double())).tolist()
    return [int(t) for t in token_f64], logprob_f64


def sample_top(
    logits_rv: torch.Tensor, params: RowParams, top_logprobs: int
) -> tuple[list[int], list[float], list[TopLogprobs]]:
    """`sample`, plus per row the `top_logprobs` most likely tokens under log_softmax(logits / T) (the
    "scaled" distribution: temperature applied, no top-k / top-p / bans), best first; still one copy."""
    token_r, logprob_r, logp_rv = _sample_on_device(logits_rv, params)
    k = min(top_logprobs, logp_rv.shape[-1])
    top_lp_rk, top_id_rk = logp_rv.topk(k, dim=-1)  # exact fp32 values: a greedy row's first is its log-prob
    cols = (token_r.double()[:, None], logprob_r.double()[:, None], top_id_rk.double(), top_lp_rk.double())
    rows = torch.cat(cols, dim=1).tolist()
    tops = [[(int(i), lp) for i, lp in zip(row[2 : 2 + k], row[2 + k :], strict=True)] for row in rows]
    return [int(row[0]) for row in rows], [row[1] for row in rows], tops


def _sample_on_device(logits_rv: torch.Tensor, params: RowParams):
    """(token ids [R], reported log-probs [R], scaled log-softmax [R, V]), all on the logits' device."""
    device = logits_rv.device
    logits_rv = logits_rv.float()
    temp_r = to_device([t if t != 0 else 1.0 for t in params.temperature], torch.float32, device)  # T = 0 -> 1
    scaled_rv = logits_rv / temp_r[:, None]
    masked_rv, logp_rv = scaled_rv, None
    if params.banned:
        rows = [row for row, ids in params.banned for _ in ids]
        cols = [int(i) for _, ids in params.banned for i in ids]
        masked_rv = scaled_rv.index_put(
            (to_device(rows, torch.long, device), to_device(cols, torch.long, device)),
            scaled_rv.new_full((), float("-inf")),
        )
    if all(t == 0 for t in params.temperature):
        token_r = masked_rv.argmax(dim=-1)
        processed_lp_r = torch.zeros_like(temp_r)
    else:
        u_r = to_device(uniforms(params.seed, params.position), torch.float64, device)
        filtered = any(p < 1 or k > 0 for p, k in zip(params.top_p, params.top_k, strict=True))
        if filtered:
            top_p_r = to_device(params.top_p, torch.float32, device)
            masked_rv = _filtered(masked_rv, top_p_r, to_device(params.top_k, torch.long, device))
        processed_rv = torch.log_softmax(masked_rv, dim=-1)
        token_r = _inverse_cdf(processed_rv, u_r)
        processed_lp_r = processed_rv.gather(1, token_r[:, None]).squeeze(1)
        logp_rv = None if filtered else processed_rv
        if any(t == 0 for t in params.temperature):
            greedy_r = to_device([t == 0 for t in params.temperature], torch.bool, device)
            token_r = torch.where(greedy_r, masked_rv.argmax(dim=-1), token_r)
            processed_lp_r = torch.where(greedy_r, 0.0, processed_lp_r)
    if logp_rv is None or params.banned:  # else the distribution sampled from is the scaled one: reuse it
        logp_rv = torch.log_softmax(scaled_rv, dim=-1)
    scaled_lp_r = logp_rv.gather(1, token_r[:, None]).squeeze(1)
    if any(params.processed):
        use_r = to_device(params.processed, torch.bool, device)
        scaled_lp_r = torch.where(use_r, processed_lp_r, scaled_lp_r)
    return token_r, scaled_lp_r, logp_rv
