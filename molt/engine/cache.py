"""KV-cache bookkeeping for the built-in engine: which sequence owns which cache slot, in plain Python.

The physical cache (owned by the runner) is `num_slots` rows of `max_seq_len` positions plus one scratch row. A
slot holds one sequence, so an admitted sequence never runs out of room: out of capacity only means "no free
slot", and the request waits in the queue. Nothing is preempted. Invariants (the tests check them):

- With `compact` (attention reading a contiguous view of the cache), active slots are exactly
  `0 .. num_active-1`: a freed slot takes the last active sequence, a reused prefix moves to the end of the
  active ones. Without it (Molt's CPU kernel takes each row's slot), a sequence keeps its slot and nothing moves.
- Finished sequences may leave their KV as a *cached prefix* in an inactive slot, reused by a new prompt that
  starts with those tokens (multi-turn agents), and evicted least-recently-used when a slot is needed.
- The n samples of one prompt share its prefill: `share` copies the computed prefix into siblings.

Every relocation is a `Move` the runner applies, in order, before the next forward. Knows nothing of tensors,
models or sampling."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

SCRATCH = -1  # the runner maps this to its extra row


@dataclass(frozen=True)
class Move:
    """Copy positions [0, length) of cache row `src` to row `dst` (SCRATCH = the spare row)."""

    src: int
    dst: int
    length: int


@dataclass
class _CachedPrefix:
    tokens: tuple[int, ...]
    last_used: int


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


class SlotCacheManager:
    """Slot allocation, compaction (optional), prefix caching and sharing; emits `Move`s for the runner."""

    def __init__(self, num_slots: int, max_seq_len: int, prefix_cache: bool = True, compact: bool = True):
        if num_slots < 1 or max_seq_len < 2:
            raise ValueError(f"need num_slots >= 1 and max_seq_len >= 2, got {num_slots}, {max_seq_len}")
        self.num_slots, self.max_seq_len, self.compact = num_slots, max_seq_len, compact
        self.prefix_cache, self.num_active, self._clock = prefix_cache, 0, 0
        self._slot_of: dict[int, int] = {}
        self._owner: list[int | None] = [None] * num_slots
        self._length: list[int] = [0] * num_slots
        self._cached: dict[int, _CachedPrefix] = {}
        self._moves: list[Move] = []

    def slot_of(self, seq_id: int, default: int | None = None) -> int:
        """The sequence's slot; `default` (when given) for one that holds none."""
        return self._slot_of[seq_id] if default is None else self._slot_of.get(seq_id, default)

    def length_of(self, seq_id: int) -> int:
        return self._length[self._slot_of[seq_id]]

    def num_free(self) -> int:
        """Slots a new sequence could take now (free or holding an evictable cached prefix)."""
        return self.num_slots - self.num_active

    def num_cached_prefixes(self) -> int:
        return len(self._cached)

    def take_moves(self) -> list[Move]:
        """The pending relocations, in the order the runner must apply them."""
        moves, self._moves = self._moves, []
        return moves

    def allocate(self, seq_id: int, prompt: Sequence[int] = ()) -> tuple[int, int] | None:
        """(slot, number of prompt positions already in it) for a new sequence, or None when full.

        At most len(prompt) - 1 positions are reused, so the last prompt token is always computed
        (its logits give the first sample)."""
        if seq_id in self._slot_of:
            raise ValueError(f"sequence {seq_id} already holds slot {self._slot_of[seq_id]}")
        if self.num_active == self.num_slots:
            return None
        hit, reuse = self._best_prefix(prompt)
        if not self.compact:
            target = hit if hit is not None else self._free_slot()
            self._cached.pop(target, None)
            return self._assign(seq_id, target, reuse)  # reuse is 0 without a hit
        target = self.num_active
        if hit is not None:
            self._cached.pop(hit)
            if hit != target and target in self._cached:
                self._swap(hit, target)
            elif hit != target:
                self._move(hit, target)
        else:
            self._make_room(target)
        return self._assign(seq_id, target, reuse)

    def _assign(self, seq_id: int, slot: int, reuse: int) -> tuple[int, int]:
        self._owner[slot], self._slot_of[seq_id], self._length[slot] = seq_id, slot, reuse
        self.num_active += 1
        return slot, reuse

    def _free_slot(self) -> int:
        """Without compaction: the lowest slot holding nothing, else the least recently used cached prefix's."""
        empty = next((s for s in range(self.num_slots) if self._owner[s] is None and s not in self._cached), None)
        return empty if empty is not None else self._least_recently_used()

    def _least_recently_used(self) -> int:
        """The slot of the cached prefix used longest ago (the one to evict)."""
        return min(self._cached, key=lambda s: self._cached[s].last_used)

    def _best_prefix(self, prompt: Sequence[int]) -> tuple[int | None, int]:
        best, best_len = None, 0
        for slot, entry in self._cached.items():
            n = min(common_prefix_len(entry.tokens, prompt), len(prompt) - 1)
            if n > best_len:
                best, best_len = slot, n
        return best, best_len

    def _make_room(self, target: int) -> None:
        """Make slot `target` (== num_active) free, relocating or evicting a cached prefix there."""
        if target not in self._cached:
            return
        free = next((s for s in range(target + 1, self.num_slots) if s not in self._cached), None)
        if free is None:  # every inactive slot holds a prefix: evict the least recently used one
            free = self._least_recently_used()
            self._cached.pop(free)
            if free == target:
                return
        self._move(target, free)
        self._cached[free] = self._cached.pop(target)

    def set_length(self, seq_id: int, length: int) -> None:
        """Record that positions [0, length) of the sequence's slot hold valid KV."""
        if not 0 <= length <= self.max_seq_len:
            raise ValueError(f"length {length} outside [0, {self.max_seq_len}]")
        self._length[self._slot_of[seq_id]] = length

    def share(self, src_seq: int, dst_seq: int, length: int) -> None:
        """Give `dst_seq` a copy of the first `length` positions of `src_seq` (n samples, one prefill)."""
        src, dst = self._slot_of[src_seq], self._slot_of[dst_seq]
        if length > self._length[src]:
            raise ValueError(f"sequence {src_seq} has only {self._length[src]} positions, asked to share {length}")
        self._moves.append(Move(src, dst, length))
        self._length[dst] = length

    def free(self, seq_id: int, tokens: Sequence[int] | None = None) -> None:
        """Release the sequence's slot; with `tokens` (its ids), keep the computed KV as a cached prefix."""
        slot = self._slot_of[seq_id]
        last = self.num_active - 1 if self.compact else slot
        if self.prefix_cache and tokens is not None and self._length[slot] > 0:
            cached = tuple(tokens[: self._length[slot]])
            for subsumed in [s for s, e in self._cached.items() if cached[: len(e.tokens)] == e.tokens]:
                self._cached.pop(subsumed)
            if slot != last:
                self._swap(slot, last)
            self._clock += 1
            self._cached[last] = _CachedPrefix(cached, self._clock)
        elif slot != last:
            self._move(last, slot)
        else:
            self._length[last] = 0
        self._slot_of.pop(seq_id)
        self._owner[last] = None
        self.num_active -= 1

    def clear_prefixes(self) -> None:
        """Forget every cached prefix (their KV was computed under weights that are gone)."""
        self._cached.clear()

    def reset_lengths(self) -> None:
        """Mark every active slot empty (the engine recomputes their KV under new weights)."""
        self._length[: self.num_active] = [0] * self.num_active

    def _move(self, src: int, dst: int) -> None:
        """Relocate the content (owner, length) of slot `src` into `dst`, leaving `src` empty."""
        self._moves.append(Move(src, dst, self._length[src]))
        self._length[dst], self._length[src] = self._length[src], 0
        owner = self._owner[dst] = self._owner[src]
        self._owner[src] = None
        if owner is not None:
            self._slot_of[owner] = dst

    def _swap(self, a: int, b: int) -> None:
        """Exchange the contents of slots a and b through the scratch row (cached entries included)."""
        la, lb = self._length[a], self._length[b]
        self._moves += [Move(a, SCRATCH, la), Move(b, a, lb), Move(SCRATCH, b, la)]
        self._length[a], self._length[b] = lb, la
        self._owner[a], self._owner[b] = self._owner[b], self._owner[a]
        for slot in (a, b):
            if self._owner[slot] is not None:
                self._slot_of[self._owner[slot]] = slot
        ca, cb = self._cached.pop(a, None), self._cached.pop(b, None)
        self._cached |= {slot: entry for slot, entry in ((b, ca), (a, cb)) if entry is not None}

    def check(self) -> None:
        """Assert the invariants (used by tests): mappings consistent, active slots contiguous with `compact`."""
        active = sorted(self._slot_of.values())
        assert len(active) == len(set(active)) == self.num_active, self._slot_of
        assert not self.compact or active == list(range(self.num_active)), self._slot_of
        for seq, slot in self._slot_of.items():
            assert self._owner[slot] == seq
        assert all(self._owner[s] is None for s in self._cached), (self._cached, self._slot_of)
        assert sum(o is not None for o in self._owner) == self.num_active
