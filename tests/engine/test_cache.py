"""Cache manager and scheduler bookkeeping, without a model: slots, moves, prefixes, capacity."""

import random

import pytest

from molt.engine.cache import SCRATCH, Move, SlotCacheManager
from molt.engine.interface import SamplingParams
from molt.engine.scheduler import Group, Scheduler


class FakeRows:
    """Simulates the runner's physical rows: each row is a list of tokens 'written' there."""

    def __init__(self, num_slots: int):
        self.rows = {s: [] for s in [*range(num_slots), SCRATCH]}

    def apply(self, moves: list[Move]) -> None:
        for m in moves:
            self.rows[m.dst] = list(self.rows[m.src][: m.length]) + self.rows[m.dst][m.length :]


def test_allocate_is_contiguous_and_free_compacts():
    mgr = SlotCacheManager(4, 16, prefix_cache=False)
    assert [mgr.allocate(i)[0] for i in range(4)] == [0, 1, 2, 3]
    assert mgr.allocate(99) is None  # full: the caller waits
    mgr.set_length(3, 7)
    mgr.free(1)
    assert mgr.slot_of(3) == 1 and mgr.num_active == 3
    assert mgr.take_moves() == [Move(3, 1, 7)]
    mgr.check()
    assert mgr.allocate(4) == (3, 0)
    with pytest.raises(ValueError, match="already holds"):
        mgr.allocate(4)


def test_without_compaction_a_sequence_keeps_its_slot_and_nothing_moves():
    mgr = SlotCacheManager(4, 16, compact=False)
    assert [mgr.allocate(i, [7, i, 1])[0] for i in range(4)] == [0, 1, 2, 3]
    mgr.set_length(1, 3)
    mgr.free(1, [7, 1, 1, 5])  # slot 1 keeps [7, 1, 1] as a cached prefix, in place
    mgr.free(2)
    assert mgr.num_active == 2 and mgr.slot_of(3) == 3
    assert mgr.allocate(4, [9, 9]) == (2, 0)  # the lowest empty slot, not the cached one
    assert mgr.allocate(5, [7, 1, 1, 8]) == (1, 3)  # the cached prefix, reused where it is
    mgr.check()
    mgr.free(0, None)
    mgr.set_length(4, 2)
    mgr.free(4, [9, 9, 4])
    mgr.set_length(3, 3)
    mgr.free(3, [7, 3, 1])
    assert mgr.allocate(6, [5, 5]) == (0, 0)
    assert mgr.allocate(7, [5, 6]) == (2, 0)  # no empty slot left: the least recently used prefix is evicted
    assert mgr.num_cached_prefixes() == 1
    assert mgr.take_moves() == []
    mgr.check()
    mgr.set_length(6, 2)
    mgr.share(6, 7, 2)  # only sibling copies move anything
    assert mgr.take_moves() == [Move(0, 2, 2)]


def test_prefix_cache_reuse_keeps_last_prompt_token_uncomputed():
    mgr = SlotCacheManager(2, 32)
    mgr.allocate(0, [1, 2, 3])
    mgr.set_length(0, 5)
    mgr.free(0, [1, 2, 3, 4, 5, 6])  # 5 positions computed: tokens 1..5 are cached
    assert mgr.num_cached_prefixes() == 1
    assert mgr.allocate(1, [1, 2, 3, 4, 5, 6, 7]) == (0, 5)
    assert mgr.num_cached_prefixes() == 0
    mgr.free(1)
    mgr.allocate(2, [1, 2, 3])
    assert mgr.length_of(2) == 0  # the prefix was not cached again (free without tokens)
    mgr.set_length(2, 3)
    mgr.free(2, [1, 2, 3, 9])
    assert mgr.allocate(3, [1, 2, 3]) == (0, 2)  # at most len(prompt) - 1 positions reused


def test_share_copies_the_prompt_into_siblings():
    mgr, rows = SlotCacheManager(3, 16), FakeRows(3)
    for i in range(3):
        mgr.allocate(i)
    rows.rows[0] = list("prompt")
    mgr.set_length(0, 6)
    mgr.share(0, 1, 6)
    mgr.share(0, 2, 6)
    rows.apply(mgr.take_moves())
    assert rows.rows[1] == rows.rows[2] == list("prompt")
    with pytest.raises(ValueError, match="only 6 positions"):
        mgr.share(0, 1, 7)


