"""The KV block manager: which physical blocks hold which sequence's tokens.

A sequence's *block table* lists the device blocks holding its tokens in order: token `p` lives in
slot `table[p // block_size] * block_size + p % block_size`. Blocks carry reference counts, so the
`n` samples of one prompt, the branches of a beam search and requests with a common prefix share
blocks; a sequence about to write into a shared block first gets a private copy (copy-on-write:
`allocate_slots` returns the `(src, dst)` pairs the runner copies with `copy_blocks`).

Prefix caching: once a block is full of computed tokens it is keyed by a hash chained over (the
previous block's key, this block's token ids) and entered in the cache index. A new sequence takes
the longest chain of cached blocks matching its prompt (token ids compared on every hit, so a hash
collision is harmless). A block whose reference count drops to zero keeps its key and waits in an
LRU (an OrderedDict: O(1) to append, to take the oldest, and to take one out of the middle on a
hit); plain free blocks are handed out before cached ones are evicted.

Preemption by swap moves a sequence's blocks to a separate host pool (`swap_out`) and back
(`swap_in`); the returned `(src, dst)` pairs are what the runner copies with `swap_blocks`.

`check_integrity()` verifies every invariant; the tests call it after every operation.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from typing import Iterable, Optional, Sequence

BlockCopy = tuple[int, int]

#: The parent key of a sequence's first block.
_ROOT_HASH = 0x5EED


def chain_hash(parent: int, tokens: tuple[int, ...]) -> int:
    """The prefix-cache key of a full block: chained over its parent's key and its token ids."""
    return hash((parent, tokens))


