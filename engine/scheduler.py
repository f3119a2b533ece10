"""Continuous batching under a token budget, with preemption (vLLM v1's design, plus swap).

Each step, `schedule()` hands out at most `max_num_batched_tokens` tokens to at most
`max_num_seqs` sequences: first to running requests in arrival order (each sequence gets
`min(uncomputed tokens, budget left)`, so a long prompt is prefilled in chunks while others
decode in the same step), then to swapped requests (swapped back in) and waiting ones (admitted
with the longest cached prefix of their tokens). When a running request needs blocks that are
not free, the latest-arriving running request is preempted (first come, first served): by
recompute (its blocks go back to the pool, still cached, and it rejoins the front of the waiting
queue) or by swap (its blocks go to the host pool and come back before it runs again). No request
is swapped in or admitted in a step that preempted.

Under a contiguous-reservation policy (`EngineConfig.kv_allocation`, engine/kv_allocation.py) a
waiting sequence is admitted only when the whole reservation of its request (from its prompt
length and its `max_tokens` resolved against `max_model_len`) fits in the free blocks; a
recompute-preempted sequence gives its reservation back and reserves again when readmitted.

Speculative decoding (engine/spec_decode/): when `lookahead` is set, a running sequence that
decodes (one uncomputed token, some output) gets `lookahead(seq)` extra slots for the tokens the
proposer will guess, capped by the budget left, `max_model_len` and its `max_tokens`; they count
against the token budget. When the running batch's blocks run short, its lookahead is dropped
before anything is preempted. Swapped-in sequences and `schedule_seqs` get none.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from engine.block_pool import BlockCopy
from engine.config import EngineConfig
from engine.kv_allocation import reserved_tokens, resolved_max_tokens
from engine.kv_cache_manager import KVCacheManager
from engine.request import Sequence, SequenceGroup, SequenceStatus


@dataclass
class SchedulerOutput:
    """One step's work: `(sequence, number of its next tokens to compute)` in batch order, and
    the block moves the runner performs before the forward, in this order: `swap_out`
    (device -> host), `swap_in` (host -> device), `block_copies` (copy-on-write).

    `lookahead`: sequence id -> extra slots allocated after its scheduled tokens for proposals
    (speculative decoding); `drafts`: sequence id -> the proposed token ids the step computes
    after its scheduled tokens (filled by `LLMEngine.execute_step`, at most `lookahead`)."""

    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)
    block_copies: list[BlockCopy] = field(default_factory=list)
    swap_out: list[BlockCopy] = field(default_factory=list)
    swap_in: list[BlockCopy] = field(default_factory=list)
    preempted: list[SequenceGroup] = field(default_factory=list)
    lookahead: dict[int, int] = field(default_factory=dict)
    drafts: dict[int, list[int]] = field(default_factory=dict)

    @property
    def num_batched_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    @property
    def is_empty(self) -> bool:
        """Nothing to compute and no block to move."""
        return not (self.scheduled or self.swap_in or self.swap_out or self.block_copies)


class Scheduler:
    """Owns the waiting, running and swapped queues and decides each step's batch.

    `max_model_len` is the engine's resolved limit (default: `config.max_model_len`); a
    reservation policy needs one (ValueError when neither is given). `lookahead`: None, or
    how many tokens a decoding sequence would speculate (see the module docstring)."""

    def __init__(self, config: EngineConfig, kv_cache_manager: KVCacheManager,
                 max_model_len: Optional[int] = None) -> None:
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        self.max_model_len = max_model_len or config.max_model_len
        if config.kv_allocation != "paged" and self.max_model_len is None:
            raise ValueError(f"max_model_len: expected an int under kv_allocation="
                             f"{config.kv_allocation!r}, got None")
        self.waiting: deque[SequenceGroup] = deque()
        self.running: list[SequenceGroup] = []
        self.swapped: list[SequenceGroup] = []  # sorted by arrival
        self.num_preemptions = 0
        self.lookahead: Optional[Callable[[Sequence], int]] = None

    # ------------------------------------------------------------------ queues
    def add(self, group: SequenceGroup) -> None:
        """Queues a new request (its sequences are WAITING)."""
        self.waiting.append(group)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    @property
    def num_running_seqs(self) -> int:
        return sum(len(g.unfinished_seqs()) for g in self.running)

    def groups(self) -> list[SequenceGroup]:
        return [*self.running, *self.swapped, *self.waiting]

    def abort(self, request_id: str) -> Optional[SequenceGroup]:
        """Finishes the request wherever it is and frees everything it holds; None if unknown."""
        for queue in (self.running, self.swapped, self.waiting):
            for group in queue:
                if group.request_id == request_id:
                    queue.remove(group)
                    for seq in group.unfinished_seqs():
                        self.finish_seq(seq, SequenceStatus.FINISHED_ABORTED)
                    return group
        return None

    def finish_seq(self, seq: Sequence, status: SequenceStatus) -> None:
        """Marks a sequence finished and frees its blocks (its group leaves `running` once all
        of its sequences are finished, in `remove_finished`)."""
        seq.status = status
        self.kv_cache_manager.free(seq.seq_id)

    def remove_finished(self) -> list[SequenceGroup]:
        """Drops finished groups from the running queue; returns them."""
        done = [g for g in self.running if g.is_finished]
        if done:
            self.running = [g for g in self.running if not g.is_finished]
        return done

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Registers `child` (already built from `parent`) as running, sharing parent's blocks."""
        self.kv_cache_manager.fork(parent.seq_id, child.seq_id)
        child.status = SequenceStatus.RUNNING
        parent.group.seqs.append(child)

    # ---------------------------------------------------------------- schedule
    def schedule(self) -> SchedulerOutput:
        """Decides this step's batch; see the module docstring for the policy."""
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        budget = self._schedule_running(out, budget)
        if not out.preempted:
            budget = self._schedule_swapped(out, budget)
            self._schedule_waiting(out, budget)
        return out

    def admit(self, seq: Sequence) -> None:
        """Gives a sequence that no queue holds (beam search drives its own) a block table that
        starts with the longest cached prefix of its tokens, and marks it RUNNING."""
        self._admit(seq, self.kv_cache_manager.find_cached_prefix(seq.token_ids))

    def schedule_seqs(self, seqs: list[Sequence]) -> Optional[SchedulerOutput]:
        """One step's work for resident sequences that no queue holds: the token budget shared
        in the order of `seqs` as `schedule` shares it, at most `max_num_seqs` sequences, their
        slots allocated. None when blocks run out (the sequences keep the slots allocated before
        that; free them). Sequences left without tokens go in a later call."""
        shares = self._give_tokens(seqs, self.config.max_num_batched_tokens,
                                   self.config.max_num_seqs)
        out = SchedulerOutput()
        return out if self._allocate(out, shares) else None

    def _num_seqs_scheduled(self) -> int:
        return sum(g.num_seqs_needed for g in self.running)

    def _give_tokens(self, seqs: list[Sequence], budget: int, max_seqs: Optional[int] = None,
                     speculate: bool = False) -> list[tuple[Sequence, int]]:
        """Shares of `budget` in the order of `seqs`: each sequence gets `min(its uncomputed
        tokens, budget left)`, plus its lookahead when `speculate`; those given nothing get no
        share; at most `max_seqs` shares."""
        shares: list[tuple[Sequence, int]] = []
        for seq in seqs:
            if len(shares) == max_seqs:
                break
            n = min(seq.num_uncomputed_tokens, budget)
            if speculate and n == 1:
                n += self._num_lookahead(seq, budget - 1)
            if n > 0:
                shares.append((seq, n))
                budget -= n
        return shares

    def _num_lookahead(self, seq: Sequence, room: int) -> int:
        """Extra slots for a decoding sequence's proposals: `lookahead(seq)` capped by `room`
        (budget), `max_model_len` (positions) and `max_tokens` (no proposal past the last
        output token)."""
        if self.lookahead is None or seq.num_uncomputed_tokens != 1 \
                or not seq.output_token_ids:
            return 0
        k = min(self.lookahead(seq), room)
        if self.max_model_len is not None:
            k = min(k, self.max_model_len - seq.num_tokens)
        max_tokens: Any = seq.group.params.max_tokens
        if max_tokens is not None:
            k = min(k, max_tokens - len(seq.output_token_ids) - 1)
        return max(0, k)

    def _blocks_needed(self, shares: list[tuple[Sequence, int]]) -> int:
        kvm = self.kv_cache_manager
        return sum(kvm.num_slots_needed(s.seq_id, s.num_computed_tokens, n) for s, n in shares)

    def _allocate(self, out: SchedulerOutput, shares: list[tuple[Sequence, int]]) -> bool:
        """Allocates each share's slots in order and adds the share and its copy-on-write copies
        to `out`; False at the first share whose blocks are short (earlier ones stay in `out`)."""
        for seq, n in shares:
            copies = self.kv_cache_manager.allocate_slots(seq.seq_id, seq.num_computed_tokens, n)
            if copies is None:
                return False
            out.block_copies.extend(copies)
            extra = n - min(n, seq.num_uncomputed_tokens)
            out.scheduled.append((seq, n - extra))
            if extra:
                out.lookahead[seq.seq_id] = extra
        return True

    def _allocate_checked(self, out: SchedulerOutput, shares: list[tuple[Sequence, int]]
                          ) -> None:
        allocated = self._allocate(out, shares)
        assert allocated, "allocation checked by _blocks_needed"

    def reservation(self, seq: Sequence) -> Optional[int]:
        """The slots the sequence reserves at admission under the configured `kv_allocation`
        (None under "paged"): from its prompt length and its request's `max_tokens`."""
        if self.config.kv_allocation == "paged":
            return None
        limit = self.max_model_len
        assert limit is not None, "checked in __init__"
        prompt_len = seq.num_prompt_tokens
        output = resolved_max_tokens(seq.group.params.max_tokens, prompt_len, limit)
        return reserved_tokens(self.config.kv_allocation, prompt_len, output, limit)

    def _admit(self, seq: Sequence, cached: list[int]) -> None:
        seq.num_computed_tokens = self.kv_cache_manager.admit(seq.seq_id, seq.token_ids, cached,
                                                              self.reservation(seq))
        seq.status = SequenceStatus.RUNNING

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            group = self.running[i]
            seqs = group.seqs_with_status(SequenceStatus.RUNNING)
            speculate = self.lookahead is not None
            shares = self._give_tokens(seqs, budget, speculate=speculate)
            if speculate and self._blocks_needed(shares) > self.kv_cache_manager.num_free_blocks:
                shares = self._give_tokens(seqs, budget)  # no lookahead before preempting
            while self._blocks_needed(shares) > self.kv_cache_manager.num_free_blocks:
                victim = self.running.pop()
                self._preempt(victim, out)
                if victim is group:
                    shares = []
                    break
            if not shares:
                i += 1
                continue
            self._allocate_checked(out, shares)
            budget -= sum(n for _, n in shares)
            i += 1
        return budget

    def _schedule_swapped(self, out: SchedulerOutput, budget: int) -> int:
        kvm = self.kv_cache_manager
        while self.swapped and budget > 0:
            group = self.swapped[0]
            seqs = group.seqs_with_status(SequenceStatus.SWAPPED)
            if self._num_seqs_scheduled() + group.num_seqs_needed > self.config.max_num_seqs:
                break
            ids = [s.seq_id for s in seqs]
            # One spare block per sequence covers its next token (append or copy-on-write).
            if kvm.num_blocks_to_swap_in(ids) + len(seqs) > kvm.num_free_blocks:
                break
            self.swapped.pop(0)
            out.swap_in.extend(kvm.swap_in(ids) or [])
            for seq in seqs:
                seq.status = SequenceStatus.RUNNING
            self.running.append(group)
            shares = self._give_tokens(group.seqs_with_status(SequenceStatus.RUNNING), budget)
            if self._blocks_needed(shares) > kvm.num_free_blocks:
                break  # stays running without tokens this step
            self._allocate_checked(out, shares)
            budget -= sum(n for _, n in shares)
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        kvm = self.kv_cache_manager
        while self.waiting and budget > 0:
            group = self.waiting[0]
            if self._num_seqs_scheduled() + group.num_seqs_needed > self.config.max_num_seqs:
                break
            seqs = group.seqs_with_status(SequenceStatus.WAITING)
            plan = []
            needed, left = 0, budget
            for seq in seqs:
                hits = kvm.find_cached_prefix(seq.token_ids)
                done = len(hits) * kvm.block_size
                n = min(seq.num_tokens - done, left)
                left -= n
                needed += kvm.num_blocks_to_admit(hits, done + n, self.reservation(seq))
                plan.append((seq, hits, n))
            if needed > kvm.num_free_blocks:
                break
            self.waiting.popleft()
            for seq, hits, n in plan:
                self._admit(seq, hits)
                if n > 0:
                    self._allocate_checked(out, [(seq, n)])
            self.running.append(group)
            budget = left

    # -------------------------------------------------------------- preemption
    def _preempt(self, group: SequenceGroup, out: SchedulerOutput) -> None:
        """Takes a running group off the device (swap if configured and the host pool has room,
        else recompute)."""
        self.num_preemptions += 1
        out.preempted.append(group)
        kvm = self.kv_cache_manager
        seqs = group.seqs_with_status(SequenceStatus.RUNNING)
        ids = [s.seq_id for s in seqs]
        if self.config.preemption_mode == "swap" and kvm.can_swap_out(ids):
            out.swap_out.extend(kvm.swap_out(ids) or [])
            for seq in seqs:
                seq.status = SequenceStatus.SWAPPED
            keys = [g.arrival_time for g in self.swapped]
            self.swapped.insert(bisect.bisect_right(keys, group.arrival_time), group)
            return
        for seq in seqs:
            kvm.free(seq.seq_id)
            seq.reset_for_recompute()
        self.waiting.appendleft(group)