@pytest.mark.parametrize("compact", [True, False])
def test_random_workload_never_corrupts_another_sequence(compact):
    """Every active and cached sequence's row always holds exactly its own tokens, across moves."""
    rng = random.Random(0)
    num_slots = 5
    mgr, rows = SlotCacheManager(num_slots, 64, compact=compact), FakeRows(num_slots)
    live: dict[int, list[str]] = {}
    for step in range(2000):
        op = rng.random()
        if op < 0.35 and mgr.num_free():
            prompt = [f"p{rng.randrange(3)}", f"q{rng.randrange(2)}", f"s{step}"]
            slot, reused = mgr.allocate(step, prompt)
            rows.apply(mgr.take_moves())
            assert rows.rows[slot][:reused] == prompt[:reused]  # a reused prefix is really there
            rows.rows[slot] = prompt[:reused] + rows.rows[slot][reused:]
            live[step] = list(prompt[:reused])
        elif op < 0.75 and live:
            seq = rng.choice(list(live))
            live[seq].append(f"t{step}")
            slot = mgr.slot_of(seq)
            rows.rows[slot] = live[seq] + rows.rows[slot][len(live[seq]) :]
            mgr.set_length(seq, len(live[seq]))
        elif live:
            seq = rng.choice(list(live))
            tokens = live.pop(seq)
            mgr.free(seq, tokens + ["next"] if rng.random() < 0.7 else None)
            rows.apply(mgr.take_moves())
        mgr.check()
        for seq, tokens in live.items():
            assert rows.rows[mgr.slot_of(seq)][: len(tokens)] == tokens
        for slot, entry in mgr._cached.items():
            assert tuple(rows.rows[slot][: len(entry.tokens)]) == entry.tokens


def _group(request_id: str, prompt: list[int], n: int = 1) -> Group:
    return Group(request_id, prompt, SamplingParams(n=n), [0] * n, lambda g: None)


def test_scheduler_budget_chunks_and_waits_for_slots():
    with pytest.raises(ValueError, match="max_num_batched_tokens must be >= 1, got 0"):
        Scheduler(SlotCacheManager(3, 64), max_num_batched_tokens=0)
    sched = Scheduler(SlotCacheManager(3, 64, prefix_cache=False), max_num_batched_tokens=8)
    sched.add(_group("a", list(range(20))))
    sched.add(_group("b", [1, 2], n=2))
    sched.add(_group("c", [5]))
    plan = sched.schedule()
    assert [(c.seq.group.request_id, c.start, c.end) for c in plan.prefill] == [("a", 0, 8)]
    sched.computed(plan.prefill[0])
    plan = sched.schedule()
    assert [(c.seq.group.request_id, c.start, c.end) for c in plan.prefill] == [("a", 8, 16)]
    sched.computed(plan.prefill[0])
    plan = sched.schedule()  # a finishes its prompt (4 tokens), b (n=2) is admitted with the rest
    assert [(c.seq.group.request_id, c.start, c.end) for c in plan.prefill] == [("a", 16, 20), ("b", 0, 2)]
    assert [len(sched.computed(c)) for c in plan.prefill] == [1, 2]  # b's sibling samples too
    assert [g.request_id for g in sched.waiting] == ["c"]  # no slot left: c waits
    for seq in sched.running:
        seq.tokens.append(0)
    plan = sched.schedule()
    assert len(plan.decode) == 3 and not plan.prefill
    sched.finish(sched.running[0], "stop")
    plan = sched.schedule()
    assert [c.seq.group.request_id for c in plan.prefill] == ["c"]


