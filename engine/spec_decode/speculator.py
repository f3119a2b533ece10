"""The engine's side of speculative decoding: who speculates how far, proposals, verification
and counters.

`LLMEngine` holds one `Speculator` when `EngineConfig.speculative_config` is set. The scheduler
asks `num_lookahead(seq)` for each decoding sequence and gives it that many extra slots (capped
by the token budget, `max_model_len` and `max_tokens`); `execute_step` calls `move_blocks` then
`propose` after the step's block moves; `step()` hands each speculating sequence's target rows
to `verify`, then `end_step` with the step's time; `sweep` forgets sequences that left the
device.

Who speculates: every decoding sequence of a request without `structured_outputs` (a grammar
would have to be advanced over proposals and rolled back; such requests decode plainly); beam
search drives its own sequences and never speculates.

How far each sequence speculates: `SpecController` (engine/spec_decode/controller.py) picks
0..k per sequence and step to maximise expected output tokens per second, from the sequence's
acceptance rate and the cost of a step with more query rows, which it learns from the engine's
step times (`end_step`); a sequence that does not speculate probes with one token now and then.
So a request whose output copies nothing costs little more than without speculation.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from engine.request import Sequence, SequenceStatus
from engine.sampler import Sampler
from engine.spec_decode.controller import SpecController
from engine.spec_decode.proposer import Proposal, Proposer
from engine.spec_decode.rejection import Verdict, verify
from engine.speculative_config import SpeculativeConfig

@dataclass
class SpecCounters:
    """vLLM's speculative decoding counters since the engine started: verification steps with at
    least one proposal, proposed tokens, accepted tokens, and accepted tokens by position; and
    the controller's choices: `chosen_k[i]` decoding sequences scheduled to propose i tokens
    (before the scheduler's caps; probes included), `num_probes` of them probes."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: tuple[int, ...] = ()
    chosen_k: tuple[int, ...] = ()
    num_probes: int = 0


class Speculator:
    """Speculative decoding for one engine with one proposer (see the module docstring)."""

    def __init__(self, config: SpeculativeConfig, proposer: Proposer, vocab_size: int,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.config = config
        self.proposer = proposer
        self.vocab_size = vocab_size
        self.clock = clock
        self.controller = SpecController(config.num_speculative_tokens)
        self._propose_seconds = 0.0
        self._longest = 0
        self._accepted: dict[int, int] = {}  # accepted proposals per sequence, this step
        self._live: dict[int, Sequence] = {}
        self._proposals: dict[int, Proposal] = {}
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * config.num_speculative_tokens

    # --------------------------------------------------------------- per step
    def num_lookahead(self, seq: Sequence) -> int:
        """How many tokens to propose for a decoding `seq` this step before the scheduler's caps:
        the controller's choice in 0..k, or 0 for a request that does not speculate."""
        if seq.group.params.structured_outputs is not None:
            return 0
        return self.controller.choose(seq.seq_id, len(seq.output_token_ids))

    def move_blocks(self, out: Any) -> None:
        """Forwards the step's block moves to the proposer (its own KV cache, if any)."""
        self.proposer.move_blocks(out)

    def propose(self, out: Any, tables: list[list[int]]) -> dict[int, list[int]]:
        """Proposals for the sequences of `out.lookahead` (`out.scheduled`'s block tables are
        `tables`): their token ids by sequence id, only the non-empty ones; the proposals are
        kept for `verify`. ValueError for a proposer that breaks its contract."""
        rows = [(i, s) for i, (s, _) in enumerate(out.scheduled) if s.seq_id in out.lookahead]
        seqs = [s for _, s in rows]
        ks = [out.lookahead[s.seq_id] for s in seqs]
        started = self.clock()
        proposals = self.proposer.propose(seqs, ks, [tables[i] for i, _ in rows])
        self._propose_seconds += self.clock() - started
        if len(proposals) != len(seqs):
            raise ValueError(f"proposals: expected {len(seqs)} (one per sequence), "
                             f"got {len(proposals)}")
        drafts: dict[int, list[int]] = {}
        for seq, k, proposal in zip(seqs, ks, proposals):
            self._check(proposal, k)
            self._live[seq.seq_id] = seq
            if proposal.token_ids:
                self._longest = max(self._longest, len(proposal.token_ids))
                self._proposals[seq.seq_id] = proposal
                drafts[seq.seq_id] = list(proposal.token_ids)
        return drafts

    def _check(self, proposal: Proposal, k: int) -> None:
        ids = proposal.token_ids
        if len(ids) > k or not all(0 <= t < self.vocab_size for t in ids):
            raise ValueError(f"proposal.token_ids: expected at most {k} ids in "
                             f"[0, {self.vocab_size}), got {ids}")
        if proposal.probs is not None and (
                proposal.probs.dim() != 2 or proposal.probs.shape[0] != len(ids)):
            raise ValueError(f"proposal.probs: expected [{len(ids)}, vocab], got shape "
                             f"{tuple(proposal.probs.shape)}")

    def verify(self, sampler: Sampler, seq: Sequence, logits: torch.Tensor) -> Verdict:
        """Verifies the sequence's proposal of this step against its target rows `logits`
        (engine/spec_decode/rejection.py); updates the controller and the counters."""
        proposal = self._proposals.pop(seq.seq_id)
        verdict = verify(sampler, logits, seq.sampling_state, proposal)
        self._record(seq, len(proposal.token_ids), verdict.num_accepted)
        return verdict

    def _record(self, seq: Sequence, proposed: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        for pos in range(accepted):
            self.accepted_per_pos[pos] += 1
        self._accepted[seq.seq_id] = accepted
        self.controller.record(seq.seq_id, proposed, accepted)

    def end_step(self, out: Any, seconds: float) -> None:
        """The step of `out` (a `SchedulerOutput`) took `seconds` from its block moves to its
        last emitted token: the controller learns the cost of its query rows (the proposer's
        time apart) and each sequence's share of the batch."""
        shares = {seq.seq_id: (n + len(out.drafts.get(seq.seq_id, ())),
                               1 + self._accepted.get(seq.seq_id, 0))
                  for seq, n in out.scheduled}
        if shares:
            self.controller.end_step(shares, seconds, self._propose_seconds, self._longest)
        self._propose_seconds, self._longest = 0.0, 0
        self._accepted.clear()

    def sweep(self) -> None:
        """Tells the proposer to forget every sequence it proposed for that is no longer running
        (preempted, finished or aborted); finished ones leave the controller too."""
        for seq_id, seq in list(self._live.items()):
            if seq.status is not SequenceStatus.RUNNING:
                self.proposer.forget(seq_id)
                del self._live[seq_id]
                self._proposals.pop(seq_id, None)
                if seq.is_finished:
                    self.controller.forget(seq_id)

    def counters(self) -> SpecCounters:
        """A snapshot of the counters."""
        return SpecCounters(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                            tuple(self.accepted_per_pos), tuple(self.controller.chosen),
                            self.controller.num_probes)
