"""The contract between the engine and a source of speculative tokens.

A `Proposer` guesses up to k tokens that continue each speculating sequence; the target model
then scores the sequence's last token and the guesses in one varlen step, and rejection sampling
(engine/spec_decode/rejection.py) keeps the longest prefix the target agrees with. A proposer may
keep state per sequence (a draft model's own KV cache): the engine tells it about the step's
block moves and about sequences that leave the device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Protocol

import torch

if TYPE_CHECKING:
    from engine.request import Sequence
    from engine.scheduler import SchedulerOutput


@dataclass
class Proposal:
    """Up to k proposed tokens for one sequence.

    `probs` is float32 `[len(token_ids), vocab]`: row j is the draft distribution token j was
    drawn from. None means the tokens were proposed deterministically (n-gram lookup, a greedy
    draft): rejection sampling treats each row as one-hot on its token.
    """

    token_ids: list[int]
    probs: Optional[torch.Tensor] = None


class Proposer(Protocol):
    """A source of speculative tokens (n-gram lookup, a draft model)."""

    def propose(self, seqs: list["Sequence"], num_tokens: list[int],
                block_tables: list[list[int]]) -> list[Proposal]:
        """Up to `num_tokens[i]` proposals for `seqs[i]`, which continue `seq.token_ids` (its
        last token is sampled but not yet computed). Called after the step's block moves and
        before the target's forward; `block_tables[i]` already has slots for positions up to
        `seq.num_tokens - 1 + num_tokens[i]`."""
        ...

    def move_blocks(self, out: "SchedulerOutput") -> None:
        """Applies the step's swap out / swap in / copy-on-write copies to any KV cache of its
        own (in the runner's order: swap out, swap in, copies)."""
        ...

    def forget(self, seq_id: int) -> None:
        """The sequence was preempted, finished or aborted: whatever the proposer cached for it
        is gone."""
        ...
