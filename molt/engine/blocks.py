"""Paged KV-cache bookkeeping: fixed-size blocks, a block table per sequence, prefix sharing by reference.

The physical cache (owned by a runner) is `num_blocks` blocks of `block_size` positions; position p of a
sequence is at offset `p % block_size` of block `table[p // block_size]`, so memory follows the tokens in
flight. Plain Python: hands out block ids; knows nothing of tensors, models, requests or sampling.

Invariants (`check()` asserts them):

- **Only full, computed blocks are shared**, registered under a chained digest of the *whole prefix* they
  end (a hit means the same prefix, not just the same block of tokens). Nothing writes into a shared
  block, so no copy-on-write: the one copy is at `fork`, where the n samples of a prompt share its full
  blocks and each copies the computed part of the partial last block (a `BlockCopy` the runner applies).
- **A block is registered only once computed** (`set_computed`), so a prompt never hits KV a chunked
  prefill has yet to write; hits stop before the block of the prompt's last token (always computed).
- **Each block is in one place**: in use (refcount = tables holding it), *cached* (refcount 0 but
  registered, evicted least-recently-freed first when the free list is empty), or free. Tables release
  their last block first, so a prefix's deeper blocks go before its root (hits follow the chain).
- **Out of blocks** is never an error mid-step: `can_allocate` gates admission, `extend` returns None and
  the scheduler preempts (the latest admitted sequence, as vLLM) by `free`ing it; its blocks stay cached,
  so its recompute may hit its own prefix.
- **New weights** invalidate every digest (`clear_prefixes`), and the sequences holding blocks then (KV kept
  across the swap) and their forks register no block again: KV of old weights is never registered again.

Sizing: `bytes_per_block` and `num_blocks_for_budget` turn a byte budget into a block count."""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

DEFAULT_BLOCK_SIZE = 16
_ROOT = b""  # the digest "before" a sequence's first block


class OutOfBlocks(RuntimeError):
    """`allocate` or `fork` was asked for more blocks than are free (check `can_allocate` first)."""


@dataclass(frozen=True)
class BlockCopy:
    """Copy positions [0, length) of block `src` into block `dst` (a forked sample's own last block)."""

    src: int
    dst: int
    length: int


