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
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

from engine.block_manager import BlockCopy, BlockManager
from engine.config import EngineConfig
from engine.request import Sequence, SequenceGroup, SequenceStatus


@dataclass
class SchedulerOutput:
    """One step's work: `(sequence, number of its next tokens to compute)` in batch order, and
    the block moves the runner performs before the forward, in this order: `swap_out`
    (device -> host), `swap_in` (host -> device), `block_copies` (copy-on-write)."""

    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)
    block_copies: list[BlockCopy] = field(default_factory=list)
    swap_out: list[BlockCopy] = field(default_factory=list)
    swap_in: list[BlockCopy] = field(default_factory=list)
    preempted: list[SequenceGroup] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    @property
    def is_empty(self) -> bool:
        """Nothing to compute and no block to move."""
        return not (self.scheduled or self.swap_in or self.swap_out or self.block_copies)


class Scheduler:
    """Owns the waiting, running and swapped queues and decides each step's batch."""

    def __init__(self, config: EngineConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[SequenceGroup] = deque()
        self.running: list[SequenceGroup] = []
        self.swapped: list[SequenceGroup] = []  # sorted by arrival
        self.num_preemptions = 0

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
        self.block_manager.free(seq.seq_id)

    def remove_finished(self) -> list[SequenceGroup]:
        """Drops finished groups from the running queue; returns them."""
        done = [g for g in self.running if g.is_finished]
        if done:
            self.running = [g for g in self.running if not g.is_finished]
        return done

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Registers `child` (already built from `parent`) as running, sharing parent's blocks."""
        self.block_manager.fork(parent.seq_id, child.seq_id)
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

    def _num_seqs_scheduled(self) -> int:
        return sum(g.num_seqs_needed for g in self.running)

    def _give_tokens(self, group: SequenceGroup, budget: int) -> list[tuple[Sequence, int]]:
        """Each running sequence's share of the budget, in order."""
        shares = []
        for seq in group.seqs_with_status(SequenceStatus.RUNNING):
            n = min(seq.num_uncomputed_tokens, budget)
            if n > 0:
                shares.append((seq, n))
                budget -= n
        return shares

    def _blocks_needed(self, shares: list[tuple[Sequence, int]]) -> int:
        bm = self.block_manager
        return sum(bm.num_slots_needed(s.seq_id, s.num_computed_tokens, n) for s, n in shares)

    def _allocate(self, out: SchedulerOutput, shares: list[tuple[Sequence, int]]) -> None:
        for seq, n in shares:
            copies = self.block_manager.allocate_slots(seq.seq_id, seq.num_computed_tokens, n)
            assert copies is not None, "allocation checked by _blocks_needed"
            out.block_copies.extend(copies)
            out.scheduled.append((seq, n))

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            group = self.running[i]
            shares = self._give_tokens(group, budget)
            while self._blocks_needed(shares) > self.block_manager.num_free_blocks:
                victim = self.running.pop()
                self._preempt(victim, out)
                if victim is group:
                    shares = []
                    break
            if not shares:
                i += 1
                continue
            self._allocate(out, shares)
            budget -= sum(n for _, n in shares)
            i += 1
        return budget

    def _schedule_swapped(self, out: SchedulerOutput, budget: int) -> int:
        bm = self.block_manager
        while self.swapped and budget > 0:
            group = self.swapped[0]
            seqs = group.seqs_with_status(SequenceStatus.SWAPPED)
            if self._num_seqs_scheduled() + group.num_seqs_needed > self.config.max_num_seqs:
                break
            ids = [s.seq_id for s in seqs]
            # One spare block per sequence covers its next token (append or copy-on-write).
            if bm.num_blocks_to_swap_in(ids) + len(seqs) > bm.num_free_blocks:
                break
            self.swapped.pop(0)
            out.swap_in.extend(bm.swap_in(ids) or [])
            for seq in seqs:
                seq.status = SequenceStatus.RUNNING
            self.running.append(group)
            shares = self._give_tokens(group, budget)
            if self._blocks_needed(shares) > bm.num_free_blocks:
                break  # stays running without tokens this step
            self._allocate(out, shares)
            budget -= sum(n for _, n in shares)
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        bm = self.block_manager
        while self.waiting and budget > 0:
            group = self.waiting[0]
            if self._num_seqs_scheduled() + group.num_seqs_needed > self.config.max_num_seqs:
                break
            seqs = group.seqs_with_status(SequenceStatus.WAITING)
            plan = []
            needed, left = 0, budget
            for seq in seqs:
                hits = bm.find_cached_prefix(seq.token_ids)
                done = len(hits) * bm.block_size
                n = min(seq.num_tokens - done, left)
                left -= n
                needed += bm.num_blocks_to_admit(hits, done + n)
                plan.append((seq, hits, n))
            if needed > bm.num_free_blocks:
                break
            self.waiting.popleft()
            for seq, hits, n in plan:
                seq.num_computed_tokens = bm.admit(seq.seq_id, seq.token_ids, hits)
                seq.status = SequenceStatus.RUNNING
                if n > 0:
                    self._allocate(out, [(seq, n)])
            self.running.append(group)
            budget = left

    # -------------------------------------------------------------- preemption
    def _preempt(self, group: SequenceGroup, out: SchedulerOutput) -> None:
        """Takes a running group off the device (swap if configured and the host pool has room,
        else recompute)."""
        self.num_preemptions += 1
        out.preempted.append(group)
        bm = self.block_manager
        seqs = group.seqs_with_status(SequenceStatus.RUNNING)
        ids = [s.seq_id for s in seqs]
        if self.config.preemption_mode == "swap" and bm.can_swap_out(ids):
            out.swap_out.extend(bm.swap_out(ids) or [])
            for seq in seqs:
                seq.status = SequenceStatus.SWAPPED
            keys = [g.arrival_time for g in self.swapped]
            self.swapped.insert(bisect.bisect_right(keys, group.arrival_time), group)
            return
        for seq in seqs:
            bm.free(seq.seq_id)
            seq.reset_for_recompute()
        self.waiting.appendleft(group)
