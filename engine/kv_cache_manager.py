"""The KV cache manager: which blocks hold which sequence's tokens.

A sequence's *block table* lists the device blocks holding its tokens in order: token `p` lives in
slot `table[p // block_size] * block_size + p % block_size`. Blocks come from a `BlockPool`
(engine/block_pool.py) and carry reference counts, so the `n` samples of one prompt, the branches
of a beam search and requests with a common prefix share blocks; a sequence about to write into a
shared block first gets a private copy (copy-on-write: `allocate_slots` returns the `(src, dst)`
pairs the runner copies with `copy_blocks`).

Prefix caching: once a block is full of computed tokens it is keyed by a hash chained over (the
previous block's key, this block's token ids) and entered in the pool's cache index. A new
sequence takes the longest chain of cached blocks matching its prompt. A block whose reference
count drops to zero keeps its key until the pool evicts it.

Preemption by swap moves a sequence's blocks to a second, host pool (`swap_out`) and back
(`swap_in`); the returned `(src, dst)` pairs are what the runner copies with `swap_blocks`.

`trim` gives back the slots past a sequence's accepted tokens (speculative decoding writes the
K/V of proposals that may then be rejected).

Contiguous-reservation baselines (engine/kv_allocation.py): `admit(..., reserve_tokens=n)` gives
a sequence all the blocks of `n` slots at once; later writes inside them take no new block.
Under a reservation policy (`kv_allocation` other than "paged") the manager neither looks up nor
commits cached blocks.

`memory_stats()` splits the device slots into those holding a token, reserved but unused, the
empty tail of each sequence's last written block (internal fragmentation) and free ones: each
resident sequence's *written extent* (the tokens `allocate_slots` made room for) is tracked.

`check_integrity()` verifies every invariant; the tests call it after every operation.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

from engine.block_pool import BlockCopy, BlockPool
from engine.config import KV_ALLOCATIONS

#: The parent key of a sequence's first block.
ROOT_HASH = 0x5EED


def chain_hash(parent: int, tokens: tuple[int, ...]) -> int:
    """The prefix-cache key of a full block: chained over its parent's key and its token ids."""
    return hash((parent, tokens))


@dataclass(frozen=True)
class KVMemoryStats:
    """Device KV memory at one moment, in slots (tokens) except `shared_blocks_saved`.

    `allocated_slots` (blocks referenced by a table, times `block_size`) = `token_slots` (slots
    holding a written token; a block shared by several sequences counts once, filled up to its
    furthest holder's extent) + `reserved_unused_slots` (blocks after every holder's last written
    block) + `internal_fragment_slots` (the empty tail of a block holding some sequence's last
    written token). `allocated_slots + free_slots == total_slots` (evictable cached blocks are
    free). `shared_blocks_saved`: blocks that sharing saves, the sum over allocated blocks of
    their reference count minus one.
    """

    total_slots: int
    allocated_slots: int
    token_slots: int
    reserved_unused_slots: int
    internal_fragment_slots: int
    free_slots: int
    shared_blocks_saved: int


