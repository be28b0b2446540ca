"""Packing variable-length samples into dense rows for the trainer's forward (no padding waste).

Samples are placed into rows of at most `row_len` tokens by first-fit decreasing; rows are grouped
into micro-batches of at most `micro_batch_tokens`. Each packed batch carries per-sample positions
and doc ids so attention never crosses samples, and shifted targets with the loss mask of the
*predicted* token. Plain Python + torch, no model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

IGNORE = -100


@dataclass
class PackedBatch:
    """One micro-batch: [B, T] tensors; `sample_index` maps (row, slot) back to input samples."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    doc_ids: torch.Tensor
    targets: torch.Tensor
    loss_mask: torch.Tensor
    sample_index: list[list[int]]
    routing: torch.Tensor | None = None  # MoE: [B, T, layers, k] recorded expert ids, -1 = route live
    pixel_values: torch.Tensor | None = None  # uint8 [N, 3, S, S]: the batch's images in placeholder order

    @property
    def num_tokens(self) -> int:
        return int((self.doc_ids >= 0).sum())

    def to(self, device: torch.device | str) -> PackedBatch:
        move = {k: v.to(device) for k, v in vars(self).items() if isinstance(v, torch.Tensor)}
        return PackedBatch(**move, sample_index=self.sample_index)  # (pixel_values moves too when present)


def first_fit_rows(lengths: list[int], row_len: int) -> list[list[int]]:
    """Indices of samples per row, first-fit decreasing; a sample longer than `row_len` is an error."""
    rows: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if lengths[i] > row_len:
            raise ValueError(f"sample {i} has {lengths[i]} tokens, more than the row length {row_len}")
        slot = next((r for r, room in enumerate(free) if room >= lengths[i]), None)
        if slot is None:
            rows.append([])
            free.append(row_len)
            slot = len(rows) - 1
        rows[slot].append(i)
        free[slot] -= lengths[i]
    return rows


def collate(samples: list[list[int]], masks: list[list[int]], rows: list[list[int]], images=None) -> PackedBatch:
    """Tensors for `rows` (lists of sample indices); target at t is token t+1 of the same sample.

    `images` (VLMs): per sample, its pixel tensors in placeholder order; stacked in packed order.
    """
    width = max(sum(len(samples[i]) for i in row) for row in rows)
    shape = (len(rows), width)
    input_ids = torch.zeros(shape, dtype=torch.long)
    position_ids = torch.zeros(shape, dtype=torch.long)
    doc_ids = torch.full(shape, -1, dtype=torch.long)
    targets = torch.full(shape, IGNORE, dtype=torch.long)
    loss_mask = torch.zeros(shape, dtype=torch.float32)
    for r, row in enumerate(rows):
        start = 0
        for doc, i in enumerate(row):
            ids, mask, n = samples[i], masks[i], len(samples[i])
            span = slice(start, start + n)
            input_ids[r, span] = torch.tensor(ids)
            position_ids[r, span] = torch.arange(n)
            doc_ids[r, span] = doc
            targets[r, start : start + n - 1] = torch.tensor(ids[1:])
            loss_mask[r, start : start + n - 1] = torch.tensor(mask[1:], dtype=torch.float32)
            start += n
        doc_ids[r, start:] = -1 - torch.arange(width - start)  # padding: each token alone
    pixels = [im for row in rows for i in row for im in images[i]] if images else []
    pixel_values = torch.stack(pixels) if pixels else None
    return PackedBatch(input_ids, position_ids, doc_ids, targets, loss_mask, rows, pixel_values=pixel_values)


def collate_routing(routings: list, lengths: list[int], rows: list[list[int]], width: int, shape_lk) -> torch.Tensor:
    """[R, width, L, k] recorded expert ids laid out like `collate`'s rows; -1 where a sample has none."""
    out = torch.full((len(rows), width, *shape_lk), -1, dtype=torch.int16)
    for r, row in enumerate(rows):
        start = 0
        for i in row:
            if routings[i] is not None:
                out[r, start : start + len(routings[i])] = routings[i]
            start += lengths[i]
    return out


def pack(
    samples: list[list[int]], masks: list[list[int]], row_len: int, micro_batch_tokens: int, images=None
) -> list[PackedBatch]:
    """All samples packed into micro-batches of at most `micro_batch_tokens` tokens (`images`: see `collate`)."""
    rows = first_fit_rows([len(s) for s in samples], row_len)
    per_batch = max(1, micro_batch_tokens // row_len)
    return [collate(samples, masks, rows[i : i + per_batch], images) for i in range(0, len(rows), per_batch)]
