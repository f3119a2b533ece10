"""Requests as the scheduler sees them: a `SequenceGroup` (one request) of `Sequence`s.

A sequence holds its token ids (prompt then output) and `num_computed_tokens`, the number of
leading tokens whose K/V is in the cache. There are no prefill and decode phases: each step the
scheduler gives a sequence some of its `num_tokens - num_computed_tokens` uncomputed tokens, and
the engine samples a next token when a step computes the last of them (as in vLLM v1).
A request with `n > 1` starts as one sequence; when its prompt is done it forks into `n`
sequences that share the prompt's blocks.
"""

from __future__ import annotations

import copy
import enum
from typing import Any, Optional


class SequenceStatus(enum.Enum):
    """Where a sequence is: queued, scheduled each step, in the host pool, or finished."""

    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def is_finished(self) -> bool:
        return self in (SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH,
                        SequenceStatus.FINISHED_ABORTED)

    @property
    def finish_reason(self) -> Optional[str]:
        """vLLM's finish reason: "stop", "length", "abort", or None while unfinished."""
        return {SequenceStatus.FINISHED_STOPPED: "stop", SequenceStatus.FINISHED_LENGTH: "length",
                SequenceStatus.FINISHED_ABORTED: "abort"}.get(self)


class Sequence:
    """One generated continuation: token ids, progress through the cache, and its output so far.

    `text` is the detokenized output (after stop-string truncation once finished); `logprobs`
    holds one `{token_id: logprob}` dict per output token when the request asked for logprobs.
    """

    def __init__(self, seq_id: int, prompt_token_ids: list[int], group: "SequenceGroup",
                 index: int = 0) -> None:
        self.seq_id = seq_id
        self.index = index
        self.group = group
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.status = SequenceStatus.WAITING
        self.cumulative_logprob = 0.0
        self.logprobs: Optional[list[dict[int, float]]] = None
        self.text = ""
        self.stop_reason: Optional[Any] = None
        # Engine-side helpers (detokenizer, sampling state, stop-string scanner), set by the
        # engine.
        self.detokenizer: Any = None
        self.sampling_state: Any = None
        self.stop_scanner: Any = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_token(self, token_id: int, logprob: float,
                     top_logprobs: Optional[dict[int, float]] = None) -> None:
        """Adds a sampled token (not yet computed: its K/V is written by the next step)."""
        self.token_ids.append(token_id)
        self.output_token_ids.append(token_id)
        self.cumulative_logprob += logprob
        if self.logprobs is not None:
            entry = dict(top_logprobs) if top_logprobs else {}
            entry[token_id] = logprob
            self.logprobs.append(entry)

    def fork(self, seq_id: int, index: int) -> "Sequence":
        """A copy of this sequence under a new id and output index (same tokens and progress;
        the engine gives the copy its own detokenizer and sampling state)."""
        child = copy.copy(self)
        child.seq_id, child.index = seq_id, index
        child.token_ids = list(self.token_ids)
        child.output_token_ids = list(self.output_token_ids)
        child.logprobs = None if self.logprobs is None else list(self.logprobs)
        child.detokenizer = child.sampling_state = child.stop_scanner = None
        return child

    def reset_for_recompute(self) -> None:
        """After preemption by recompute: nothing of it is in the cache any more."""
        self.num_computed_tokens = 0
        self.status = SequenceStatus.WAITING

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, {self.status.value})")


class SequenceGroup:
    """One request: its prompt, parameters and sequences, scheduled and preempted as a unit.

    `num_seqs_reserved` is the number of sequences the request will have once forked (its `n` or
    beam width); the scheduler counts it against `max_num_seqs` from admission on.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: Any,
                 arrival_time: float, first_seq_id: int, prompt: Optional[str] = None,
                 num_seqs: int = 1) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.arrival_time = arrival_time
        self.seqs = [Sequence(first_seq_id, prompt_token_ids, self, 0)]
        self.num_seqs_reserved = num_seqs
        self.forked = num_seqs == 1
        self.generator: Any = None

    def unfinished_seqs(self) -> list[Sequence]:
        return [s for s in self.seqs if not s.status.is_finished]

    def seqs_with_status(self, status: SequenceStatus) -> list[Sequence]:
        return [s for s in self.seqs if s.status is status]

    @property
    def is_finished(self) -> bool:
        return all(s.status.is_finished for s in self.seqs)

    @property
    def num_seqs_needed(self) -> int:
        """Sequence slots the group occupies in a step (its reservation until it has forked)."""
        return max(len(self.unfinished_seqs()), 0 if self.forked else self.num_seqs_reserved)

    def __repr__(self) -> str:
        return f"SequenceGroup({self.request_id!r}, seqs={self.seqs})"