def block_digest(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """128-bit digest of a block's tokens chained to its parent's: equal digests mean equal prefixes."""
    return hashlib.blake2b(parent + array("q", token_ids).tobytes(), digest_size=16).digest()


def bytes_per_block(
    num_layers: int, num_kv_heads: int, head_dim: int, dtype_size: int, block_size: int = DEFAULT_BLOCK_SIZE
) -> int:
    """Bytes of one block: layers x kv heads x head dim x block size x 2 (keys and values) x dtype size."""
    return num_layers * num_kv_heads * head_dim * block_size * 2 * dtype_size


def kv_budget_bytes(free_bytes: int, memory_fraction: float) -> int:
    """The KV-cache budget: `memory_fraction` (0 < f <= 1) of the device memory free after the model loaded."""
    if not 0.0 < memory_fraction <= 1.0:
        raise ValueError(f"memory_fraction must be in (0, 1], got {memory_fraction}")
    return int(free_bytes * memory_fraction)


class KVBudgetError(ValueError):
    """The KV budget cannot hold one sequence of the engine's max_seq_len."""


def num_blocks_for_budget(budget_bytes: int, block_bytes: int) -> int:
    """How many whole blocks fit in `budget_bytes` (at least one, else the budget is an error)."""
    num_blocks = budget_bytes // block_bytes
    if num_blocks < 1:
        raise KVBudgetError(f"a KV budget of {budget_bytes} bytes holds no block of {block_bytes} bytes")
    return num_blocks


class BlockManager:
    """Block tables, reference counts, prefix registration and the free/cached pools of a paged KV cache."""

    def __init__(self, num_blocks: int, block_size: int = DEFAULT_BLOCK_SIZE, prefix_cache: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks, self.block_size, self.prefix_cache = num_blocks, block_size, prefix_cache
        self._free: deque[int] = deque(range(num_blocks))
        self._cached: OrderedDict[int, None] = OrderedDict()  # refcount 0, registered; oldest first
        self._ref = [0] * num_blocks
        self._digest_of: dict[int, bytes] = {}  # registered block -> digest of its prefix
        self._block_of: dict[bytes, int] = {}  # digest -> registered block
        self._tables: dict[int, list[int]] = {}
        self._tokens: dict[int, list[int]] = {}
        self._num_computed: dict[int, int] = {}
        self._digests: dict[int, list[bytes]] = {}  # chain digests of a sequence's full blocks, lazily extended
        self._stale: set[int] = set()  # sequences holding KV of replaced weights (and their forks): never registered
        self._copies: list[BlockCopy] = []

    def num_free_blocks(self) -> int:
        """Blocks a new sequence can take now: free ones plus cached (evictable) ones."""
        return len(self._free) + len(self._cached)

    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_tokens: int, reserve: int = 0) -> bool:
        """Whether a sequence of `num_tokens` fits with `reserve` blocks to spare (ignores prefix hits)."""
        return self.blocks_needed(num_tokens) + reserve <= self.num_free_blocks()

    def has(self, seq_id: int) -> bool:
        """Whether the sequence holds blocks."""
        return seq_id in self._tables

    def token_ids(self, seq_id: int) -> list[int]:
        """The tokens whose positions the sequence holds (do not modify)."""
        return self._tokens[seq_id]

    def block_table(self, seq_id: int) -> list[int]:
        return self._tables[seq_id]

    def num_tokens(self, seq_id: int) -> int:
        return len(self._tokens[seq_id])

    def num_computed(self, seq_id: int) -> int:
        return self._num_computed[seq_id]

    def ref_count(self, block: int) -> int:
        return self._ref[block]

    def slot(self, seq_id: int, position: int) -> tuple[int, int]:
        """(block, offset) holding the sequence's `position`."""
        return self._tables[seq_id][position // self.block_size], position % self.block_size

    def take_copies(self) -> list[BlockCopy]:
        """The pending block copies (from `fork`), to apply before the next forward."""
        copies, self._copies = self._copies, []
        return copies

    def allocate(self, seq_id: int, prompt_ids: Sequence[int]) -> int:
        """Give a new sequence blocks for its prompt; returns the number of leading positions already cached.

        Registered blocks matching the prompt's prefix are shared by reference (at most the blocks
        before the one holding the last prompt token); the rest are taken from the free list, then
        from the cached blocks, least recently freed first. Raises `OutOfBlocks`, changing nothing."""
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id} already has blocks")
        if not prompt_ids:
            raise ValueError("a sequence needs at least one prompt token")
        tokens = list(prompt_ids)
        digests, hits = self._match_prefix(tokens)
        num_new = self.blocks_needed(len(tokens)) - len(hits)
        if num_new > self.num_free_blocks() - sum(self._ref[b] == 0 for b in hits):
            raise OutOfBlocks(f"sequence {seq_id} needs {num_new} blocks, {self.num_free_blocks()} free")
        self._start_seq(seq_id, hits, num_new, tokens, digests, len(hits) * self.block_size)
        return len(hits) * self.block_size

    def _start_seq(self, seq_id: int, shared: list[int], num_new: int, tokens, digests, computed: int) -> list[int]:
        """The new sequence's table: `shared` blocks by reference (taken out of the cached pool), then `num_new`."""
        for block in shared:
            self._cached.pop(block, None)
            self._ref[block] += 1
        table = self._tables[seq_id] = shared + [self._take_block() for _ in range(num_new)]
        self._tokens[seq_id], self._digests[seq_id], self._num_computed[seq_id] = tokens, digests, computed
        return table

    def _match_prefix(self, tokens: list[int]) -> tuple[list[bytes], list[int]]:
        """Chain digests of the shareable full blocks and the registered blocks they hit (leading run)."""
        digests, hits, parent = [], [], _ROOT
        for i in range((len(tokens) - 1) // self.block_size if self.prefix_cache else 0):
            parent = block_digest(parent, tokens[i * self.block_size : (i + 1) * self.block_size])
            digests.append(parent)
            block = self._block_of.get(parent)
            if block is None:
                break
            hits.append(block)
        return digests, hits

    def _take_block(self) -> int:
        """A block for new content: a free one, else the least recently freed cached one (unregistered)."""
        if self._free:
            block = self._free.popleft()
        else:
            block, _ = self._cached.popitem(last=False)
            del self._block_of[self._digest_of.pop(block)]
        self._ref[block] = 1
        return block

    def extend(self, seq_id: int, token_ids: Sequence[int]) -> int | None:
        """Reserve positions for the tokens of `token_ids` past the ones the sequence holds (a prefix of them):
        the number of blocks added, or None when a block was needed and none was left (those taken are kept)."""
        tokens, table, bs = self._tokens[seq_id], self._tables[seq_id], self.block_size
        num_blocks = len(table)
        for token in token_ids[len(tokens) :]:
            if len(tokens) == len(table) * bs:
                if not self.num_free_blocks():
                    return None
                table.append(self._take_block())
            tokens.append(token)
        return len(table) - num_blocks

    def set_computed(self, seq_id: int, num_computed: int) -> None:
        """Record that positions [0, num_computed) hold KV; registers the blocks this fills (each block once)."""
        if not self._num_computed[seq_id] <= num_computed <= len(self._tokens[seq_id]):
            # computed positions are never recomputed in place (they may be shared): preempt instead
            raise ValueError(
                f"num_computed {num_computed} outside [{self._num_computed[seq_id]}, {len(self._tokens[seq_id])}]"
            )
        num_full = self._num_computed[seq_id] // self.block_size
        self._num_computed[seq_id] = num_computed
        if self.prefix_cache and num_computed // self.block_size > num_full and seq_id not in self._stale:
            self._register_full_blocks(seq_id, num_full, num_computed // self.block_size)

    def _register_full_blocks(self, seq_id: int, start: int, end: int) -> None:
        """Register blocks [start, end) of the sequence: only the newly full ones, so a decode step costs O(1)
        (a block already full was registered then, or came registered from a prefix hit or a fork)."""
        tokens, table, digests = self._tokens[seq_id], self._tables[seq_id], self._digests[seq_id]
        bs = self.block_size
        for i in range(start, end):
            if i == len(digests):
                digests.append(block_digest(digests[-1] if digests else _ROOT, tokens[i * bs : (i + 1) * bs]))
            block, digest = table[i], digests[i]
            if block not in self._digest_of and digest not in self._block_of:
                self._digest_of[block], self._block_of[digest] = digest, block

    def fork(self, src_seq: int, dst_seq: int, num_tokens: int | None = None) -> None:
        """Start `dst_seq` as a copy of the first `num_tokens` (default all) tokens of `src_seq`.

        Full, computed blocks are shared by reference; the rest get new blocks of `dst_seq`, the first of
        them with a pending `BlockCopy` of its computed positions. Raises `OutOfBlocks`, changing nothing."""
        if dst_seq in self._tables:
            raise ValueError(f"sequence {dst_seq} already has blocks")
        tokens = self._tokens[src_seq]
        num_tokens = len(tokens) if num_tokens is None else num_tokens
        if not 0 < num_tokens <= len(tokens):
            raise ValueError(f"cannot fork {num_tokens} of sequence {src_seq}'s {len(tokens)} tokens")
        computed = min(self._num_computed[src_seq], num_tokens)
        num_shared = computed // self.block_size  # a block not yet computed is never shared: both would write it
        num_new = self.blocks_needed(num_tokens) - num_shared
        if num_new > self.num_free_blocks():
            raise OutOfBlocks(f"fork {src_seq} -> {dst_seq} needs {num_new} blocks, {self.num_free_blocks()} free")
        src_table = self._tables[src_seq]
        digests = self._digests[src_seq][:num_shared]
        table = self._start_seq(dst_seq, src_table[:num_shared], num_new, tokens[:num_tokens], digests, computed)
        if computed % self.block_size:
            self._copies.append(BlockCopy(src_table[num_shared], table[num_shared], computed % self.block_size))
        if src_seq in self._stale:
            self._stale.add(dst_seq)

    def free(self, seq_id: int) -> None:
        """Drop the sequence's references, last block first; unreferenced registered blocks stay cached."""
        for block in reversed(self._tables.pop(seq_id)):
            self._ref[block] -= 1
            if self._ref[block] == 0:
                if block in self._digest_of:
                    self._cached[block] = None
                else:
                    self._free.append(block)
        for state in (self._tokens, self._num_computed, self._digests):
            state.pop(seq_id)
        self._stale.discard(seq_id)

    def clear_prefixes(self) -> None:
        """New weights: forget every registered digest, and never register the blocks of the sequences holding
        blocks now, nor of their forks (their KV was computed under weights that are gone, even positions
        computed later attend to it)."""
        self._stale |= self._tables.keys()
        self._free.extend(self._cached)
        self._cached.clear()
        self._digest_of.clear()
        self._block_of.clear()

    def check(self) -> None:
        """Assert the invariants (used by tests): pools partition the blocks, refcounts match the tables,
        shared blocks are full, registrations are consistent and match the tokens they cover, stale sequences
        hold no registered block."""
        refs = [0] * self.num_blocks
        for seq, table in self._tables.items():
            tokens = self._tokens[seq]
            assert len(table) == self.blocks_needed(len(tokens)), (seq, table, len(tokens))
            assert len(set(table)) == len(table), table
            assert 0 <= self._num_computed[seq] <= len(tokens)
            for block in table:
                refs[block] += 1
        assert refs == self._ref, (refs, self._ref)
        free, cached = set(self._free), set(self._cached)
        assert len(free) == len(self._free) and not free & cached
        in_use = {b for b in range(self.num_blocks) if refs[b]}
        assert free | cached | in_use == set(range(self.num_blocks)) and not (free | cached) & in_use
        assert cached <= set(self._digest_of) and not free & set(self._digest_of)
        assert {d: b for b, d in self._digest_of.items()} == self._block_of
        stale_blocks = {b for s in self._stale for b in self._tables[s]}
        assert self._stale <= self._tables.keys() and not stale_blocks & self._digest_of.keys()
        for seq, table in self._tables.items():
            self._check_sequence(seq, table)

    def _check_sequence(self, seq: int, table: list[int]) -> None:
        tokens, bs, parent = self._tokens[seq], self.block_size, _ROOT
        for i, block in enumerate(table):
            computed = (i + 1) * bs <= self._num_computed[seq]
            assert computed or self._ref[block] == 1, f"shared block {block} is not full and computed in {seq}"
            if not computed:
                break
            parent = block_digest(parent, tokens[i * bs : (i + 1) * bs])
            assert i >= len(self._digests[seq]) or self._digests[seq][i] == parent
            assert self._digest_of.get(block, parent) == parent, f"block {block} registered for another prefix"
