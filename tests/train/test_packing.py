"""Packing: every token placed once, no cross-sample targets, budgets respected, shared prompts."""

import pytest
import torch

from molt.train.packing import IGNORE, first_fit_rows, pack, shared_prefix_len


def sample_index(batch):
    """The samples (their own, unshared pieces) of each row, in row order."""
    return [[p.sample for p in row if not p.shared] for row in batch.rows]


def test_first_fit_rows_places_every_sample_within_row_len():
    lengths = [5, 9, 3, 7, 1, 10, 2]
    rows = first_fit_rows(lengths, row_len=10)
    assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in row) <= 10 for row in rows)
    assert len(rows) == 4  # 37 tokens need >= 4 rows of 10


def test_too_long_sample_is_an_error():
    with pytest.raises(ValueError, match="sample 1 has 12 tokens"):
        first_fit_rows([3, 12], row_len=10)


def test_targets_stay_inside_their_sample():
    samples = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    masks = [[0, 1, 1], [0, 1], [0, 0, 1, 1]]
    (batch,) = pack(samples, masks, row_len=6, micro_batch_tokens=12)
    for r, row in enumerate(sample_index(batch)):
        start = 0
        for i in row:
            n = len(samples[i])
            assert batch.input_ids[r, start : start + n].tolist() == samples[i]
            assert batch.position_ids[r, start : start + n].tolist() == list(range(n))
            assert batch.targets[r, start : start + n - 1].tolist() == samples[i][1:]
            assert batch.targets[r, start + n - 1] == IGNORE  # never predicts the next sample
            assert batch.loss_mask[r, start : start + n - 1].tolist() == [float(m) for m in masks[i][1:]]
            start += n
    assert batch.num_tokens == 9
    assert float(batch.loss_mask.sum()) == 5  # the masked-in tokens 2,3,5,8,9


def test_micro_batches_respect_token_budget():
    samples = [[1] * n for n in (30, 20, 25, 10, 5, 31, 16)]
    batches = pack(samples, [[1] * len(s) for s in samples], row_len=32, micro_batch_tokens=64)
    assert all(b.input_ids.numel() <= 64 for b in batches)
    assert sum(b.num_tokens for b in batches) == sum(map(len, samples))
    for b in batches:  # padding is never a target and never in the loss
        pad = b.doc_ids < 0
        assert (b.targets[pad] == IGNORE).all() and (b.loss_mask[pad] == 0).all()


def test_shared_prefix_stops_at_the_first_trained_token_and_at_divergence():
    assert shared_prefix_len([[1, 2, 3, 4, 5], [1, 2, 3, 4, 6]], [[0, 0, 0, 1, 1], [0, 0, 0, 0, 1]]) == 3
    assert shared_prefix_len([[1, 2, 9, 4], [1, 2, 3, 4]], [[0, 0, 0, 1], [0, 0, 0, 1]]) == 2
    assert shared_prefix_len([[1, 2, 3], [1, 2, 3, 4]], [[0, 0, 0], [0, 0, 0, 1]]) == 2  # each keeps a token


def test_group_shares_its_prompt_once_and_tails_see_it():
    prompt = [7, 8, 9, 10, 11, 12]
    samples = [prompt + [1, 2], prompt + [3], prompt + [4, 5, 6], [20, 21, 22]]
    masks = [[0] * 6 + [1] * (len(s) - 6) for s in samples[:3]] + [[0, 1, 1]]
    (batch,) = pack(samples, masks, row_len=32, micro_batch_tokens=64, groups=[0, 0, 0, None])
    assert batch.num_tokens == 6 + 2 + 1 + 3 + 3  # the prompt once, then each sample's answer
    assert tuple(batch.input_ids.shape) == (2, 12)  # rows as wide as the longest unit (the group), not 32
    shared = [(r, p) for r, row in enumerate(batch.rows) for p in row if p.shared]
    assert len(shared) == 1 and (shared[0][1].start, shared[0][1].end) == (0, 6)
    assert sorted(i for row in sample_index(batch) for i in row) == [0, 1, 2, 3]
    # each answer's first token is predicted at the prompt's last position: one fork per sample
    r, last = shared[0][0], shared[0][0] * 12 + 5
    assert batch.forks.tolist() == [[last, 1], [last, 3], [last, 4]] and batch.input_ids[r, 5] == 12
    assert float(batch.loss_mask.sum()) + len(batch.forks) == sum(sum(m[1:]) for m in masks)
    tails = batch.position_ids[batch.parent_ids != batch.doc_ids]
    assert tails.min() == 6  # tail positions continue after the prefix


def test_samples_with_images_are_never_shared():
    samples = [[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 5, 6, 8]]
    masks = [[0] * 6 + [1]] * 2
    images = [[torch.zeros(3, 2, 2, dtype=torch.uint8)], []]
    (batch,) = pack(samples, masks, row_len=32, micro_batch_tokens=64, images=images, groups=[0, 0])
    assert batch.num_tokens == 14 and batch.parent_ids is None and batch.pixel_values.shape[0] == 1
