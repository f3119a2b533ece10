"""Tests of engine.block_pool: reference counts, the free list, the LRU of cached blocks and the
prefix-cache index, driven directly (tests/test_engine_kv_cache_manager.py drives the pool
through block tables)."""

from __future__ import annotations

from collections import Counter

import pytest

from engine.block_pool import BlockPool

BS = 2


def test_allocate_hands_out_plain_free_blocks_lowest_first_and_release_returns_them():
    pool = BlockPool(3)
    assert [pool.allocate() for _ in range(3)] == [0, 1, 2]
    assert pool.num_free_blocks == 0 and pool.num_used_blocks == 3
    pool.acquire(1)
    pool.release(1)
    assert pool.ref_count(1) == 1 and pool.num_free_blocks == 0
    pool.release(1)
    assert pool.ref_count(1) == 0 and pool.num_free_blocks == 1
    assert pool.allocate() == 1
    pool.check_integrity(Counter({0: 1, 1: 1, 2: 1}), BS)


def test_plain_free_blocks_go_before_cached_ones_and_eviction_takes_the_oldest():
    pool = BlockPool(4)
    blocks = [pool.allocate() for _ in range(3)]
    for key, b in enumerate(blocks):
        pool.cache(b, key, (key, key))
    for b in blocks:  # released in order: block 0 is the least recently used
        pool.release(b)
    assert pool.num_free_blocks == 4 and pool.num_cached_blocks == 3
    assert pool.allocate() == 3  # the plain free block, no eviction
    assert pool.allocate() == 0 and pool.lookup(0, (0, 0)) is None  # evicted, key gone
    assert pool.lookup(1, (1, 1)) == 1 and pool.is_cached(1)
    pool.check_integrity(Counter({3: 1, 0: 1}), BS)


def test_a_hit_takes_a_block_out_of_the_middle_of_the_lru():
    pool = BlockPool(3)
    for key in range(3):
        b = pool.allocate()
        pool.cache(b, key, (key, key))
        pool.release(b)
    pool.acquire(pool.lookup(1, (1, 1)))
    assert pool.ref_count(1) == 1 and pool.num_free_blocks == 2
    assert [pool.allocate(), pool.allocate()] == [0, 2]
    assert pool.key(1) == 1  # still cached while referenced
    pool.check_integrity(Counter({0: 1, 1: 1, 2: 1}), BS)


def test_lookup_compares_tokens_and_cache_keeps_the_first_block_of_a_key():
    pool = BlockPool(3)
    a, b = pool.allocate(), pool.allocate()
    pool.cache(a, 7, (1, 2))
    assert pool.lookup(7, (1, 2)) == a
    assert pool.lookup(7, (9, 9)) is None  # same key, other tokens: a collision
    assert pool.lookup(8, (1, 2)) is None
    pool.cache(b, 7, (1, 2))  # its twin is already cached: b stays uncached
    pool.cache(a, 9, (3, 4))  # a block keeps its first key
    assert not pool.is_cached(b) and pool.key(a) == 7 and pool.num_cached_blocks == 1
    pool.check_integrity(Counter({a: 1, b: 1}), BS)


def test_reset_prefix_cache_forgets_only_unreferenced_blocks():
    pool = BlockPool(2)
    held, dropped = pool.allocate(), pool.allocate()
    pool.cache(held, 1, (1, 1))
    pool.cache(dropped, 2, (2, 2))
    pool.release(dropped)
    pool.reset_prefix_cache()
    assert pool.is_cached(held) and not pool.is_cached(dropped)
    assert pool.lookup(2, (2, 2)) is None and pool.num_free_blocks == 1
    pool.check_integrity(Counter({held: 1}), BS)


def test_check_integrity_catches_a_reference_count_that_disagrees():
    pool = BlockPool(2)
    pool.allocate()
    with pytest.raises(AssertionError, match="ref count"):
        pool.check_integrity(Counter(), BS)
    with pytest.raises(AssertionError, match="host block 0"):
        pool.check_integrity(Counter({0: 2}), BS, "host block")