class BlockManager:
    """Device and host block pools, the block tables of live sequences and the prefix cache.

    Sequences are named by an int `seq_id`. A sequence is either *resident* (a device block table)
    or *swapped* (a host block table), or unknown to the manager. The manager does not know token
    contents except those of full blocks it caches; callers pass token ids where needed.
    """

    def __init__(self, num_blocks: int, block_size: int, num_host_blocks: int = 0,
                 enable_prefix_caching: bool = True) -> None:
        for name, value, minimum in (("num_blocks", num_blocks, 1), ("block_size", block_size, 1),
                                     ("num_host_blocks", num_host_blocks, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"{name}: expected an int >= {minimum}, got {value!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_host_blocks = num_host_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self._ref = [0] * num_blocks
        self._hash: list[Optional[int]] = [None] * num_blocks
        self._tokens: list[Optional[tuple[int, ...]]] = [None] * num_blocks
        # Plain free blocks as a stack (reversed so block 0 is handed out first).
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        # Cached blocks with no reference, least recently used first.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._cache: dict[int, int] = {}
        self._tables: dict[int, list[int]] = {}
        # Chained keys of each resident sequence's full, computed blocks (prefix of its table).
        self._seq_hashes: dict[int, list[int]] = {}
        self._host_ref = [0] * num_host_blocks
        self._host_free: list[int] = list(range(num_host_blocks - 1, -1, -1))
        self._host_tables: dict[int, list[int]] = {}
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.peak_used_blocks = 0

    # ----------------------------------------------------------------- queries
    @property
    def num_free_blocks(self) -> int:
        """Device blocks that can be handed out now (plain free ones plus evictable cached ones)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        """Device blocks referenced by at least one block table."""
        return self.num_blocks - self.num_free_blocks

    @property
    def num_free_host_blocks(self) -> int:
        return len(self._host_free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks in the prefix-cache index (referenced or evictable)."""
        return len(self._cache)

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
        return self._ref[block]

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
        parent = _ROOT_HASH
        for i in range((len(token_ids) - 1) // bs):
            tokens = tuple(token_ids[i * bs:(i + 1) * bs])
            parent = chain_hash(parent, tokens)
            block = self._cache.get(parent)
            if block is None or self._tokens[block] != tokens:
                break
            hits.append(block)
        return hits

    def num_blocks_to_admit(self, cached: Sequence[int], num_tokens: int) -> int:
        """Free blocks that `admit(cached)` followed by slots for the first `num_tokens` tokens
        would take: the new blocks plus the cached hits that are now evictable."""
        new = max(0, -(-num_tokens // self.block_size) - len(cached))
        return new + sum(1 for b in cached if self._ref[b] == 0)

    def admit(self, seq_id: int, token_ids: Sequence[int], cached: Sequence[int]) -> int:
        """Gives a new sequence a block table starting with the `cached` blocks (from
        `find_cached_prefix(token_ids)`); returns the number of tokens already computed."""
        if seq_id in self._tables or seq_id in self._host_tables:
            raise ValueError(f"seq_id: expected a sequence unknown to the manager, got {seq_id}")
        self.prefix_cache_queries += len(token_ids)
        self.prefix_cache_hits += len(cached) * self.block_size
        for b in cached:
            self._take(b)
        self._tables[seq_id] = list(cached)
        hashes: list[int] = []
        for b in cached:
            hashes.append(self._hash[b])  # type: ignore[arg-type]
        self._seq_hashes[seq_id] = hashes
        self._note_peak()
        return len(cached) * self.block_size

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
        parent = hashes[-1] if hashes else _ROOT_HASH
        for i in range(len(hashes), num_computed // bs):
            tokens = tuple(token_ids[i * bs:(i + 1) * bs])
            parent = chain_hash(parent, tokens)
            hashes.append(parent)
            block = table[i]
            if self._hash[block] is None and parent not in self._cache:
                self._hash[block] = parent
                self._tokens[block] = tokens
                self._cache[parent] = block

    def reset_prefix_cache(self) -> None:
        """Forgets every evictable cached block (referenced ones stay cached)."""
        while self._evictable:
            block, _ = self._evictable.popitem(last=False)
            self._uncache(block)
            self._free.append(block)

    # --------------------------------------------------------------- allocation
    def num_slots_needed(self, seq_id: int, num_computed: int, num_new: int) -> int:
        """Free blocks `allocate_slots(seq_id, num_computed, num_new)` may take (an upper bound)."""
        table = self._tables[seq_id]
        bs = self.block_size
        end = -(-(num_computed + num_new) // bs)
        needed = max(0, end - len(table))
        for i in range(num_computed // bs, min(end, len(table))):
            if self._ref[table[i]] > 1:
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
            assert self._hash[src] is None, f"writing into cached block {src}"
            if self._ref[src] > 1:
                dst = self._pop_free()
                self._ref[src] -= 1
                table[i] = dst
                copies.append((src, dst))
        while len(table) < end:
            table.append(self._pop_free())
        self._note_peak()
        return copies

    def append_slot(self, seq_id: int, num_computed: int) -> Optional[list[BlockCopy]]:
        """`allocate_slots` for one decode token."""
        return self.allocate_slots(seq_id, num_computed, 1)

    def fork(self, parent_id: int, child_id: int) -> None:
        """Gives `child_id` the parent's blocks (shared: reference counts go up, nothing copied)."""
        if child_id in self._tables or child_id in self._host_tables:
            raise ValueError(f"child_id: expected a sequence unknown to the manager, got "
                             f"{child_id}")
        table = self._tables[parent_id]
        for b in table:
            self._ref[b] += 1
        self._tables[child_id] = list(table)
        self._seq_hashes[child_id] = list(self._seq_hashes[parent_id])

    def free(self, seq_id: int) -> None:
        """Releases everything the sequence holds (device or host blocks); unknown ids are a no-op.

        Blocks are released last first, so that the tail of a sequence is evicted before its head.
        """
        table = self._tables.pop(seq_id, None)
        self._seq_hashes.pop(seq_id, None)
        if table is not None:
            for b in reversed(table):
                self._release(b)
        host = self._host_tables.pop(seq_id, None)
        if host is not None:
            for b in host:
                self._host_ref[b] -= 1
                if self._host_ref[b] == 0:
                    self._host_free.append(b)

    # -------------------------------------------------------------------- swap
    def can_swap_out(self, seq_ids: Iterable[int]) -> bool:
        distinct = {b for s in seq_ids for b in self._tables[s]}
        return len(distinct) <= len(self._host_free)

    def swap_out(self, seq_ids: Sequence[int]) -> Optional[list[BlockCopy]]:
        """Moves the resident sequences (one request's, sharing blocks) to the host pool.

        Returns `(device block, host block)` pairs to copy before the device blocks are reused, or
        None (nothing changed) when the host pool is too small. Sharing among `seq_ids` is kept.
        """
        if not self.can_swap_out(seq_ids):
            return None
        mapping: dict[int, int] = {}
        for s in seq_ids:
            host_table = []
            for b in self._tables[s]:
                if b not in mapping:
                    mapping[b] = self._host_free.pop()
                host_table.append(mapping[b])
                self._host_ref[mapping[b]] += 1
            self._host_tables[s] = host_table
        for s in seq_ids:
            for b in reversed(self._tables.pop(s)):
                self._release(b)
            self._seq_hashes.pop(s)
        return list(mapping.items())

    def num_blocks_to_swap_in(self, seq_ids: Iterable[int]) -> int:
        return len({b for s in seq_ids for b in self._host_tables[s]})

    def swap_in(self, seq_ids: Sequence[int]) -> Optional[list[BlockCopy]]:
        """Moves swapped sequences back to new device blocks; returns `(host block, device block)`
        pairs to copy before they are read, or None (nothing changed) when blocks are short."""
        if self.num_blocks_to_swap_in(seq_ids) > self.num_free_blocks:
            return None
        mapping: dict[int, int] = {}
        for s in seq_ids:
            table = []
            for h in self._host_tables[s]:
                if h not in mapping:
                    mapping[h] = self._pop_free()  # referenced once
                else:
                    self._ref[mapping[h]] += 1
                table.append(mapping[h])
            self._tables[s] = table
            # The new blocks have no key yet; the next `commit` re-enters the full ones.
            self._seq_hashes[s] = []
        for s in seq_ids:
            for h in self._host_tables.pop(s):
                self._host_ref[h] -= 1
                if self._host_ref[h] == 0:
                    self._host_free.append(h)
        self._note_peak()
        return list(mapping.items())

    # ---------------------------------------------------------------- internals
    def _pop_free(self) -> int:
        """A block with no reference and no key, now referenced once (evicts the LRU if needed)."""
        if self._free:
            block = self._free.pop()
        else:
            block, _ = self._evictable.popitem(last=False)
            self._uncache(block)
        self._ref[block] = 1
        return block

    def _take(self, block: int) -> None:
        """References a cached block found by a lookup."""
        if self._ref[block] == 0:
            del self._evictable[block]
        self._ref[block] += 1

    def _release(self, block: int) -> None:
        self._ref[block] -= 1
        if self._ref[block] == 0:
            if self._hash[block] is not None:
                self._evictable[block] = None
            else:
                self._free.append(block)

    def _uncache(self, block: int) -> None:
        del self._cache[self._hash[block]]  # type: ignore[index]
        self._hash[block] = None
        self._tokens[block] = None

    def _note_peak(self) -> None:
        self.peak_used_blocks = max(self.peak_used_blocks, self.num_used_blocks)

    # ---------------------------------------------------------------- integrity
    def check_integrity(self) -> None:
        """Raises AssertionError unless every invariant of the pools, tables and cache holds."""
        refs = Counter(b for t in self._tables.values() for b in t)
        for seq_id, table in self._tables.items():
            assert len(set(table)) == len(table), f"seq {seq_id} lists a block twice: {table}"
            assert all(0 <= b < self.num_blocks for b in table), f"seq {seq_id}: bad id {table}"
        for b in range(self.num_blocks):
            assert self._ref[b] == refs.get(b, 0), \
                f"block {b}: ref count {self._ref[b]} != {refs.get(b, 0)} references"
        free = set(self._free)
        assert len(free) == len(self._free), "a block is in the free list twice"
        assert not free & set(self._evictable), "a block is both free and evictable"
        for b in range(self.num_blocks):
            is_free = b in free or b in self._evictable
            assert is_free != (self._ref[b] > 0), f"block {b}: free xor referenced violated"
        assert all(self._hash[b] is None for b in free), "a plain free block has a key"
        assert all(self._hash[b] is not None for b in self._evictable), "evictable without a key"
        assert self.num_free_blocks + sum(1 for r in self._ref if r > 0) == self.num_blocks
        for h, b in self._cache.items():
            assert self._hash[b] == h, f"cache index: key {h} -> block {b} keyed {self._hash[b]}"
            assert self._tokens[b] is not None and len(self._tokens[b]) == self.block_size
        keyed = [b for b in range(self.num_blocks) if self._hash[b] is not None]
        assert len(keyed) == len(self._cache), "a keyed block is missing from the cache index"
        for seq_id, hashes in self._seq_hashes.items():
            assert seq_id in self._tables and len(hashes) <= len(self._tables[seq_id])
        assert set(self._seq_hashes) == set(self._tables)
        assert not set(self._tables) & set(self._host_tables), "a sequence resident and swapped"
        self._check_host()

    def _check_host(self) -> None:
        refs = Counter(b for t in self._host_tables.values() for b in t)
        for b in range(self.num_host_blocks):
            assert self._host_ref[b] == refs.get(b, 0), f"host block {b}: bad ref count"
        free = set(self._host_free)
        assert len(free) == len(self._host_free), "a host block is free twice"
        for b in range(self.num_host_blocks):
            assert (b in free) != (self._host_ref[b] > 0), f"host block {b}: free xor used"
