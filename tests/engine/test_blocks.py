"""Paged KV-cache bookkeeping without a model: allocation, prefix sharing, refcounts, eviction, fork, preemption,
sizing, a randomized run whose simulated KV must always read back as each sequence's own prefix, and the
per-slot block-table rows graphed decode reads (`PagedSlots.tables_sm`) under random operations."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from molt.engine.blocks import (
    BlockCopy,
    BlockManager,
    OutOfBlocks,
    block_digest,
    bytes_per_block,
    kv_budget_bytes,
    num_blocks_for_budget,
)
from molt.engine.paged import PagedSlots


class FakeKV:
    """The runner's physical blocks, simulated: the 'KV' at a position is the whole prefix it was computed from,
    so a block shared or reused for the wrong prefix reads back wrong."""

    def __init__(self, mgr: BlockManager):
        self.mgr = mgr
        self.blocks = [[None] * mgr.block_size for _ in range(mgr.num_blocks)]

    def compute(self, seq: int, end: int | None = None) -> None:
        """Write positions [num_computed, end) of `seq` (default: all its tokens) and record them."""
        tokens = self.mgr.token_ids(seq)
        end = len(tokens) if end is None else end
        for pos in range(self.mgr.num_computed(seq), end):
            block, offset = self.mgr.slot(seq, pos)
            assert self.mgr.ref_count(block) == 1, f"position {pos} of {seq} is written into a shared block"
            self.blocks[block][offset] = tuple(tokens[: pos + 1])
        self.mgr.set_computed(seq, end)

    def apply(self, copies: list[BlockCopy] | None = None) -> None:
        for c in self.mgr.take_copies() if copies is None else copies:
            self.blocks[c.dst][: c.length] = self.blocks[c.src][: c.length]

    def check(self, seq: int) -> None:
        tokens = self.mgr.token_ids(seq)
        for pos in range(self.mgr.num_computed(seq)):
            block, offset = self.mgr.slot(seq, pos)
            assert self.blocks[block][offset] == tuple(tokens[: pos + 1]), (seq, pos)


def test_allocate_lays_positions_out_block_by_block():
    mgr = BlockManager(8, block_size=4)
    assert mgr.allocate(0, list(range(10))) == 0
    assert mgr.block_table(0) == [0, 1, 2] and mgr.num_free_blocks() == 5
    assert mgr.slot(0, 9) == (2, 1)
    assert mgr.extend(0, list(range(11))) == 0 and mgr.slot(0, 10) == (2, 2)
    assert mgr.extend(0, list(range(12))) == 0 and mgr.slot(0, 11) == (2, 3)
    assert mgr.extend(0, list(range(13))) == 1 and mgr.slot(0, 12) == (3, 0)  # a new block only when the last is full
    assert mgr.num_tokens(0) == 13 and mgr.num_free_blocks() == 4
    with pytest.raises(ValueError, match="already has blocks"):
        mgr.allocate(0, [1])
    with pytest.raises(ValueError, match="at least one"):
        mgr.allocate(1, [])
    mgr.check()


def test_prefix_blocks_are_shared_by_reference_once_computed():
    mgr = BlockManager(16, block_size=4)
    kv = FakeKV(mgr)
    prompt = list(range(100, 111))  # 2 full blocks + 3 tokens
    assert mgr.allocate(0, prompt) == 0
    assert mgr.allocate(1, prompt) == 0  # nothing computed yet: no hit on blocks without KV
    kv.compute(0)
    assert mgr.allocate(2, prompt + [7, 8]) == 8  # both full blocks hit
    assert mgr.block_table(2)[:2] == mgr.block_table(0)[:2]
    assert [mgr.ref_count(b) for b in mgr.block_table(0)] == [2, 2, 1]
    kv.compute(2)
    kv.check(2)
    mgr.check()


def test_hits_need_the_whole_prefix_and_leave_the_last_token_to_compute():
    mgr = BlockManager(16, block_size=4)
    kv = FakeKV(mgr)
    mgr.allocate(0, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    kv.compute(0)
    assert mgr.allocate(1, [0, 2, 3, 4, 5, 6, 7, 8, 9]) == 0  # same second block, other first: no hit
    assert mgr.allocate(2, [1, 2, 3, 4, 5, 6, 7, 8]) == 4  # its last token is in block 2: computed, not shared
    assert mgr.allocate(3, [1, 2, 3, 4]) == 0
    assert mgr.ref_count(mgr.block_table(0)[1]) == 1
    mgr.check()


def test_free_keeps_registered_blocks_cached_and_reuses_them():
    mgr = BlockManager(4, block_size=4)
    kv = FakeKV(mgr)
    mgr.allocate(0, list(range(10)))
    kv.compute(0)
    table = mgr.block_table(0)
    mgr.free(0)
    assert mgr.num_free_blocks() == 4 and mgr.num_cached_blocks() == 2  # the two full blocks
    assert mgr.allocate(1, list(range(9)) + [42]) == 8
    assert mgr.block_table(1)[:2] == table[:2] and mgr.num_cached_blocks() == 0
    kv.compute(1)
    kv.check(1)
    mgr.check()


def test_eviction_takes_the_least_recently_freed_cached_block_and_forgets_it():
    mgr = BlockManager(4, block_size=2)
    kv = FakeKV(mgr)
    for seq, first in enumerate((10, 20)):
        mgr.allocate(seq, [first, first + 1, first + 2])  # one full block + one partial
        kv.compute(seq)
    old, recent = mgr.block_table(0)[0], mgr.block_table(1)[0]
    mgr.free(0)
    mgr.free(1)
    assert mgr.num_cached_blocks() == 2 and mgr.num_free_blocks() == 4
    mgr.allocate(2, [1, 2, 3, 4, 5, 6, 7])  # 4 blocks: 2 free, then both cached ones, oldest first
    assert mgr.block_table(2)[2:] == [old, recent] and mgr.num_cached_blocks() == 0
    mgr.free(2)
    assert mgr.allocate(3, [10, 11, 12]) == 0  # evicted: no longer a hit
    mgr.check()


def test_eviction_drops_the_deepest_blocks_of_a_prefix_first():
    mgr = BlockManager(3, block_size=2)
    kv = FakeKV(mgr)
    mgr.allocate(0, [1, 2, 3, 4, 5])
    kv.compute(0)
    root = mgr.block_table(0)[0]
    mgr.free(0)  # 2 registered blocks cached, released last block first
    mgr.allocate(1, [9, 9, 9])  # needs 2 blocks: the free one + the deeper cached block
    assert root not in mgr.block_table(1)
    mgr.free(1)
    assert mgr.allocate(2, [1, 2, 3, 4, 5]) == 2  # the root survived and still hits
    mgr.check()


def test_fork_shares_full_blocks_and_copies_the_partial_one():
    mgr = BlockManager(8, block_size=4)
    kv = FakeKV(mgr)
    mgr.allocate(0, list(range(6)))
    kv.compute(0)
    mgr.fork(0, 1)
    src, dst = mgr.block_table(0), mgr.block_table(1)
    assert dst[0] == src[0] and dst[1] != src[1] and mgr.ref_count(src[0]) == 2
    copies = mgr.take_copies()
    assert copies == [BlockCopy(src[1], dst[1], 2)]
    kv.apply(copies)
    assert mgr.num_computed(1) == 6
    mgr.extend(0, [*mgr.token_ids(0), 100])
    mgr.extend(1, [*mgr.token_ids(1), 200])  # each sample appends into its own last block
    kv.compute(0)
    kv.compute(1)
    kv.check(0)
    kv.check(1)
    mgr.fork(0, 2, num_tokens=4)  # a whole-block prefix: nothing to copy
    assert mgr.take_copies() == [] and mgr.block_table(2) == src[:1]
    mgr.check()
    with pytest.raises(ValueError, match="cannot fork"):
        mgr.fork(0, 3, num_tokens=0)


def test_fork_before_compute_shares_nothing():
    mgr = BlockManager(8, block_size=2)
    kv = FakeKV(mgr)
    mgr.allocate(0, [1, 2, 3, 4, 5])
    kv.compute(0, 3)  # a chunked prefill, one block and a half computed
    mgr.fork(0, 1)
    assert mgr.block_table(1)[0] == mgr.block_table(0)[0] and set(mgr.block_table(1)[1:]).isdisjoint(mgr.block_table(0))
    copies = mgr.take_copies()
    assert copies == [BlockCopy(mgr.block_table(0)[1], mgr.block_table(1)[1], 1)]
    kv.apply(copies)
    kv.check(1)
    assert mgr.num_computed(1) == 3
    mgr.check()


def test_out_of_blocks_then_preempt_the_latest_and_recompute():
    mgr = BlockManager(4, block_size=2)
    kv = FakeKV(mgr)
    assert mgr.can_allocate(4) and not mgr.can_allocate(9)
    mgr.allocate(0, [1, 2, 3])
    mgr.allocate(1, [4, 5, 6])
    kv.compute(0)
    kv.compute(1)
    assert not mgr.can_allocate(1)
    with pytest.raises(OutOfBlocks):
        mgr.allocate(2, [7])
    mgr.check()  # a refused allocation changes nothing
    assert mgr.extend(0, [1, 2, 3, 9]) == 0 and mgr.slot(0, 3) == (1, 1)
    assert mgr.extend(0, [1, 2, 3, 9, 10]) is None  # needs a new block: none left
    assert mgr.num_tokens(0) == 4
    mgr.free(1)  # preempt the latest admitted: its blocks become available
    assert mgr.num_free_blocks() == 2
    assert mgr.extend(0, [1, 2, 3, 9, 10]) == 1 and mgr.slot(0, 4) == (mgr.block_table(0)[2], 0)
    kv.compute(0)
    kv.check(0)
    mgr.free(0)
    assert mgr.allocate(1, [4, 5, 6]) == 2  # the victim's computed full block was still cached
    mgr.check()


def test_clear_prefixes_and_disabled_prefix_cache():
    mgr = BlockManager(4, block_size=2)
    kv = FakeKV(mgr)
    mgr.allocate(0, [1, 2, 3])
    kv.compute(0)
    mgr.free(0)
    mgr.clear_prefixes()
    assert mgr.num_cached_blocks() == 0 and mgr.allocate(1, [1, 2, 3]) == 0
    mgr.free(1)
    mgr.allocate(2, [1, 2, 3, 4, 5])
    kv.compute(2, 1)
    mgr.clear_prefixes()  # new weights while 2 runs on its old KV: neither it nor its forks register blocks
    kv.compute(2)
    mgr.fork(2, 3)
    mgr.extend(3, [1, 2, 3, 4, 5, 6])
    kv.compute(3)
    mgr.check()
    mgr.free(2)
    mgr.free(3)
    assert mgr.num_cached_blocks() == 0 and mgr.allocate(4, [1, 2, 3, 4, 5, 6, 7]) == 0
    off = BlockManager(4, block_size=2, prefix_cache=False)
    off.allocate(0, [1, 2, 3])
    off.set_computed(0, 3)
    off.free(0)
    assert off.num_cached_blocks() == 0 and off.allocate(1, [1, 2, 3]) == 0
    with pytest.raises(ValueError, match="outside"):
        off.set_computed(1, 4)


def test_digest_chains_the_whole_prefix():
    a = block_digest(block_digest(b"", [1, 2]), [3, 4])
    assert a == block_digest(block_digest(b"", [1, 2]), [3, 4])
    assert a != block_digest(block_digest(b"", [2, 1]), [3, 4]) and a != block_digest(b"", [3, 4])


def test_sizing_from_a_memory_budget():
    # Qwen3-0.6B shape in bf16: 28 layers x 8 kv heads x 128 x 16 positions x 2 (k, v) x 2 bytes
    assert bytes_per_block(28, 8, 128, 2) == 1_835_008
    assert bytes_per_block(28, 8, 128, 4, block_size=32) == 4 * 1_835_008
    assert num_blocks_for_budget(10 * 1_835_008 + 5, 1_835_008) == 10
    assert kv_budget_bytes(100 * 2**30, 0.9) == int(90 * 2**30)
    with pytest.raises(ValueError, match="holds no block"):
        num_blocks_for_budget(100, 1_835_008)
    with pytest.raises(ValueError, match="memory_fraction"):
        kv_budget_bytes(2**30, 0.0)


OPS = st.lists(
    st.tuples(st.sampled_from(["add", "fork", "step", "free", "clear"]), st.integers(0, 2**16)),
    min_size=1,
    max_size=60,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, block_size=st.sampled_from([1, 2, 3, 4]), num_blocks=st.integers(1, 12))
def test_random_operations_keep_invariants_and_kv(ops, block_size, num_blocks):
    """Admit (prompts from a few shared stems), fork, compute in chunks, append, preempt when out of blocks,
    free, clear: after every operation the invariants hold and every sequence reads back its own prefix."""
    mgr = BlockManager(num_blocks, block_size)
    kv = FakeKV(mgr)
    stems = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 9, 9, 9], [5, 5, 5, 5, 5, 5, 5]]
    live, next_id = [], 0
    for op, r in ops:
        if op == "add":
            prompt = stems[r % 3][: 1 + r % 8] + [r % 5] * (r % 3)
            if mgr.can_allocate(len(prompt)):
                mgr.allocate(next_id, prompt)
                live.append(next_id)
                next_id += 1
        elif op == "fork" and live:
            src = live[r % len(live)]
            n = 1 + r % mgr.num_tokens(src)
            try:
                mgr.fork(src, next_id, n)
            except OutOfBlocks:
                assert mgr.num_free_blocks() < mgr.blocks_needed(n)
            else:
                kv.apply()
                live.append(next_id)
                next_id += 1
        elif op == "step" and live:
            seq = live[r % len(live)]
            if mgr.num_computed(seq) < mgr.num_tokens(seq):  # a prefill chunk
                kv.compute(seq, min(mgr.num_tokens(seq), mgr.num_computed(seq) + 1 + r % 5))
            else:  # decode; out of blocks: preempt the latest admitted until it fits or `seq` itself goes
                while mgr.extend(seq, [*mgr.token_ids(seq), r % 7]) is None:
                    victim = max(live)  # sequence ids grow with admission
                    mgr.free(victim)
                    live.remove(victim)
                    if victim == seq:
                        break
        elif op == "free" and live:
            mgr.free(live.pop(r % len(live)))
        elif op == "clear":
            mgr.clear_prefixes()
        mgr.check()
        for seq in live:
            kv.check(seq)
    for seq in live:
        mgr.free(seq)
    mgr.check()
    assert mgr.num_free_blocks() == num_blocks


SLOT_OPS = st.lists(
    st.tuples(
        st.sampled_from(["add", "sibling", "decode", "fork", "compute", "release", "free"]), st.integers(0, 2**16)
    ),
    min_size=1,
    max_size=60,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=SLOT_OPS, block_size=st.sampled_from([1, 2, 4]), num_blocks=st.integers(1, 12))
def test_slot_rows_mirror_the_block_tables(ops, block_size, num_blocks):
    """Admissions (with a prompt, or a sibling's bare slot), growth by one or more tokens (preempting the latest
    admitted when out of blocks), forks, computed positions, releases and frees: after each, every slot's row of
    `tables_sm` is its sequence's block table padded with `num_blocks` (all padding for a slot without blocks)."""
    max_blocks, num_slots = 5, 4
    slots = PagedSlots(BlockManager(num_blocks, block_size), num_slots, max_blocks)
    tokens: dict[int, list[int]] = {}  # sequences holding a slot -> their tokens, admission order
    max_len, next_id = max_blocks * block_size, 0
    for op, r in ops:
        live = list(tokens)
        if op in ("add", "sibling") and slots.num_free():
            prompt = [r % 3] * (1 + r % max_len)
            if op == "add" and not slots.blocks.can_allocate(len(prompt)):
                continue
            slots.allocate(next_id, prompt if op == "add" else ())
            tokens[next_id], next_id = prompt, next_id + 1
        elif op == "decode" and live:
            seq = live[r % len(live)]
            new = min(1 + r % 3, max_len - len(tokens[seq]))  # several at once, as after a shorter fork
            tokens[seq] += [r % 5] * new
            while slots.reserve(seq, tokens[seq]) is None:
                victim = live.pop()
                slots.free(victim)
                del tokens[victim]
                if victim == seq:
                    break
        elif op == "fork" and len(live) > 1 and slots.blocks.has(src := live[r % len(live)]):
            dst = live[(r // 7) % len(live)]
            if dst != src:
                length = 1 + r % len(tokens[src])
                slots.share(src, dst, length)
                tokens[dst] = tokens[src][:length]
        elif op == "compute" and live and slots.blocks.has(seq := live[r % len(live)]):
            done = slots.length_of(seq)
            slots.set_length(seq, done + r % (slots.blocks.num_tokens(seq) - done + 1))
        elif op == "release" and live:
            slots.release_blocks(live[r % len(live)])
        elif op == "free" and live:
            seq = live[r % len(live)]
            slots.free(seq)
            del tokens[seq]
        slots.blocks.check()
        held = {slots.slot_of(seq): seq for seq in tokens if slots.blocks.has(seq)}
        for slot in range(num_slots):
            table = slots.blocks.block_table(held[slot]) if slot in held else []
            assert slots.tables_sm[slot].tolist() == table + [num_blocks] * (max_blocks - len(table)), (slot, table)
