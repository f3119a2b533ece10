"""Tests of engine.kv_cache_manager: tables, copy-on-write, prefix caching, LRU eviction, swap.

The state-machine test simulates the physical KV cache as one token id per slot: every write,
copy-on-write copy and swap is applied to that simulated memory, and after every operation each
live sequence's block table must read back exactly its own computed tokens. That checks sharing,
copy-on-write and cache hits by their effect, not by the manager's own bookkeeping.
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import engine.kv_cache_manager as kvm_module
from engine.kv_cache_manager import KVCacheManager

BS = 4


def write(bm: KVCacheManager, memory: dict, seq_id: int, tokens: list[int], start: int,
          n: int) -> None:
    """Allocates slots for tokens [start, start+n), applies copies, writes them, commits."""
    copies = bm.allocate_slots(seq_id, start, n)
    assert copies is not None
    for src, dst in copies:
        for o in range(bm.block_size):
            memory[dst * bm.block_size + o] = memory.get(src * bm.block_size + o)
    table = bm.block_table(seq_id)
    for p in range(start, start + n):
        memory[table[p // bm.block_size] * bm.block_size + p % bm.block_size] = tokens[p]
    bm.commit(seq_id, tokens, start + n)


def read(bm: KVCacheManager, memory: dict, seq_id: int, n: int) -> list:
    table = bm.block_table(seq_id)
    return [memory.get(table[p // bm.block_size] * bm.block_size + p % bm.block_size)
            for p in range(n)]


def test_rejects_bad_sizes():
    with pytest.raises(ValueError, match="num_blocks"):
        KVCacheManager(0, 16)
    with pytest.raises(ValueError, match="block_size"):
        KVCacheManager(4, 0)


def test_allocate_and_free_return_every_block():
    bm = KVCacheManager(8, BS)
    bm.admit(1, [1] * 10, [])
    assert bm.allocate_slots(1, 0, 10) == []
    assert len(bm.block_table(1)) == 3 and bm.num_free_blocks == 5
    bm.check_integrity()
    bm.free(1)
    assert bm.num_free_blocks == 8 and bm.num_used_blocks == 0
    bm.check_integrity()


def test_allocate_slots_fails_without_change_when_short():
    bm = KVCacheManager(3, BS, enable_prefix_caching=False)
    bm.admit(1, [0] * 8, [])
    bm.allocate_slots(1, 0, 8)
    bm.admit(2, [0] * 8, [])
    assert bm.allocate_slots(2, 0, 8) is None
    assert bm.block_table(2) == [] and bm.num_free_blocks == 1
    bm.check_integrity()


def test_fork_shares_and_copy_on_write_copies_last_block_once():
    bm = KVCacheManager(10, BS)
    tokens = [1, 2, 3, 4, 5, 6]  # one full block and a partial one
    bm.admit(1, tokens, [])
    bm.allocate_slots(1, 0, 6)
    bm.commit(1, tokens, 6)
    for child in (2, 3):
        bm.fork(1, child)
    assert bm.num_used_blocks == 2
    shared_last = bm.block_table(1)[1]
    assert bm.ref_count(shared_last) == 3
    copies = bm.append_slot(2, 6)
    assert len(copies) == 1 and copies[0][0] == shared_last
    assert bm.block_table(2)[1] == copies[0][1] and bm.block_table(2)[0] == bm.block_table(1)[0]
    assert bm.append_slot(3, 6) != [] and bm.append_slot(1, 6) == []  # last holder writes in place
    assert bm.num_used_blocks == 4
    bm.check_integrity()
    for s in (1, 2, 3):
        bm.free(s)
    assert bm.num_used_blocks == 0
    bm.check_integrity()


def test_prefix_cache_reuses_longest_prefix_and_leaves_one_token():
    bm = KVCacheManager(10, BS)
    a = list(range(10))
    bm.admit(1, a, bm.find_cached_prefix(a))
    bm.allocate_slots(1, 0, 10)
    bm.commit(1, a, 10)
    bm.free(1)
    b = a[:8] + [99, 98, 97]
    hits = bm.find_cached_prefix(b)
    assert hits == cached_blocks(bm, a, 2)
    assert bm.admit(2, b, hits) == 8
    bm.check_integrity()
    # A prompt made exactly of cached blocks keeps its last block to compute.
    assert len(bm.find_cached_prefix(a[:8])) == 1
    assert bm.prefix_cache_hits > 0 and bm.prefix_cache_queries >= bm.prefix_cache_hits


def cached_blocks(bm: KVCacheManager, tokens: list[int], n: int) -> list[int]:
    """The cached blocks for the first n blocks of `tokens`, read from the cache index."""
    parent = kvm_module.ROOT_HASH
    out = []
    for i in range(n):
        block_tokens = tuple(tokens[i * BS:(i + 1) * BS])
        parent = kvm_module.chain_hash(parent, block_tokens)
        out.append(bm.pool.lookup(parent, block_tokens))
    return out


def test_hash_collision_is_caught_by_comparing_tokens(monkeypatch):
    monkeypatch.setattr(kvm_module, "chain_hash", lambda parent, tokens: 7)
    bm = KVCacheManager(6, BS)
    a = [1, 2, 3, 4, 5]
    bm.admit(1, a, [])
    bm.allocate_slots(1, 0, 5)
    bm.commit(1, a, 5)
    assert bm.find_cached_prefix([9, 9, 9, 9, 9]) == []
    assert bm.find_cached_prefix(a) == [bm.block_table(1)[0]]
    bm.check_integrity()


def test_lru_evicts_oldest_cached_block_and_hit_takes_from_middle():
    bm = KVCacheManager(3, BS)
    seqs = {s: [s * 10 + i for i in range(BS + 1)] for s in (1, 2, 3)}
    for s, toks in seqs.items():  # each caches one full block, then is freed in order 1, 2, 3
        bm.admit(s, toks, [])
        bm.allocate_slots(s, 0, BS)
        bm.commit(s, toks, BS)
        bm.free(s)
    assert bm.num_cached_blocks == 3 and bm.num_free_blocks == 3
    hit = bm.find_cached_prefix(seqs[2])  # takes seq 2's block out of the middle of the LRU
    bm.admit(4, seqs[2], hit)
    bm.allocate_slots(4, BS, 1)  # needs one block: evicts seq 1's (the oldest)
    assert bm.find_cached_prefix(seqs[1]) == []
    assert len(bm.find_cached_prefix(seqs[3])) == 1
    bm.check_integrity()


def test_swap_out_and_in_keep_sharing_and_contents():
    bm = KVCacheManager(6, BS, num_host_blocks=6)
    memory: dict = {}
    toks = [5, 6, 7, 8, 9, 10]
    bm.admit(1, toks, [])
    write(bm, memory, 1, toks, 0, 6)
    bm.fork(1, 2)
    out = bm.swap_out([1, 2])
    assert out is not None and len(out) == 2
    host: dict = {}
    for d, h in out:
        for o in range(BS):
            host[h * BS + o] = memory.get(d * BS + o)
    assert bm.is_swapped(1) and bm.num_free_host_blocks == 4
    bm.check_integrity()
    back = bm.swap_in([1, 2])
    assert back is not None and len(back) == 2
    for h, d in back:
        for o in range(BS):
            memory[d * BS + o] = host[h * BS + o]
    assert read(bm, memory, 1, 6) == toks and bm.block_table(1) == bm.block_table(2)
    assert bm.num_free_host_blocks == 6
    bm.check_integrity()


def test_swap_out_refuses_when_host_pool_is_short():
    bm = KVCacheManager(6, BS, num_host_blocks=1)
    bm.admit(1, [0] * 8, [])
    bm.allocate_slots(1, 0, 8)
    assert bm.swap_out([1]) is None and bm.is_resident(1)
    bm.check_integrity()


class KVCacheManagerMachine(RuleBasedStateMachine):
    """Random admit / extend / fork / free / swap sequences against a simulated KV memory."""

    def __init__(self) -> None:
        super().__init__()
        self.bm = KVCacheManager(12, BS, num_host_blocks=8)
        self.memory: dict = {}
        self.host: dict = {}
        self.tokens: dict[int, list[int]] = {}
        self.computed: dict[int, int] = {}
        self.swapped: set[int] = set()
        self.next_id = 0

    def resident(self) -> list[int]:
        return [s for s in self.tokens if s not in self.swapped]

    @rule(prompt=st.lists(st.integers(0, 2), min_size=1, max_size=14), chunk=st.integers(1, 14),
          reserve=st.one_of(st.none(), st.integers(1, 20)))
    def admit(self, prompt, chunk, reserve):
        hits = self.bm.find_cached_prefix(prompt)
        done = len(hits) * BS
        n = min(chunk, len(prompt) - done)
        if self.bm.num_blocks_to_admit(hits, done + n, reserve) > self.bm.num_free_blocks:
            return
        s = self.next_id
        self.next_id += 1
        assert self.bm.admit(s, prompt, hits, reserve) == done
        assert len(self.bm.block_table(s)) == max(len(hits), -(-(reserve or 0) // BS))
        # Hit blocks must already hold exactly these tokens.
        assert read(self.bm, self.memory, s, done) == prompt[:done]
        self.tokens[s], self.computed[s] = list(prompt), done
        write(self.bm, self.memory, s, prompt, done, n)
        self.computed[s] += n

    @precondition(lambda self: self.resident())
    @rule(data=st.data(), new=st.lists(st.integers(0, 2), min_size=0, max_size=6))
    def extend(self, data, new):
        s = data.draw(st.sampled_from(self.resident()))
        self.tokens[s].extend(new)
        n = len(self.tokens[s]) - self.computed[s]
        if n == 0 or self.bm.num_slots_needed(s, self.computed[s], n) > self.bm.num_free_blocks:
            return
        write(self.bm, self.memory, s, self.tokens[s], self.computed[s], n)
        self.computed[s] += n

    @precondition(lambda self: self.resident())
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(self.resident()))
        child = self.next_id
        self.next_id += 1
        self.bm.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent][:self.computed[parent]])
        self.computed[child] = self.computed[parent]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        s = data.draw(st.sampled_from(sorted(self.tokens)))
        self.bm.free(s)
        del self.tokens[s], self.computed[s]
        self.swapped.discard(s)

    @precondition(lambda self: self.resident())
    @rule(data=st.data())
    def swap_out(self, data):
        s = data.draw(st.sampled_from(self.resident()))
        out = self.bm.swap_out([s])
        if out is None:
            return
        for d, h in out:
            for o in range(BS):
                self.host[h * BS + o] = self.memory.get(d * BS + o)
        self.swapped.add(s)

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def swap_in(self, data):
        s = data.draw(st.sampled_from(sorted(self.swapped)))
        back = self.bm.swap_in([s])
        if back is None:
            return
        for h, d in back:
            for o in range(BS):
                self.memory[d * BS + o] = self.host[h * BS + o]
        self.swapped.discard(s)
        # Pending tokens past the computed ones are not in the cache; recompute them on extend.
        self.tokens[s] = self.tokens[s][:self.computed[s]]

    @invariant()
    def consistent(self):
        self.bm.check_integrity()
        for s in self.resident():
            assert read(self.bm, self.memory, s, self.computed[s]) == \
                self.tokens[s][:self.computed[s]], f"seq {s} reads back wrong tokens"
        assert self.bm.num_used_blocks <= self.bm.num_blocks

    @invariant()
    def memory_accounted(self):
        """Slots holding a token, from this machine's own count of each sequence's computed
        tokens: a block shared by several sequences counts once, as full as its fullest."""
        fill: dict[int, int] = {}
        holders: dict[int, int] = {}
        for s in self.resident():
            for i, b in enumerate(self.bm.block_table(s)):
                fill[b] = max(fill.get(b, 0), min(BS, max(0, self.computed[s] - i * BS)))
                holders[b] = holders.get(b, 0) + 1
        stats = self.bm.memory_stats()
        assert stats.total_slots == 12 * BS and stats.allocated_slots == len(fill) * BS
        assert stats.token_slots == sum(fill.values())
        assert stats.allocated_slots == (stats.token_slots + stats.reserved_unused_slots
                                         + stats.internal_fragment_slots)
        assert stats.allocated_slots + stats.free_slots == stats.total_slots
        assert stats.shared_blocks_saved == sum(h - 1 for h in holders.values())


KVCacheManagerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40,
                                                  deadline=None)
test_kv_cache_manager_state_machine = KVCacheManagerMachine.TestCase


def test_everything_freed_after_random_run():
    bm = KVCacheManager(5, BS, num_host_blocks=2)
    for s in range(3):
        toks = list(range(s, s + 7))
        done = bm.admit(s, toks, bm.find_cached_prefix(toks))
        assert bm.allocate_slots(s, done, 1) is not None
    for s in range(3):
        bm.free(s)
    bm.reset_prefix_cache()
    assert bm.num_free_blocks == 5 and bm.num_cached_blocks == 0
    bm.check_integrity()
