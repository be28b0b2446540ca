"""Packing variable-length samples into dense rows for the trainer's forward (little padding).

Samples are placed first-fit decreasing into rows as wide as the longest of them (at most `row_len`), rows are
grouped into micro-batches of at most `micro_batch_tokens`. Each packed batch carries per-sample positions and
doc ids so attention never crosses samples, and shifted targets with the loss mask of the *predicted* token.

Prefix sharing (`groups`): the common prompt of a group's samples is laid out once, up to the first token any
of them trains on; each sample keeps its own tail (a `Piece` from the prefix length on, positions continuing)
whose tokens also see the prefix (`parent_ids`). The prefix's last position predicts each tail's first token:
those targets are listed as `forks` (position, target). Every log-prob and gradient equals the unshared layout's."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

IGNORE = -100
MIN_SHARED = 4  # shorter common prefixes are not worth a wider attention mask


@dataclass(frozen=True)
class Piece:
    """Tokens [start, end) of sample `sample`; a `shared` piece is the prefix the next pieces of its unit see."""

    sample: int
    start: int
    end: int
    shared: bool = False

    def __len__(self) -> int:
        return self.end - self.start


@dataclass
class PackedBatch:
    """One micro-batch: [B, T] tensors; `rows` says which pieces of which samples sit where."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    doc_ids: torch.Tensor
    targets: torch.Tensor
    loss_mask: torch.Tensor
    rows: list[list[Piece]] = field(default_factory=list)
    routing: torch.Tensor | None = None  # MoE: [B, T, layers, k] recorded expert ids, -1 = route live
    pixel_values: torch.Tensor | None = None  # uint8 [N, 3, S, S]: the batch's images in placeholder order
    parent_ids: torch.Tensor | None = None  # [B, T] doc id of the shared prefix a token also sees (own id: none)
    forks: torch.Tensor | None = None  # [E, 2] (flat B*T position, target): each tail's first token, predicted
    # at its shared prefix's last position

    @property
    def num_tokens(self) -> int:
        return int((self.doc_ids >= 0).sum())

    def to(self, device: torch.device | str) -> PackedBatch:
        move = {k: v.to(device) for k, v in vars(self).items() if isinstance(v, torch.Tensor)}
        return PackedBatch(**move, rows=self.rows)  # (pixel_values, parent_ids move too when present)


def first_fit_rows(lengths: list[int], row_len: int) -> list[list[int]]:
    """Indices of samples per row, first-fit decreasing; a sample longer than `row_len` is an error."""
    rows, free = [], []  # indices per row, room left per row
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if lengths[i] > row_len:
            raise ValueError(f"sample {i} has {lengths[i]} tokens, more than the row length {row_len}")
        slot = next((r for r, room in enumerate(free) if room >= lengths[i]), len(rows))
        if slot == len(rows):
            rows.append([])
            free.append(row_len)
        rows[slot].append(i)
        free[slot] -= lengths[i]
    return rows


def shared_prefix_len(samples: list[list[int]], masks: list[list[int]]) -> int:
    """Tokens [0, S) every sample has in common, none of them trained on (mask 0 on tokens 1..S-1)."""
    limit = min(len(s) for s in samples) - 1  # every sample keeps at least one token of its own
    limit = min([limit] + [next((t for t in range(1, len(m)) if m[t]), len(m)) for m in masks])
    return next((n for n in range(limit) if any(s[n] != samples[0][n] for s in samples)), limit)


def share_units(samples, masks, groups, row_len: int) -> list[list[Piece]]:
    """Units to pack: a group's shared prefix followed by its samples' own pieces (as many as fit a row),
    or a whole sample. `groups[i]` is sample i's group key (None: never shared)."""
    by_group: dict = {}
    units: list[list[Piece]] = []
    for i, key in enumerate(groups if groups is not None else [None] * len(samples)):
        if key is None:
            units.append([Piece(i, 0, len(samples[i]))])
        else:
            by_group.setdefault(key, []).append(i)
    for members in by_group.values():
        shared = shared_prefix_len([samples[i] for i in members], [masks[i] for i in members])
        if shared < MIN_SHARED or len(members) < 2:
            units += [[Piece(i, 0, len(samples[i]))] for i in members]
            continue
        unit: list[Piece] = []
        for i in members:
            own = Piece(i, shared, len(samples[i]))
            if not unit or sum(map(len, unit)) + len(own) > row_len:
                units += [_closed(unit, samples)] if unit else []
                unit = [Piece(i, 0, shared, shared=True)]
            unit.append(own)
        units.append(_closed(unit, samples))
    return units


