"""The pool of KV blocks: reference counts, free blocks, and the prefix cache's index.

A block is *referenced* (held by at least one block table), *free*, or *evictable*: free but still
holding the K/V of a full block the prefix cache knows under a key. The pool hands out plain free
blocks first (a stack, so block 0 goes first); when none is left it evicts the least recently
released evictable block. Evictable blocks wait in an LRU (an OrderedDict: O(1) to append, to take
the oldest, and to take one out of the middle when a lookup hits it). A cached block keeps its
token ids, so a key collision is caught by comparing them.

The pool knows nothing of sequences: `engine.kv_cache_manager` maps sequences to blocks and
computes the keys. The host swap pool is a `BlockPool` too, one that never caches.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from typing import Optional

#: A `(src, dst)` pair of block ids: a copy-on-write copy or a swap move.
BlockCopy = tuple[int, int]


class BlockPool:
    """`num_blocks` blocks (ids `0 .. num_blocks - 1`), all free at first, and the index from
    prefix-cache keys to the blocks holding them."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._ref = [0] * num_blocks
        self._key: list[Optional[int]] = [None] * num_blocks
        self._tokens: list[Optional[tuple[int, ...]]] = [None] * num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # least recently used first
        self._cache: dict[int, int] = {}

    # ----------------------------------------------------------------- queries
    @property
    def num_free_blocks(self) -> int:
        """Blocks that `allocate` can hand out now: plain free ones plus evictable ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        """Blocks with at least one reference."""
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks in the prefix-cache index (referenced or evictable)."""
        return len(self._cache)

    def ref_count(self, block: int) -> int:
        return self._ref[block]

    def is_cached(self, block: int) -> bool:
        """Whether the block is in the prefix-cache index (its contents must not change)."""
        return self._key[block] is not None

    def key(self, block: int) -> Optional[int]:
        """The prefix-cache key of the block, None if it is not cached."""
        return self._key[block]

    def tokens(self, block: int) -> Optional[tuple[int, ...]]:
        """The token ids a cached block holds (None for an uncached block)."""
        return self._tokens[block] if self._key[block] is not None else None

    # ------------------------------------------------------------ references
    def allocate(self) -> int:
        """A block with no reference and no key, now referenced once; evicts the least recently
        released cached block when no plain free block is left. The caller checks
        `num_free_blocks` first."""
        if self._free:
            block = self._free.pop()
        else:
            block, _ = self._evictable.popitem(last=False)
            self._uncache(block)
        self._ref[block] = 1
        return block

    def acquire(self, block: int) -> None:
        """Adds a reference to a block that is referenced or cached (a cache hit takes an
        evictable block out of the LRU)."""
        if self._ref[block] == 0:
            del self._evictable[block]
        self._ref[block] += 1

    def release(self, block: int) -> None:
        """Drops a reference; at zero a cached block becomes evictable, others free."""
        self._ref[block] -= 1
        if self._ref[block] == 0:
            if self._key[block] is not None:
                self._evictable[block] = None
            else:
                self._free.append(block)

    # ------------------------------------------------------------ prefix cache
    def lookup(self, key: int, tokens: tuple[int, ...]) -> Optional[int]:
        """The cached block under `key` if it holds exactly `tokens`, else None. Changes
        nothing (`acquire` the block to use it)."""
        block = self._cache.get(key)
        if block is None or self._tokens[block] != tokens:
            return None
        return block

    def cache(self, block: int, key: int, tokens: tuple[int, ...]) -> None:
        """Enters a full, computed block under `key`; a no-op when the block already has a key
        or the key is cached under another block (that twin serves future hits)."""
        if self._key[block] is None and key not in self._cache:
            self._key[block] = key
            self._tokens[block] = tokens
            self._cache[key] = block

    def reset_prefix_cache(self) -> None:
        """Forgets every evictable cached block (referenced ones stay cached)."""
        while self._evictable:
            block, _ = self._evictable.popitem(last=False)
            self._uncache(block)
            self._free.append(block)

    def _uncache(self, block: int) -> None:
        del self._cache[self._key[block]]  # type: ignore[index]
        self._key[block] = None
        self._tokens[block] = None

    # ---------------------------------------------------------------- integrity
    def check_integrity(self, refs: Counter, block_size: int, name: str = "block") -> None:
        """Raises AssertionError unless the reference counts equal `refs` (references counted
        from the block tables) and the free list, LRU and cache index agree; `block_size` is
        the length of every cached block's tokens; `name` names the pool in messages."""
        for b in range(self.num_blocks):
            assert self._ref[b] == refs.get(b, 0), \
                f"{name} {b}: ref count {self._ref[b]} != {refs.get(b, 0)} references"
        free = set(self._free)
        assert len(free) == len(self._free), f"a {name} is in the free list twice"
        assert not free & set(self._evictable), f"a {name} is both free and evictable"
        for b in range(self.num_blocks):
            is_free = b in free or b in self._evictable
            assert is_free != (self._ref[b] > 0), f"{name} {b}: free xor referenced violated"
        assert all(self._key[b] is None for b in free), f"a plain free {name} has a key"
        assert all(self._key[b] is not None for b in self._evictable), "evictable without a key"
        assert self.num_free_blocks + sum(1 for r in self._ref if r > 0) == self.num_blocks
        for k, b in self._cache.items():
            assert self._key[b] == k, f"cache index: key {k} -> block {b} keyed {self._key[b]}"
            assert self._tokens[b] is not None and len(self._tokens[b]) == block_size
        keyed = [b for b in range(self.num_blocks) if self._key[b] is not None]
        assert len(keyed) == len(self._cache), "a keyed block is missing from the cache index"