class KVCacheManager:
    """The block tables of live sequences over a device pool and a host swap pool.

    Sequences are named by an int `seq_id`. A sequence is either *resident* (a device block table)
    or *swapped* (a host block table), or unknown to the manager. The manager does not keep token
    contents (the pool keeps those of the full blocks it caches); callers pass token ids where
    needed. `kv_allocation` other than "paged" (a reservation baseline) turns prefix caching off.
    """

    def __init__(self, num_blocks: int, block_size: int, num_host_blocks: int = 0,
                 enable_prefix_caching: bool = True, kv_allocation: str = "paged") -> None:
        for name, value, minimum in (("num_blocks", num_blocks, 1), ("block_size", block_size, 1),
                                     ("num_host_blocks", num_host_blocks, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"{name}: expected an int >= {minimum}, got {value!r}")
        if kv_allocation not in KV_ALLOCATIONS:
            raise ValueError(f"kv_allocation: expected one of {KV_ALLOCATIONS}, got "
                             f"{kv_allocation!r}")
        self.block_size = block_size
        self.kv_allocation = kv_allocation
        self.enable_prefix_caching = enable_prefix_caching and kv_allocation == "paged"
        self.pool = BlockPool(num_blocks)
        self.host_pool = BlockPool(num_host_blocks)
        self._tables: dict[int, list[int]] = {}
        # Chained keys of each resident sequence's full, computed blocks (prefix of its table).
        self._seq_hashes: dict[int, list[int]] = {}
        self._host_tables: dict[int, list[int]] = {}
        # Written extent (tokens) of each resident sequence, and of each swapped one.
        self._written: dict[int, int] = {}
        self._host_written: dict[int, int] = {}
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.peak_used_blocks = 0

    # ----------------------------------------------------------------- queries
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_host_blocks(self) -> int:
        return self.host_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Device blocks that can be handed out now (plain free ones plus evictable cached ones)."""
        return self.pool.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        """Device blocks referenced by at least one block table."""
        return self.pool.num_used_blocks

    @property
    def num_free_host_blocks(self) -> int:
        return self.host_pool.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks in the prefix-cache index (referenced or evictable)."""
        return self.pool.num_cached_blocks

    def usage(self) -> float:
        """Share of device blocks in use, in [0, 1]."""
        return self.num_used_blocks / self.num_blocks

    def block_table(self, seq_id: int) -> list[int]:
        """The device block table of a resident sequence (the manager's own list: do not modify)."""
        return self._tables[seq_id]

    def is_resident(self, seq_id: int) -> bool:
        return seq_id in self._tables

    def is_swapped(self, seq_id: int) -> bool:
        return seq_id in self._host_tables

    def sequences(self) -> set[int]:
        """Ids of every sequence holding blocks (resident or swapped)."""
        return set(self._tables) | set(self._host_tables)

    def ref_count(self, block: int) -> int:
        return self.pool.ref_count(block)

    # ------------------------------------------------------------ prefix cache
    def find_cached_prefix(self, token_ids: Sequence[int]) -> list[int]:
        """The longest chain of cached blocks holding a prefix of `token_ids`.

        At most `(len(token_ids) - 1) // block_size` blocks: at least one token is always left to
        compute, since the engine needs its logits. Does not change the manager's state.
        """
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        hits: list[int] = []
        parent = ROOT_HASH
        for i in range((len(token_ids) - 1) // bs):
            tokens = tuple(token_ids[i * bs:(i + 1) * bs])
            parent = chain_hash(parent, tokens)
            block = self.pool.lookup(parent, tokens)
            if block is None:
                break
            hits.append(block)
        return hits

    def num_blocks_to_admit(self, cached: Sequence[int], num_tokens: int,
                            reserve_tokens: Optional[int] = None) -> int:
        """Free blocks that `admit(cached, reserve_tokens)` followed by slots for the first
        `num_tokens` tokens would take: the new blocks (at least the reservation's) plus the
        cached hits that are now evictable."""
        tokens = max(num_tokens, reserve_tokens or 0)
        new = max(0, -(-tokens // self.block_size) - len(cached))
        return new + sum(1 for b in cached if self.pool.ref_count(b) == 0)

    def admit(self, seq_id: int, token_ids: Sequence[int], cached: Sequence[int],
              reserve_tokens: Optional[int] = None) -> int:
        """Gives a new sequence a block table starting with the `cached` blocks (from
        `find_cached_prefix(token_ids)`); returns the number of tokens already computed.

        With `reserve_tokens`, the table gets all `ceil(reserve_tokens / block_size)` blocks now
        (ValueError, nothing changed, when they are not free; `num_blocks_to_admit` says)."""
        self._check_unknown("seq_id", seq_id)
        if reserve_tokens is not None:
            self._check_reservation(cached, reserve_tokens)
        self.prefix_cache_queries += len(token_ids)
        self.prefix_cache_hits += len(cached) * self.block_size
        for b in cached:
            self.pool.acquire(b)
        table = list(cached)
        while len(table) * self.block_size < (reserve_tokens or 0):
            table.append(self.pool.allocate())
        self._tables[seq_id] = table
        self._seq_hashes[seq_id] = [self.pool.key(b) for b in cached]  # type: ignore[misc]
        self._written[seq_id] = len(cached) * self.block_size
        self._note_peak()
        return len(cached) * self.block_size

    def _check_reservation(self, cached: Sequence[int], reserve_tokens: int) -> None:
        if isinstance(reserve_tokens, bool) or not isinstance(reserve_tokens, int) \
                or reserve_tokens < 1:
            raise ValueError(f"reserve_tokens: expected None or an int >= 1, got "
                             f"{reserve_tokens!r}")
        needed = self.num_blocks_to_admit(cached, 0, reserve_tokens)
        if needed > self.num_free_blocks:
            raise ValueError(f"reserve_tokens: expected a reservation that fits the "
                             f"{self.num_free_blocks} free blocks, got {reserve_tokens} tokens "
                             f"({needed} blocks)")

    def commit(self, seq_id: int, token_ids: Sequence[int], num_computed: int) -> None:
        """Enters the sequence's blocks that are full of computed tokens into the prefix cache.

        Call after the step that computed them (their K/V is in the cache). A block whose key is
        already cached under another block stays uncached (its twin serves future hits).
        """
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        table = self._tables[seq_id]
        hashes = self._seq_hashes[seq_id]
        parent = hashes[-1] if hashes else ROOT_HASH
        for i in range(len(hashes), num_computed // bs):
            tokens = tuple(token_ids[i * bs:(i + 1) * bs])
            parent = chain_hash(parent, tokens)
            hashes.append(parent)
            self.pool.cache(table[i], parent, tokens)

    def reset_prefix_cache(self) -> None:
        """Forgets every evictable cached block (referenced ones stay cached)."""
        self.pool.reset_prefix_cache()

    # --------------------------------------------------------------- allocation
    def num_slots_needed(self, seq_id: int, num_computed: int, num_new: int) -> int:
        """Free blocks `allocate_slots(seq_id, num_computed, num_new)` may take (an upper bound)."""
        table = self._tables[seq_id]
        bs = self.block_size
        end = -(-(num_computed + num_new) // bs)
        needed = max(0, end - len(table))
        for i in range(num_computed // bs, min(end, len(table))):
            if self.pool.ref_count(table[i]) > 1:
                needed += 1
        return needed

    def allocate_slots(self, seq_id: int, num_computed: int,
                       num_new: int) -> Optional[list[BlockCopy]]:
        """Makes room to write tokens `[num_computed, num_computed + num_new)` of a resident
        sequence: appends blocks and replaces each shared block in that range by a private copy.

        Returns the `(src, dst)` block copies to perform before the write, or None (and changes
        nothing) when there are not enough free blocks.
        """
        if self.num_slots_needed(seq_id, num_computed, num_new) > self.num_free_blocks:
            return None
        table = self._tables[seq_id]
        bs = self.block_size
        end = -(-(num_computed + num_new) // bs)
        copies: list[BlockCopy] = []
        for i in range(num_computed // bs, min(end, len(table))):
            src = table[i]
            assert not self.pool.is_cached(src), f"writing into cached block {src}"
            if self.pool.ref_count(src) > 1:
                dst = self.pool.allocate()
                self.pool.release(src)  # still referenced by the other holders
                table[i] = dst
                copies.append((src, dst))
        while len(table) < end:
            table.append(self.pool.allocate())
        self._written[seq_id] = max(self._written[seq_id], num_computed + num_new)
        self._note_peak()
        return copies

    def trim(self, seq_id: int, num_tokens: int) -> None:
        """Gives back the slots a resident sequence holds past its first `num_tokens` tokens
        (speculative decoding: the slots of rejected proposals): the blocks after the one
        holding token `num_tokens - 1` are released and the written extent shrinks to
        `num_tokens`. None of them is in the prefix cache (only blocks full of computed tokens
        are, and `num_tokens` is at least the computed count). Under a reservation
        `kv_allocation` the blocks stay reserved; only the extent shrinks."""
        table = self._tables[seq_id]
        keep = -(-num_tokens // self.block_size)
        assert keep >= len(self._seq_hashes[seq_id]), "trimming a cached block"
        if self.kv_allocation == "paged":
            while len(table) > keep:
                self.pool.release(table.pop())
        self._written[seq_id] = min(self._written[seq_id], num_tokens)

    def append_slot(self, seq_id: int, num_computed: int) -> Optional[list[BlockCopy]]:
        """`allocate_slots` for one decode token."""
        return self.allocate_slots(seq_id, num_computed, 1)

    def fork(self, parent_id: int, child_id: int) -> None:
        """Gives `child_id` the parent's blocks (shared: reference counts go up, nothing copied)."""
        self._check_unknown("child_id", child_id)
        table = self._tables[parent_id]
        for b in table:
            self.pool.acquire(b)
        self._tables[child_id] = list(table)
        self._seq_hashes[child_id] = list(self._seq_hashes[parent_id])
        self._written[child_id] = self._written[parent_id]

    def free(self, seq_id: int) -> None:
        """Releases everything the sequence holds (device or host blocks); unknown ids are a no-op.

        Blocks are released last first, so that the tail of a sequence is evicted before its head.
        """
        table = self._tables.pop(seq_id, None)
        self._seq_hashes.pop(seq_id, None)
        self._written.pop(seq_id, None)
        self._host_written.pop(seq_id, None)
        if table is not None:
            for b in reversed(table):
                self.pool.release(b)
        host = self._host_tables.pop(seq_id, None)
        if host is not None:
            for b in host:
                self.host_pool.release(b)

    # -------------------------------------------------------------------- swap
    def can_swap_out(self, seq_ids: Iterable[int]) -> bool:
        distinct = {b for s in seq_ids for b in self._tables[s]}
        return len(distinct) <= self.host_pool.num_free_blocks

    def swap_out(self, seq_ids: Sequence[int]) -> Optional[list[BlockCopy]]:
        """Moves the resident sequences (one request's, sharing blocks) to the host pool.

        Returns `(device block, host block)` pairs to copy before the device blocks are reused, or
        None (nothing changed) when the host pool is too small. Sharing among `seq_ids` is kept.
        """
        if not self.can_swap_out(seq_ids):
            return None
        mapping = self._move(seq_ids, self._tables, self._host_tables, self.host_pool)
        for s in seq_ids:
            for b in reversed(self._tables.pop(s)):
                self.pool.release(b)
            self._seq_hashes.pop(s)
            self._host_written[s] = self._written.pop(s)
        return mapping

    def num_blocks_to_swap_in(self, seq_ids: Iterable[int]) -> int:
        return len({b for s in seq_ids for b in self._host_tables[s]})

    def swap_in(self, seq_ids: Sequence[int]) -> Optional[list[BlockCopy]]:
        """Moves swapped sequences back to new device blocks; returns `(host block, device block)`
        pairs to copy before they are read, or None (nothing changed) when blocks are short."""
        if self.num_blocks_to_swap_in(seq_ids) > self.num_free_blocks:
            return None
        mapping = self._move(seq_ids, self._host_tables, self._tables, self.pool)
        for s in seq_ids:
            # The new blocks have no key yet; the next `commit` re-enters the full ones.
            self._seq_hashes[s] = []
            self._written[s] = self._host_written.pop(s)
            for h in self._host_tables.pop(s):
                self.host_pool.release(h)
        self._note_peak()
        return mapping

    @staticmethod
    def _move(seq_ids: Sequence[int], src_tables: dict[int, list[int]],
              dst_tables: dict[int, list[int]], dst_pool: BlockPool) -> list[BlockCopy]:
        """Gives each sequence a table in `dst_pool` with the sharing of its `src_tables` one
        (one new block per distinct source block); returns the `(src, dst)` block pairs."""
        mapping: dict[int, int] = {}
        for s in seq_ids:
            table = []
            for b in src_tables[s]:
                if b not in mapping:
                    mapping[b] = dst_pool.allocate()  # referenced once
                else:
                    dst_pool.acquire(mapping[b])
                table.append(mapping[b])
            dst_tables[s] = table
        return list(mapping.items())

    # ------------------------------------------------------------------ memory
    def memory_stats(self) -> KVMemoryStats:
        """How the device slots are used now (see `KVMemoryStats`)."""
        bs = self.block_size
        fill: dict[int, int] = {}  # allocated block -> slots holding a token
        for seq_id, table in self._tables.items():
            written = self._written[seq_id]
            for i, b in enumerate(table):
                fill[b] = max(fill.get(b, 0), min(bs, max(0, written - i * bs)))
        total = self.num_blocks * bs
        allocated = self.num_used_blocks * bs
        return KVMemoryStats(
            total_slots=total, allocated_slots=allocated, token_slots=sum(fill.values()),
            reserved_unused_slots=bs * sum(1 for f in fill.values() if f == 0),
            internal_fragment_slots=sum(bs - f for f in fill.values() if 0 < f < bs),
            free_slots=total - allocated,
            shared_blocks_saved=sum(self.pool.ref_count(b) - 1 for b in fill))

    # ---------------------------------------------------------------- internals
    def _check_unknown(self, name: str, seq_id: int) -> None:
        if seq_id in self._tables or seq_id in self._host_tables:
            raise ValueError(f"{name}: expected a sequence unknown to the manager, got {seq_id}")

    def _note_peak(self) -> None:
        self.peak_used_blocks = max(self.peak_used_blocks, self.num_used_blocks)

    # ---------------------------------------------------------------- integrity
    def check_integrity(self) -> None:
        """Raises AssertionError unless every invariant of the pools, tables and cache holds."""
        for seq_id, table in self._tables.items():
            assert len(set(table)) == len(table), f"seq {seq_id} lists a block twice: {table}"
            assert all(0 <= b < self.num_blocks for b in table), f"seq {seq_id}: bad id {table}"
        self.pool.check_integrity(Counter(b for t in self._tables.values() for b in t),
                                  self.block_size)
        for seq_id, hashes in self._seq_hashes.items():
            assert seq_id in self._tables and len(hashes) <= len(self._tables[seq_id])
        assert set(self._seq_hashes) == set(self._tables)
        self._check_written()
        assert not set(self._tables) & set(self._host_tables), "a sequence resident and swapped"
        self.host_pool.check_integrity(Counter(b for t in self._host_tables.values() for b in t),
                                       self.block_size, "host block")

    def _check_written(self) -> None:
        """Every resident (swapped) sequence has a written extent within its (host) table."""
        for tables, written in ((self._tables, self._written),
                                (self._host_tables, self._host_written)):
            assert set(written) == set(tables), "written extents of unknown sequences"
            for seq_id, table in tables.items():
                extent = written[seq_id]
                assert 0 <= extent <= len(table) * self.block_size, \
                    f"seq {seq_id}: written extent {extent} beyond its {len(table)} blocks"