def _closed(unit: list[Piece], samples) -> list[Piece]:
    """A finished unit; one that holds a single sample is that sample, unshared."""
    i = unit[1].sample
    return unit if len(unit) > 2 else [Piece(i, 0, len(samples[i]))]


def placements(rows: list[list[Piece]]) -> list[tuple[int, int, Piece]]:
    """(row, column of its first token, piece) of every piece of `rows`."""
    return [(r, sum(map(len, row[:k])), p) for r, row in enumerate(rows) for k, p in enumerate(row)]


def collate(samples: list[list[int]], masks: list[list[int]], rows: list[list[Piece]], images=None) -> PackedBatch:
    """Tensors for `rows` (lists of pieces); the target at t is token t+1 of the same sample.

    `images` (VLMs, unshared samples only): per sample, its pixel tensors in placeholder order.
    Built as flat Python lists (one tensor each at the end: this runs every trainer step)."""
    width = max(sum(map(len, row)) for row in rows)
    size = len(rows) * width
    ids_f, pos_f, targets_f, mask_f = [0] * size, [0] * size, [IGNORE] * size, [0.0] * size
    doc_f, parent_f = [0] * size, [0] * size
    forks, fork_at = [], -1
    for r, row in enumerate(rows):
        at, prefix_doc = r * width, -1
        for doc, p in enumerate(row):
            ids, n = samples[p.sample], len(p)
            ids_f[at : at + n], pos_f[at : at + n] = ids[p.start : p.end], range(p.start, p.end)
            prefix_doc = doc if p.shared else prefix_doc if p.start else doc
            doc_f[at : at + n], parent_f[at : at + n] = [doc] * n, [prefix_doc] * n
            if p.shared:
                fork_at = at + n - 1
            else:
                forks += [(fork_at, ids[p.start])] if p.start else []
                targets_f[at : at + n - 1] = ids[p.start + 1 : p.end]
                mask_f[at : at + n - 1] = masks[p.sample][p.start + 1 : p.end]
            at += n
        pad = range(-1, -1 - (r * width + width - at), -1)  # padding: each token alone
        doc_f[at : r * width + width] = parent_f[at : r * width + width] = pad
    shape = (len(rows), width)
    doc_ids = torch.tensor(doc_f).view(shape)
    pixels = [im for row in rows for p in row for im in images[p.sample]] if images else []
    sharing = any(p.shared for row in rows for p in row)
    return PackedBatch(torch.tensor(ids_f).view(shape), torch.tensor(pos_f).view(shape), doc_ids,
                       torch.tensor(targets_f).view(shape), torch.tensor(mask_f, dtype=torch.float32).view(shape), rows,
                       pixel_values=torch.stack(pixels) if pixels else None,
                       parent_ids=torch.tensor(parent_f).view(shape) if sharing else None,
                       forks=torch.tensor(forks, dtype=torch.long) if forks else None)  # fmt: skip


def collate_routing(routings: list, rows: list[list[Piece]], width: int, shape_lk) -> torch.Tensor:
    """[R, width, L, k] recorded expert ids laid out like `collate`'s rows; -1 where a sample has none (a record may
    stop short of its sample's last tokens: an episode's closing observation was never forwarded by the engine)."""
    out = torch.full((len(rows), width, *shape_lk), -1, dtype=torch.int16)
    for r, offset, p in placements(rows):
        if routings[p.sample] is not None:
            recorded = routings[p.sample][p.start : p.end]
            out[r, offset : offset + len(recorded)] = recorded
    return out


def pack(
    samples: list[list[int]],
    masks: list[list[int]],
    row_len: int,
    micro_batch_tokens: int,
    images=None,
    groups: list | None = None,
) -> list[PackedBatch]:
    """All samples packed into micro-batches of at most `micro_batch_tokens` tokens (`images`: see `collate`;
    `groups`: per sample a key whose samples may share their common prefix, None = never)."""
    for i, s in enumerate(samples):
        if len(s) > row_len:
            raise ValueError(f"sample {i} has {len(s)} tokens, more than the row length {row_len}")
    if groups is not None and images:  # a sample's images stay with its whole, unshared token span
        groups = [None if images[i] else key for i, key in enumerate(groups)]
    units = share_units(samples, masks, groups, row_len)
    lengths = [sum(map(len, u)) for u in units]
    width = max(lengths, default=1)  # rows no wider than the longest unit: less padding, smaller attention
    rows = [[p for u in row for p in units[u]] for row in first_fit_rows(lengths, width)]
    per_batch = max(1, micro_batch_tokens // width)
    return [collate(samples, masks, rows[i : i + per_batch], images) for i in range(0, len(rows), per_batch)]
