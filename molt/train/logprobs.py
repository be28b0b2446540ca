"""Per-token log-probs and entropies of packed rows, with the LM head applied in chunks of tokens.

The model returns final hidden states; the head, the fp32 log-softmax and the entropy run over `chunk_tokens`
rows at a time (at most `MAX_CHUNK_ELEMENTS` logits), a large chunk under activation checkpointing, so neither
forward nor backward ever holds the whole [T, V] fp32 logits. Log-probs are computed exactly as the engines
compute theirs: `logits.float() / temperature`, log-softmax. `molt.train.compile.compile_model` gives the head
a compiled chunk function (the matmul's logits, then fused fp32 reductions)."""

from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import checkpoint

from molt.models import Transformer
from molt.train.packing import PackedBatch

DEFAULT_CHUNK_TOKENS = 4096
REMAT_MIN = 1 << 24  # logits elements of a chunk (64 MB in fp32) above which backward recomputes them
MAX_CHUNK_ELEMENTS = 1 << 27  # logits elements of a chunk at most (512 MB in fp32)


def head_logprobs(
    head: torch.nn.Module, hidden_nh: torch.Tensor, targets_n: torch.Tensor, temperature: float, chunk_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(target), entropy), both fp32 [N], of `head(hidden_nh) / temperature`, `chunk_tokens` rows at a time."""
    if hidden_nh.shape[0] == 0:
        empty = hidden_nh.new_zeros(0, dtype=torch.float32)
        return empty, empty
    vocab = head.weight.shape[0]
    chunk_tokens = max(1, min(chunk_tokens, MAX_CHUNK_ELEMENTS // vocab))
    logits_per_chunk = min(chunk_tokens, len(hidden_nh)) * vocab
    remat = torch.is_grad_enabled() and hidden_nh.requires_grad and logits_per_chunk > REMAT_MIN
    chunk_fn = getattr(head, "_molt_chunk_fn", head_chunk)  # compiled by `compile_model`
    chunks = zip(hidden_nh.split(chunk_tokens), targets_n.split(chunk_tokens), strict=True)
    logp_n, entropy_n = zip(*(chunk_fn(head, h_ch, t_ch, temperature, remat) for h_ch, t_ch in chunks), strict=True)
    return torch.cat(logp_n), torch.cat(entropy_n)


def head_chunk(
    head: torch.nn.Module, hidden_ch: torch.Tensor, targets_c: torch.Tensor, temperature: float, remat: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(target), entropy) of one chunk; `remat`: its logits are recomputed in backward, not kept."""
    if remat:
        return checkpoint(head_chunk, head, hidden_ch, targets_c, temperature, False, use_reentrant=False)
    logits_cv = head(hidden_ch).float()
    if temperature != 1.0:  # dividing by 1 is exact: skip the copy
        logits_cv = logits_cv / temperature
    logz_c = torch.logsumexp(logits_cv, dim=-1)
    logp_c = logits_cv.gather(1, targets_c[:, None])[:, 0] - logz_c
    entropy_c = logz_c - (torch.softmax(logits_cv, dim=-1) * logits_cv).sum(-1)
    return logp_c, entropy_c


def token_logprobs(
    model: Transformer,
    packed: PackedBatch,
    temperature: float,
    routing=None,
    trained_only: bool = False,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> torch.Tensor:
    """log p(target) at every packed position [R, W]; see `token_logprobs_entropy`."""
    return token_logprobs_entropy(model, packed, temperature, routing, trained_only, chunk_tokens)[0]


def token_logprobs_entropy(
    model: Transformer,
    packed: PackedBatch,
    temperature: float,
    routing=None,
    trained_only: bool = False,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(target), entropy) at every packed position [R, W], under logits / temperature (fp32).

    With shared prefixes (`packed.forks`), the flat [R * W + E] vectors of those, then each fork's values.
    `trained_only` (dense models): the last layer computes only the positions whose target is trained or
    that hold a fork (`Transformer.forward`'s `outputs_bq`); every other position's values are 0.
    `routing`: MoE replay / record (see `molt.models.moe.Routing`)."""
    hidden_nh, at_n, targets_n = packed_hidden(model, packed, routing, trained_only)
    logp, entropy = head_logprobs(model.lm_head, hidden_nh, targets_n, temperature, chunk_tokens)
    return laid_out_rows(logp, at_n, packed, trained_only), laid_out_rows(entropy, at_n, packed, trained_only)


def packed_hidden(
    model: Transformer, packed: PackedBatch, routing=None, trained_only: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(final hidden states [N, H], their flat positions `at_n`, targets [N]) of the positions computed, then
    one row per fork (`packed.forks`). Whatever head reads them (LM head, value head) lays its per-row outputs
    out with `laid_out_rows`."""
    kwargs = dict(doc_ids_bt=packed.doc_ids, parent_ids_bt=packed.parent_ids, pixel_values=packed.pixel_values)
    forward = functools.partial(model, packed.input_ids, packed.position_ids, return_hidden=True, **kwargs)
    if not trained_only:
        hidden_nh = forward(routing=routing).flatten(0, 1)
        at_n = torch.arange(packed.targets.numel(), device=hidden_nh.device)
    else:
        cols_bq, valid_bq = trained_columns(packed)
        hidden_nh = forward(outputs_bq=cols_bq)
        at_n = torch.arange(cols_bq.shape[0], device=cols_bq.device)[:, None] * packed.targets.shape[1] + cols_bq
        hidden_nh, at_n = hidden_nh[valid_bq], at_n[valid_bq]
    targets_n = packed.targets.flatten()[at_n].clamp(min=0)
    if packed.forks is not None:  # a fork's row among the computed outputs (`at_n` is increasing)
        fork_at, fork_targets = packed.forks.T.contiguous()
        fork_n = torch.searchsorted(at_n, fork_at)
        hidden_nh, targets_n = torch.cat([hidden_nh, hidden_nh[fork_n]]), torch.cat([targets_n, fork_targets])
    return hidden_nh, at_n, targets_n


def laid_out_rows(values: torch.Tensor, at_n: torch.Tensor, packed: PackedBatch, trained_only: bool) -> torch.Tensor:
    """Per-row outputs of `packed_hidden`'s rows as [R, W] (with forks: the flat [R * W + E] vector, forks last);
    with `trained_only` the positions not computed hold 0."""
    pos, forks = values[: len(at_n)], values[len(at_n) :]  # one row per computed position, then the forks'
    if trained_only:
        pos = pos.new_zeros(packed.targets.numel()).index_put((at_n,), pos)
    return pos.view(packed.targets.shape) if packed.forks is None else torch.cat([pos, forks])


def trained_columns(packed: PackedBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the columns whose target is trained or that predict a fork ([B, Q], padded by repeating
    the row's first such column) and which entries are real ([B, Q] bool)."""
    need_bt = packed.loss_mask > 0
    if packed.forks is not None:
        need_bt.view(-1)[packed.forks[:, 0]] = True
    counts_b = need_bt.sum(1)
    width = max(int(counts_b.max()), 1)
    cols_bq = torch.argsort((~need_bt).to(torch.uint8), dim=1, stable=True)[:, :width]
    valid_bq = torch.arange(width, device=cols_bq.device) < counts_b[:, None]
    return torch.where(valid_bq, cols_bq, cols_bq[:, :1]), valid_bq
