"""Tests of engine.scheduler with a simulated model: no weights, a KV "memory" of token ids.

The fake engine loop applies each step's swap-out, swap-in and copy-on-write moves to the
simulated memory in the runner's order, writes the scheduled tokens' ids into their slots, checks
that every scheduled sequence reads back its own tokens through its block table (what attention
would read), then "samples" a deterministic next token. That tests the scheduler and the KV cache
manager together by effect: budgets, chunked prefill, preemption by recompute and swap, abort, no
leaks. Sequences outside the queues (as beam search drives them) go through `admit` and
`schedule_seqs`.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from engine.config import EngineConfig
from engine.kv_cache_manager import KVCacheManager
from engine.request import Sequence, SequenceGroup, SequenceStatus
from engine.scheduler import Scheduler


class FakeEngine:
    def __init__(self, **config) -> None:
        num_blocks = config.pop("num_kv_blocks")
        host = config.pop("num_host_blocks", 0)
        self.config = EngineConfig(num_kv_blocks=num_blocks, num_host_blocks=host, **config)
        self.bm = KVCacheManager(num_blocks, self.config.block_size, host,
                                 self.config.enable_prefix_caching, self.config.kv_allocation)
        self.scheduler = Scheduler(self.config, self.bm)
        self.memory: dict[int, int] = {}
        self.host: dict[int, int] = {}
        self.next_seq_id = 0
        self.steps = []
        self.finished: dict[str, SequenceGroup] = {}

    def add(self, request_id: str, prompt: list[int], max_tokens: int, n: int = 1,
            arrival: float = 0.0) -> SequenceGroup:
        group = SequenceGroup(request_id, prompt, SimpleNamespace(n=n, max_tokens=max_tokens),
                              arrival, self.next_seq_id, num_seqs=n)
        self.next_seq_id += 1
        self.scheduler.add(group)
        return group

    def _move(self, src: dict, dst: dict, pairs) -> None:
        bs = self.config.block_size
        for s, d in pairs:
            for o in range(bs):
                dst[d * bs + o] = src.get(s * bs + o)

    def step(self) -> None:
        out = self.scheduler.schedule()
        bs = self.config.block_size
        assert out.num_batched_tokens <= self.config.max_num_batched_tokens
        assert len(out.scheduled) <= self.config.max_num_seqs
        self._move(self.memory, self.host, out.swap_out)
        self._move(self.host, self.memory, out.swap_in)
        self._move(self.memory, self.memory, out.block_copies)
        for seq, n in out.scheduled:
            table = self.bm.block_table(seq.seq_id)
            for p in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
                self.memory[table[p // bs] * bs + p % bs] = seq.token_ids[p]
        for seq, n in out.scheduled:  # what attention would read
            end = seq.num_computed_tokens + n
            table = self.bm.block_table(seq.seq_id)
            got = [self.memory.get(table[p // bs] * bs + p % bs) for p in range(end)]
            assert got == seq.token_ids[:end], f"{seq} reads wrong K/V"
        self.steps.append(out)
        for seq, n in out.scheduled:
            seq.num_computed_tokens += n
            self.bm.commit(seq.seq_id, seq.token_ids, seq.num_computed_tokens)
        for seq, _ in out.scheduled:
            if seq.num_uncomputed_tokens == 0 and not seq.is_finished:
                self._sample(seq)
        for group in self.scheduler.remove_finished():
            self.finished[group.request_id] = group
        self.bm.check_integrity()

    def _sample(self, seq: Sequence) -> None:
        group = seq.group
        targets = [seq]
        if not group.forked:
            group.forked = True
            for i in range(1, group.num_seqs_reserved):
                child = seq.fork(self.next_seq_id, i)
                self.next_seq_id += 1
                self.scheduler.fork(seq, child)
                targets.append(child)
        for s in targets:
            s.append_token(1000 + 10 * s.index + len(s.output_token_ids), 0.0)
            if len(s.output_token_ids) >= group.params.max_tokens:
                self.scheduler.finish_seq(s, SequenceStatus.FINISHED_LENGTH)

    def run(self, max_steps: int = 2000) -> None:
        for _ in range(max_steps):
            if not self.scheduler.has_unfinished():
                return
            self.step()
        raise AssertionError("did not finish")

    def assert_clean(self) -> None:
        self.bm.check_integrity()
        assert self.bm.num_used_blocks == 0, "blocks leaked"
        assert not self.scheduler.has_unfinished()


def prompts(seed: int, count: int, low: int = 3, high: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(50) for _ in range(rng.randint(low, high))] for _ in range(count)]


def expected_outputs(n_tokens: int, index: int = 0) -> list[int]:
    return [1000 + 10 * index + i for i in range(n_tokens)]


def test_all_requests_finish_with_budgets_respected():
    eng = FakeEngine(num_kv_blocks=64, block_size=4, max_num_seqs=3, max_num_batched_tokens=16)
    for i, p in enumerate(prompts(0, 7)):
        eng.add(f"r{i}", p, max_tokens=5)
    eng.run()
    assert all(g.seqs[0].output_token_ids == expected_outputs(5) for g in eng.finished.values())
    assert len(eng.finished) == 7
    eng.assert_clean()


def test_chunked_prefill_mixes_with_decode_in_one_step():
    eng = FakeEngine(num_kv_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=8)
    eng.add("short", [1, 2, 3], max_tokens=6)
    eng.step()  # prefill of the short prompt
    eng.add("long", list(range(30)), max_tokens=2)
    eng.step()
    sizes = {s.group.request_id: n for s, n in eng.steps[-1].scheduled}
    assert sizes == {"short": 1, "long": 7}  # decode and a prefill chunk in one step
    eng.run()
    assert eng.finished["long"].seqs[0].output_token_ids == expected_outputs(2)
    eng.assert_clean()


@pytest.mark.parametrize("mode,host", [("recompute", 0), ("swap", 40), ("swap", 3)])
def test_preemption_with_a_tiny_pool_finishes_everything(mode, host):
    """("swap", 3): the host pool is too small for some requests, which are recomputed."""
    eng = FakeEngine(num_kv_blocks=10, block_size=4, max_num_seqs=4, max_num_batched_tokens=64,
                     preemption_mode=mode, num_host_blocks=host)
    for i, p in enumerate(prompts(1, 5, 6, 12)):
        eng.add(f"r{i}", p, max_tokens=12, arrival=float(i))
    eng.run()
    assert eng.scheduler.num_preemptions > 0
    if mode == "swap":
        assert any(s.swap_out for s in eng.steps) and any(s.swap_in for s in eng.steps)
    for g in eng.finished.values():
        assert g.seqs[0].output_token_ids == expected_outputs(12)
    eng.assert_clean()


def test_preemption_takes_the_latest_arrival_first():
    eng = FakeEngine(num_kv_blocks=6, block_size=4, max_num_seqs=4, max_num_batched_tokens=64,
                     enable_prefix_caching=False)
    eng.add("old", [1] * 8, max_tokens=12, arrival=0.0)
    eng.add("new", [2] * 8, max_tokens=12, arrival=1.0)
    while not eng.scheduler.num_preemptions:
        eng.step()
    assert [g.request_id for g in eng.steps[-1].preempted] == ["new"]
    eng.run()
    eng.assert_clean()


def test_n_samples_fork_and_share_prompt_blocks():
    eng = FakeEngine(num_kv_blocks=32, block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    g = eng.add("r", list(range(10)), max_tokens=3, n=4)
    eng.step()
    assert len(g.seqs) == 4
    assert eng.bm.num_used_blocks == 3  # the prompt's 3 blocks, shared by all four
    eng.step()  # each writes into the shared partial block: three copies, one in place
    assert len(eng.steps[-1].block_copies) == 3 and eng.bm.num_used_blocks == 6
    eng.run()
    assert sorted(s.output_token_ids[0] for s in g.seqs) == [1000, 1010, 1020, 1030]
    eng.assert_clean()


def test_prefix_cache_hit_skips_computed_blocks():
    eng = FakeEngine(num_kv_blocks=32, block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    p = list(range(13))
    eng.add("a", p, max_tokens=1)
    eng.run()
    eng.add("b", p, max_tokens=1)
    eng.step()
    assert eng.steps[-1].scheduled[0][1] == 1  # 12 tokens cached, one computed
    eng.run()
    assert eng.bm.prefix_cache_hits == 12
    eng.assert_clean()


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_abort_at_any_point_frees_everything(mode):
    for seed in range(6):
        rng = random.Random(seed)
        eng = FakeEngine(num_kv_blocks=12, block_size=4, max_num_seqs=3,
                         max_num_batched_tokens=12, preemption_mode=mode, num_host_blocks=12)
        for i, p in enumerate(prompts(seed, 6, 4, 16)):
            eng.add(f"r{i}", p, max_tokens=8, n=rng.choice([1, 2]), arrival=float(i))
        for _ in range(200):
            if not eng.scheduler.has_unfinished():
                break
            if rng.random() < 0.2:
                live = [g.request_id for g in eng.scheduler.groups()]
                aborted = eng.scheduler.abort(rng.choice(live))
                assert aborted is not None and aborted.is_finished
                eng.bm.check_integrity()
            else:
                eng.step()
        eng.run()
        eng.assert_clean()
        assert eng.scheduler.abort("nonexistent") is None


# ----------------------------------------------------------- contiguous-reservation baselines
def reservation_blocks(eng: FakeEngine, seq: Sequence) -> int:
    return -(-eng.scheduler.reservation(seq) // eng.config.block_size)


@pytest.mark.parametrize("policy, running", [("paged", 3), ("reserve-oracle", 2),
                                             ("reserve-pow2", 2), ("reserve-max", 1)])
def test_a_request_is_admitted_only_when_its_whole_reservation_fits(policy, running):
    """Prompts of 6 tokens with max_tokens 6 in 8 blocks of 4: paged admits all three (2 blocks
    each for the prompt); oracle reserves 12 tokens (3 blocks), pow2 16 (4), max 32 (8)."""
    eng = FakeEngine(num_kv_blocks=8, block_size=4, max_num_seqs=4, max_num_batched_tokens=64,
                     max_model_len=32, kv_allocation=policy)
    for i in range(3):
        eng.add(f"r{i}", [i] * 6, max_tokens=6, arrival=float(i))
    eng.step()
    assert len(eng.scheduler.running) == running
    while eng.scheduler.has_unfinished():
        for group in eng.scheduler.running:  # no block taken inside a reservation
            seq = group.seqs[0]
            if policy != "paged" and not seq.is_finished:
                assert len(eng.bm.block_table(seq.seq_id)) == reservation_blocks(eng, seq)
        eng.step()
    if policy != "paged":  # a reservation covers the whole life: never preempted
        assert eng.scheduler.num_preemptions == 0
    assert len(eng.finished) == 3
    for g in eng.finished.values():
        assert g.seqs[0].output_token_ids == expected_outputs(6)
    eng.assert_clean()


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_frees_the_reservation_and_readmission_reserves_again(mode, monkeypatch):
    """A step in which the oldest request claims more blocks than are free (as if it outgrew
    its reservation) preempts the newest: recompute frees its whole reservation, swap moves it."""
    eng = FakeEngine(num_kv_blocks=8, block_size=4, max_num_seqs=4, max_num_batched_tokens=64,
                     max_model_len=32, kv_allocation="reserve-oracle", preemption_mode=mode,
                     num_host_blocks=8)
    old = eng.add("old", [1] * 6, max_tokens=6, arrival=0.0).seqs[0]
    new = eng.add("new", [2] * 6, max_tokens=6, arrival=1.0).seqs[0]
    eng.step()
    eng.step()
    blocks = reservation_blocks(eng, new)
    assert eng.bm.num_used_blocks == 2 * blocks == 6
    real = eng.scheduler._blocks_needed
    forced = []

    def claim_once(shares):
        if not forced:
            forced.append(True)
            return real(shares) + eng.bm.num_free_blocks + 1
        return real(shares)

    monkeypatch.setattr(eng.scheduler, "_blocks_needed", claim_once)
    eng.step()
    assert [g.request_id for g in eng.steps[-1].preempted] == ["new"]
    assert eng.bm.num_used_blocks == blocks and not eng.bm.is_resident(new.seq_id)
    if mode == "swap":
        assert eng.bm.num_host_blocks - eng.bm.num_free_host_blocks == blocks
    else:
        assert new.status is SequenceStatus.WAITING and new.num_computed_tokens == 0
    eng.step()
    assert len(eng.bm.block_table(new.seq_id)) == blocks
    eng.run()
    assert old.output_token_ids == new.output_token_ids == expected_outputs(6)
    eng.assert_clean()


def outside_seq(eng: FakeEngine, prompt: list[int]) -> Sequence:
    """A sequence that no queue holds, admitted the way beam search admits its first beam."""
    group = SequenceGroup(f"outside-{eng.next_seq_id}", prompt,
                          SimpleNamespace(n=1, max_tokens=1), 0.0, eng.next_seq_id)
    eng.next_seq_id += 1
    eng.scheduler.admit(group.seqs[0])
    return group.seqs[0]


def test_admit_takes_the_cached_prefix_and_runs_the_sequence():
    eng = FakeEngine(num_kv_blocks=16, block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    p = list(range(10))
    eng.add("a", p, max_tokens=1)
    eng.run()
    seq = outside_seq(eng, p + [77])
    assert seq.status is SequenceStatus.RUNNING and seq.num_computed_tokens == 8
    assert eng.bm.block_table(seq.seq_id) == eng.bm.find_cached_prefix(p + [77])
    eng.bm.check_integrity()


@pytest.mark.parametrize("max_seqs,budget,shares", [(3, 8, [5, 3]), (2, 64, [5, 5])])
def test_schedule_seqs_shares_the_budget_in_order_and_allocates_their_slots(max_seqs, budget,
                                                                            shares):
    eng = FakeEngine(num_kv_blocks=16, block_size=4, max_num_seqs=max_seqs,
                     max_num_batched_tokens=budget)
    seqs = [outside_seq(eng, [i] * 5) for i in range(3)]
    out = eng.scheduler.schedule_seqs(seqs)
    assert [(s.seq_id, n) for s, n in out.scheduled] == list(zip([s.seq_id for s in seqs],
                                                                 shares))
    for seq, n in zip(seqs, shares + [0]):
        assert len(eng.bm.block_table(seq.seq_id)) == -(-n // 4)
    eng.bm.check_integrity()


def test_schedule_seqs_copies_a_shared_block_once_and_reports_running_out():
    eng = FakeEngine(num_kv_blocks=3, block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    parent = outside_seq(eng, [1, 2, 3, 4, 5, 6])
    eng.scheduler.schedule_seqs([parent])
    parent.num_computed_tokens = 6
    child = parent.fork(eng.next_seq_id, 0)
    eng.bm.fork(parent.seq_id, child.seq_id)
    for seq in (parent, child):
        seq.token_ids.append(7)
    out = eng.scheduler.schedule_seqs([parent, child])
    shared_last = eng.bm.block_table(child.seq_id)[1]
    assert len(out.block_copies) == 1 and out.block_copies[0][0] == shared_last
    assert [n for _, n in out.scheduled] == [1, 1]
    for seq in (parent, child):
        seq.num_computed_tokens += 1
        seq.token_ids += [8, 9, 10]  # both need a third block; only one is left
    assert eng.scheduler.schedule_seqs([parent, child]) is None
    eng.bm.check_integrity()