def test_requests_with_one_prompt_share_its_prefill_or_copy_a_running_one():
    sched = Scheduler(SlotCacheManager(6, 64, prefix_cache=False), max_num_batched_tokens=8)
    prompt = list(range(12))
    for name in "abc":
        sched.add(_group(name, prompt))
    sched.add(_group("d", [1, 2, 3], n=2))
    plan = sched.schedule()  # only a's prompt is computed (chunked); b, c wait for it; d is a new prompt
    assert [(c.seq.group.request_id, c.start, c.end) for c in plan.prefill] == [("a", 0, 8)]
    sched.remove_group(sched.running[0].group, "abort")  # the leader goes: b takes over from position 0
    plan = sched.schedule()
    assert [(c.seq.group.request_id, c.start, c.end) for c in plan.prefill] == [("b", 0, 8)]
    sched.computed(plan.prefill[0])
    plan = sched.schedule()
    assert [(c.seq.group.request_id, c.start, c.end) for c in plan.prefill] == [("b", 8, 12), ("d", 0, 3)]
    samplers = [[s.group.request_id for s in sched.computed(c)] for c in plan.prefill]
    assert samplers == [["b", "c"], ["d", "d"]]  # c samples from b's logits with its own seed and params
    assert sched.running[1].num_cached == 12 and sched.owners[tuple(prompt)].group.request_id == "b"
    sched.manager.take_moves()
    sched.add(_group("e", prompt))  # b holds the prompt's KV: e copies it and computes the last token only
    plan = sched.schedule()
    assert [(c.seq.group.request_id, c.start, c.end) for c in plan.prefill] == [("e", 11, 12)]
    assert [m.length for m in sched.manager.take_moves()] == [11]


def test_restart_recomputes_a_shared_prompt_once_then_each_tail():
    sched = Scheduler(SlotCacheManager(4, 64, prefix_cache=False), max_num_batched_tokens=64)
    prompt = list(range(10))
    sched.add(_group("a", prompt, n=3))
    (chunk,) = sched.schedule().prefill
    for i, seq in enumerate(sched.computed(chunk)):  # three samples, then two more tokens each
        seq.tokens += [100 + i] if i else [100, 101, 102]
    sched.restart_all()  # new weights: the leader recomputes all 12 of its tokens, the others wait
    (chunk,) = sched.schedule().prefill
    assert (chunk.seq.sample_index, chunk.start, chunk.end) == (0, 0, 13)
    sched.manager.take_moves()
    assert sched.computed(chunk) == [chunk.seq]
    assert [m.length for m in sched.manager.take_moves()] == [10, 10]  # the prompt, copied to both
    plan = sched.schedule()  # each copy computes its own token: one decode row each
    assert [(s.sample_index, s.num_computed) for s in plan.decode] == [(1, 10), (2, 10)]


def test_a_request_waiting_on_a_prompt_being_recomputed_still_computes_its_last_token():
    sched = Scheduler(SlotCacheManager(4, 64, prefix_cache=False), max_num_batched_tokens=64)
    prompt = list(range(10))
    sched.add(_group("a", prompt))
    (chunk,) = sched.schedule().prefill
    (leader,) = sched.computed(chunk)
    leader.tokens += [100, 101]
    sched.restart_all()  # a recomputes 12 tokens; b arrives meanwhile and waits for its prompt
    sched.add(_group("b", prompt))
    (chunk,) = sched.schedule().prefill
    assert chunk.seq is leader and sched.computed(chunk) == [leader]  # a's logits are for its own last token
    plan = sched.schedule()
    assert [(s.group.request_id, s.num_computed) for s in plan.decode] == [("b", 9)]


def test_kv_kept_across_a_swap_is_never_shared_with_new_requests():
    sched = Scheduler(SlotCacheManager(6, 64), max_num_batched_tokens=16)
    short, long = [50, 51, 52], list(range(24))
    sched.add(_group("a", short))
    (a,) = sched.computed(sched.schedule().prefill[0])
    a.tokens.append(7)
    sched.add(_group("b", long, n=2))
    sched.computed(sched.schedule().prefill[0])  # a decodes (below), b's prompt is computed up to 15
    a.num_computed = 4
    sched.manager.set_length(a.seq_id, 4)
    sched.forget_computed_prompts()  # new weights, old KV kept ("keep")
    sched.finish(a, "stop")  # its KV is not kept as a cached prefix
    sched.add(_group("c", [*short, 7, 9]))
    sched.add(_group("d", long))  # computes its prompt itself rather than wait for b's (old) prefill
    plan = sched.schedule()
    assert [(c.seq.group.request_id, c.start, c.end) for c in plan.prefill] == [("b", 15, 24), ("c", 0, 5), ("d", 0, 2)]
    assert [s.stale for s in sched.computed(plan.prefill[0])] == [True, True]  # b's sample copied the old KV
    for seq in plan.prefill[0].seq.group.seqs:
        sched.finish(seq, "stop")
    assert sched.manager.num_cached_prefixes() == 0
