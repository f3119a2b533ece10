"""Tests of the KV allocation policies (engine/kv_allocation.py) and the memory accounting.

The reservation sizes are checked against hand-computed values; the manager's reservations and
`memory_stats` on hand-built scenarios whose every slot is counted by hand; the policies through
the engine with the real model: greedy output does not depend on the memory policy, and requests
whose sequences share blocks are refused under a reservation.
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM, BeamSearchParams, SamplingParams
from engine.config import KV_ALLOCATIONS, EngineConfig
from engine.kv_allocation import reserved_tokens, resolved_max_tokens
from engine.kv_cache_manager import KVCacheManager, KVMemoryStats

BS = 4

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ------------------------------------------------------------------------ reservation sizes
@pytest.mark.parametrize("policy, prompt, output, limit, expected", [
    ("paged", 10, 5, 512, None),
    ("reserve-max", 10, 5, 512, 512),
    ("reserve-max", 1, 0, 7, 7),
    ("reserve-pow2", 10, 5, 512, 16),
    ("reserve-pow2", 8, 8, 512, 16),    # exactly a power of two: itself
    ("reserve-pow2", 9, 8, 512, 32),    # one past: the next one
    ("reserve-pow2", 1, 0, 512, 1),
    ("reserve-pow2", 3, 0, 512, 4),     # no output: at least the prompt, rounded up
    ("reserve-pow2", 300, 100, 512, 512),
    ("reserve-pow2", 200, 100, 300, 300),  # 512 capped at max_model_len
    ("reserve-oracle", 10, 5, 512, 15),
    ("reserve-oracle", 500, 100, 512, 512),
])
def test_reserved_tokens(policy, prompt, output, limit, expected):
    assert reserved_tokens(policy, prompt, output, limit) == expected


def test_reserved_tokens_refuses_bad_arguments():
    with pytest.raises(ValueError, match=r"kv_allocation: expected one of .*'reserve-oracle'.*"
                                         r"got 'reserve'"):
        reserved_tokens("reserve", 10, 5, 512)
    with pytest.raises(ValueError, match="prompt_len: expected an int >= 1, got 0"):
        reserved_tokens("reserve-max", 0, 5, 512)
    with pytest.raises(ValueError, match="max_output_tokens"):
        reserved_tokens("reserve-oracle", 10, -1, 512)


def test_resolved_max_tokens_is_bounded_by_the_room_left():
    assert resolved_max_tokens(None, 10, 64) == 54
    assert resolved_max_tokens(5, 10, 64) == 5
    assert resolved_max_tokens(100, 10, 64) == 54


@pytest.mark.parametrize("bad", ["reserve", "Paged", None, 3])
def test_bad_kv_allocation_is_a_clear_error(bad):
    message = rf"kv_allocation: expected one of \('paged', 'reserve-max', 'reserve-pow2', " \
              rf"'reserve-oracle'\), got {bad!r}"
    with pytest.raises(ValueError, match=message):
        EngineConfig(kv_allocation=bad)
    with pytest.raises(ValueError, match=message):
        KVCacheManager(8, BS, kv_allocation=bad)


# --------------------------------------------------------------------- manager reservations
def test_admission_takes_the_whole_reservation_and_writes_inside_take_no_block():
    bm = KVCacheManager(8, BS, kv_allocation="reserve-oracle")
    assert bm.num_blocks_to_admit([], 3, reserve_tokens=10) == 3
    assert bm.admit(1, [5, 6, 7], [], reserve_tokens=10) == 0
    table = list(bm.block_table(1))
    assert len(table) == 3 and bm.num_used_blocks == 3
    for start, n in [(0, 3), (3, 1), (4, 1), (5, 5)]:  # prefill, then decodes up to 10 tokens
        assert bm.num_slots_needed(1, start, n) == 0
        assert bm.allocate_slots(1, start, n) == []
        assert bm.block_table(1) == table and bm.num_used_blocks == 3
        bm.check_integrity()
    assert bm.allocate_slots(1, 10, 3) == []  # beyond the reservation it grows as paged
    assert len(bm.block_table(1)) == 4
    bm.free(1)
    assert bm.num_used_blocks == 0
    bm.check_integrity()


def test_admission_is_refused_until_the_whole_reservation_fits():
    bm = KVCacheManager(5, BS, kv_allocation="reserve-max")
    bm.admit(1, [1, 2], [], reserve_tokens=12)  # 3 blocks; 2 left
    assert bm.num_blocks_to_admit([], 2, reserve_tokens=12) == 3 > bm.num_free_blocks
    with pytest.raises(ValueError, match=r"reserve_tokens: .* 2 free blocks, got 12 tokens "
                                         r"\(3 blocks\)"):
        bm.admit(2, [1, 2], [], reserve_tokens=12)
    assert not bm.is_resident(2) and bm.num_free_blocks == 2  # nothing changed
    bm.free(1)
    bm.admit(2, [1, 2], [], reserve_tokens=12)
    assert len(bm.block_table(2)) == 3
    bm.check_integrity()


def test_prefix_caching_is_off_under_a_reservation():
    bm = KVCacheManager(8, BS, enable_prefix_caching=True, kv_allocation="reserve-pow2")
    tokens = list(range(9))
    bm.admit(1, tokens, [], reserve_tokens=16)
    bm.allocate_slots(1, 0, 9)
    bm.commit(1, tokens, 9)
    assert bm.num_cached_blocks == 0
    bm.free(1)
    assert bm.find_cached_prefix(tokens) == []
    bm.check_integrity()


# ------------------------------------------------------------------------- memory accounting
def check_invariants(stats: KVMemoryStats) -> None:
    assert stats.allocated_slots == (stats.token_slots + stats.reserved_unused_slots
                                     + stats.internal_fragment_slots)
    assert stats.allocated_slots + stats.free_slots == stats.total_slots


def run_two_requests(policy: str) -> KVMemoryStats:
    """Request A (5 prompt tokens, max_tokens 6) has decoded 2 tokens; request B (3 prompt
    tokens, max_tokens 2) has decoded 1: A holds 7 tokens, B 4."""
    bm = KVCacheManager(16, BS, kv_allocation=policy)
    for seq_id, prompt, max_tokens, decoded in [(1, 5, 6, 2), (2, 3, 2, 1)]:
        reserve = reserved_tokens(policy, prompt, max_tokens, 64)
        bm.admit(seq_id, list(range(prompt)), [], reserve_tokens=reserve)
        bm.allocate_slots(seq_id, 0, prompt)
        for i in range(decoded):
            bm.allocate_slots(seq_id, prompt + i, 1)
    bm.check_integrity()
    return bm.memory_stats()


def test_memory_stats_paged_against_reserve_oracle_on_the_same_requests():
    paged = run_two_requests("paged")
    # A: blocks [4 tokens][3 tokens + 1 empty]; B: [4 tokens].
    assert paged == KVMemoryStats(total_slots=64, allocated_slots=12, token_slots=11,
                                  reserved_unused_slots=0, internal_fragment_slots=1,
                                  free_slots=52, shared_blocks_saved=0)
    oracle = run_two_requests("reserve-oracle")
    # A reserves 11 slots (3 blocks): its third block is unused; B reserves 5 (2 blocks).
    assert oracle == KVMemoryStats(total_slots=64, allocated_slots=20, token_slots=11,
                                   reserved_unused_slots=8, internal_fragment_slots=1,
                                   free_slots=44, shared_blocks_saved=0)
    check_invariants(paged)
    check_invariants(oracle)


def test_memory_stats_count_a_shared_block_once_and_the_blocks_sharing_saves():
    bm = KVCacheManager(16, BS)
    bm.admit(1, list(range(6)), [])
    bm.allocate_slots(1, 0, 6)  # [4][2 + 2 empty]
    for child in (2, 3):
        bm.fork(1, child)
    stats = bm.memory_stats()
    assert (stats.allocated_slots, stats.token_slots, stats.internal_fragment_slots) == (8, 6, 2)
    assert stats.shared_blocks_saved == 4  # two blocks, each held three times
    assert bm.allocate_slots(2, 6, 1) != []  # copy-on-write of the partial block
    stats = bm.memory_stats()
    # Blocks: [4] shared by three; [2 + 2 empty] shared by 1 and 3; 2's private copy [3 + 1].
    assert (stats.allocated_slots, stats.token_slots, stats.internal_fragment_slots) == (12, 9, 3)
    assert stats.shared_blocks_saved == 3
    check_invariants(stats)
    bm.check_integrity()


def test_memory_stats_follow_a_swapped_sequence_out_and_back():
    bm = KVCacheManager(8, BS, num_host_blocks=8, kv_allocation="reserve-oracle")
    bm.admit(1, [1, 2, 3], [], reserve_tokens=9)
    bm.allocate_slots(1, 0, 5)
    before = bm.memory_stats()
    assert (before.token_slots, before.reserved_unused_slots,
            before.internal_fragment_slots) == (5, 4, 3)
    assert bm.swap_out([1]) is not None
    gone = bm.memory_stats()
    assert (gone.allocated_slots, gone.token_slots, gone.free_slots) == (0, 0, 32)
    bm.check_integrity()
    assert bm.swap_in([1]) is not None
    assert bm.memory_stats() == before  # the whole table, reserved blocks included, came back
    bm.check_integrity()


# ----------------------------------------------------------------------- with the real model
TEXTS = ["The capital of France is", "1, 2, 3,"]


@pytest.fixture(scope="module")
def loaded():
    from engine.model.loader import load_model

    return load_model(None, dtype=torch.float32)


def test_greedy_output_does_not_depend_on_the_memory_policy(loaded):
    params = SamplingParams(temperature=0.0, max_tokens=5)
    prompts = [{"prompt_token_ids": loaded.tokenizer.encode(t)} for t in TEXTS]
    results = {}
    for policy in ("paged", "reserve-oracle"):
        llm = LLM(model=loaded, num_kv_blocks=64, block_size=4, kv_fill=float("nan"),
                  kv_allocation=policy)
        results[policy] = [o.outputs[0].token_ids
                           for o in llm.generate(prompts, params, use_tqdm=False)]
        eng = llm.llm_engine
        eng.check_integrity()
        assert eng.kv_cache_manager.num_used_blocks == 0
        # Both run together: paged holds the 4 computed output tokens' blocks at the end,
        # reserve-oracle reserved room for all 5 (the last one sampled is never computed).
        extra = 5 if policy == "reserve-oracle" else 4
        assert eng.kv_cache_manager.peak_used_blocks == sum(
            -(-(len(p["prompt_token_ids"]) + extra) // 4) for p in prompts)
    assert results["reserve-oracle"] == results["paged"]
    assert all(len(t) == 5 for t in results["paged"])


@pytest.mark.parametrize("policy", [p for p in KV_ALLOCATIONS if p != "paged"])
def test_requests_that_share_blocks_are_refused_under_a_reservation(loaded, policy):
    llm = LLM(model=loaded, num_kv_blocks=64, block_size=4, max_model_len=64,
              kv_allocation=policy)
    message = rf"kv_allocation: expected 'paged' for n=2 .*got '{policy}'"
    with pytest.raises(ValueError, match=message):
        llm.generate("Hello", SamplingParams(n=2, max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match=r"kv_allocation: expected 'paged' for beam search"):
        llm.beam_search("Hello", BeamSearchParams(beam_width=2, max_tokens=2))
    assert not llm.llm_engine.has_unfinished_requests()
    assert llm.llm_engine.kv_cache_manager.num_used_blocks == 0


def test_a_request_whose_reservation_can_never_fit_is_refused(loaded):
    """Under reserve-max every request needs max_model_len = 64 slots (16 blocks of 4)."""
    llm = LLM(model=loaded, num_kv_blocks=15, block_size=4, max_model_len=64,
              kv_allocation="reserve-max")
    with pytest.raises(ValueError, match=r"num_kv_blocks: .* may need 16 blocks; expected a "
                                         r"pool of at least that, got 15"):
        llm.generate("Hello", SamplingParams(max_tokens=2), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    paged = LLM(model=loaded, num_kv_blocks=15, block_size=4, max_model_len=64)
    assert len(paged.generate("Hello", SamplingParams(max_tokens=2),
                              use_tqdm=False)[0].outputs[0].token_ids) == 2
