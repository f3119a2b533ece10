"""The engine's side of speculative decoding: who speculates how far, proposals, verification,
back-off and counters.

`LLMEngine` holds one `Speculator` when `EngineConfig.speculative_config` is set. The scheduler
asks `num_lookahead(seq)` for each decoding sequence and gives it that many extra slots (capped
by the token budget, `max_model_len` and `max_tokens`); `execute_step` calls `move_blocks` then
`propose` after the step's block moves; `step()` hands each speculating sequence's target rows
to `verify`; `sweep` forgets sequences that left the device.

Who speculates: every decoding sequence of a request without `structured_outputs` (a grammar
would have to be advanced over proposals and rolled back; such requests decode plainly); beam
search drives its own sequences and never speculates.

Back-off: per sequence, an exponential moving average of the share of proposals accepted. When
it drops under `BACKOFF_THRESHOLD` the sequence stops speculating for a pause of output tokens
(doubling after each back-off, from `PAUSE_MIN` to `PAUSE_MAX`), then probes again from
`PROBE_EMA`; so a request whose output copies nothing costs little more than without.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from engine.request import Sequence, SequenceStatus
from engine.sampler import Sampler
from engine.spec_decode.proposer import Proposal, Proposer
from engine.spec_decode.rejection import Verdict, verify
from engine.speculative_config import SpeculativeConfig

EMA_WEIGHT = 0.5
BACKOFF_THRESHOLD = 0.3
PROBE_EMA = 0.5
PAUSE_MIN = 4
PAUSE_MAX = 256


@dataclass
class _Backoff:
    """One sequence's acceptance average and pause (in output tokens)."""

    ema: float = PROBE_EMA
    pause: int = 0
    resume_at: int = 0  # speculation resumes once the output has this many tokens


@dataclass
class SpecCounters:
    """vLLM's speculative decoding counters since the engine started: verification steps with at
    least one proposal, proposed tokens, accepted tokens, and accepted tokens by position."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: tuple[int, ...] = ()


class Speculator:
    """Speculative decoding for one engine with one proposer (see the module docstring)."""

    def __init__(self, config: SpeculativeConfig, proposer: Proposer, vocab_size: int) -> None:
        self.config = config
        self.proposer = proposer
        self.vocab_size = vocab_size
        self._backoff: dict[int, _Backoff] = {}
        self._live: dict[int, Sequence] = {}
        self._proposals: dict[int, Proposal] = {}
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * config.num_speculative_tokens

    # --------------------------------------------------------------- per step
    def num_lookahead(self, seq: Sequence) -> int:
        """How many tokens to propose for a decoding `seq` this step before the scheduler's caps:
        k, or 0 for a request that does not speculate or a sequence in a back-off pause."""
        if seq.group.params.structured_outputs is not None:
            return 0
        state = self._backoff.get(seq.seq_id)
        if state is not None and len(seq.output_token_ids) < state.resume_at:
            return 0
        return self.config.num_speculative_tokens

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
        proposals = self.proposer.propose(seqs, ks, [tables[i] for i, _ in rows])
        if len(proposals) != len(seqs):
            raise ValueError(f"proposals: expected {len(seqs)} (one per sequence), "
                             f"got {len(proposals)}")
        drafts: dict[int, list[int]] = {}
        for seq, k, proposal in zip(seqs, ks, proposals):
            self._check(proposal, k)
            self._live[seq.seq_id] = seq
            if proposal.token_ids:
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
        (engine/spec_decode/rejection.py); updates the back-off and the counters."""
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
        state = self._backoff.setdefault(seq.seq_id, _Backoff())
        state.ema = (1 - EMA_WEIGHT) * state.ema + EMA_WEIGHT * accepted / proposed
        if state.ema < BACKOFF_THRESHOLD:
            state.pause = min(PAUSE_MAX, max(PAUSE_MIN, 2 * state.pause))
            state.resume_at = len(seq.output_token_ids) + state.pause
            state.ema = PROBE_EMA
        elif state.ema >= PROBE_EMA + (1 - PROBE_EMA) / 2:
            state.pause = 0  # acceptance recovered: the next back-off starts short

    def sweep(self) -> None:
        """Tells the proposer to forget every sequence it proposed for that is no longer running
        (preempted, finished or aborted); finished ones lose their back-off state too."""
        for seq_id, seq in list(self._live.items()):
            if seq.status is not SequenceStatus.RUNNING:
                self.proposer.forget(seq_id)
                del self._live[seq_id]
                self._proposals.pop(seq_id, None)
                if seq.is_finished:
                    self._backoff.pop(seq_id, None)

    def counters(self) -> SpecCounters:
        """A snapshot of the counters."""
        return SpecCounters(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                            tuple(self.accepted_per_pos))
