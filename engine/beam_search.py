"""Beam search on the paged engine, with branches sharing KV blocks.

Every live beam is a `Sequence` with its own block table. A branch that continues a beam forks
that beam's table (reference counts go up, nothing is copied); the next write into the shared,
partially filled last block copies just that block (copy-on-write); beams that drop out are freed.

The search, per prompt and step: every live beam's next-token log-probabilities (log-softmax of
the logits, divided by `temperature` first when it is > 0) are added to the beam's cumulative
log-probability; the best `2 * beam_width` candidates are visited best first; a candidate ending
in EOS (unless `ignore_eos`) among the first `beam_width` of them becomes a finished hypothesis,
other candidates become the next beams until there are `beam_width`. After `max_tokens` steps the
live beams join the finished ones, which are ranked by `cum_logprob / len(generated) **
length_penalty` (generated tokens only; EOS counted), best first, and the top `beam_width` kept.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

import torch

from engine.request import Sequence, SequenceGroup

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import BeamSearchParams


@dataclass
class BeamSearchSequence:
    """One finished hypothesis: generated token ids, their text, cumulative log-probability and
    the length-penalised score it was ranked by."""

    token_ids: list[int]
    text: str
    cum_logprob: float
    score: float
    finish_reason: str


@dataclass
class BeamSearchOutput:
    """The result for one prompt: hypotheses, best first (at most `beam_width`)."""

    prompt: Optional[str]
    prompt_token_ids: list[int]
    sequences: list[BeamSearchSequence] = field(default_factory=list)


@dataclass
class _Beam:
    seq: Sequence
    cum_logprob: float = 0.0


@dataclass
class _Search:
    """The state of one prompt's search."""

    group: SequenceGroup
    beams: list[_Beam]
    finished: list[tuple[list[int], float, str]] = field(default_factory=list)


def blocks_per_prompt(prompt_len: int, params: "BeamSearchParams", block_size: int) -> int:
    """An upper bound of the blocks one prompt's search holds at once."""
    return params.beam_width * -(-(prompt_len + params.max_tokens) // block_size)


def score(cum_logprob: float, length: int, length_penalty: float) -> float:
    return cum_logprob / (max(length, 1) ** length_penalty)


class BeamSearcher:
    """Runs beam searches on an idle engine: its scheduler admits the beams and shares each
    step's token budget among them, its `execute_step` runs the model."""

    def __init__(self, engine: "LLMEngine") -> None:
        self.engine = engine
        self.kvm = engine.kv_cache_manager
        self.scheduler = engine.scheduler
        self.config = engine.config

    def run(self, prompts: list[tuple[Optional[str], list[int]]],
            params: "BeamSearchParams") -> list[BeamSearchOutput]:
        """Searches every prompt, in batches of prompts whose beams fit in the KV pool.
        ValueError under a reservation `kv_allocation` (beams share blocks)."""
        self.engine.require_paged("beam search")
        if self.engine.has_unfinished_requests():
            raise RuntimeError("beam_search: expected an idle engine (no unfinished requests)")
        results: list[BeamSearchOutput] = []
        batch: list[tuple[Optional[str], list[int]]] = []
        used = 0
        for prompt, ids in prompts:
            need = blocks_per_prompt(len(ids), params, self.kvm.block_size)
            if need > self.kvm.num_blocks:
                raise ValueError(f"num_kv_blocks: beam search of a {len(ids)}-token prompt with "
                                 f"beam_width={params.beam_width}, max_tokens="
                                 f"{params.max_tokens} may need {need} blocks; expected a pool "
                                 f"of at least that, got {self.kvm.num_blocks}")
            if batch and (used + need > self.kvm.num_blocks
                          or (len(batch) + 1) * params.beam_width > self.config.max_num_seqs):
                results += self._search(batch, params)
                batch, used = [], 0
            batch.append((prompt, ids))
            used += need
        if batch:
            results += self._search(batch, params)
        return results

    def _search(self, prompts: list[tuple[Optional[str], list[int]]],
                params: "BeamSearchParams") -> list[BeamSearchOutput]:
        searches = []
        for i, (prompt, ids) in enumerate(prompts):
            group = SequenceGroup(f"beam-{i}", ids, params, 0.0, self.engine.next_seq_id(),
                                  prompt, num_seqs=params.beam_width)
            self.scheduler.admit(group.seqs[0])
            searches.append(_Search(group, [_Beam(group.seqs[0])]))
        try:
            for _ in range(params.max_tokens):
                live = [b.seq for s in searches for b in s.beams]
                if not live:
                    break
                logprobs = self._compute(live, params.temperature)
                for search in searches:
                    self._advance(search, logprobs, params)
        finally:
            for search in searches:
                for beam in search.beams:
                    search.finished.append((beam.seq.output_token_ids, beam.cum_logprob,
                                            "length"))
                    self.kvm.free(beam.seq.seq_id)
                search.beams = []
        return [self._result(s, params) for s in searches]

    def _compute(self, seqs: list[Sequence], temperature: float) -> dict[int, torch.Tensor]:
        """Computes every uncomputed token of `seqs` (in as many engine steps as the token and
        sequence budgets need); returns each sequence's next-token log-probabilities by seq_id."""
        result: dict[int, torch.Tensor] = {}
        pending = list(seqs)
        while pending:
            out = self.scheduler.schedule_seqs(pending)
            if out is None:
                raise RuntimeError("beam_search: ran out of KV blocks (pool too small)")
            sampled, logits = self.engine.execute_step(out)
            if sampled:
                if temperature > 0:
                    logits = logits / temperature
                logp = torch.log_softmax(logits.float(), dim=-1)
                for i, seq in enumerate(sampled):
                    result[seq.seq_id] = logp[i]
            pending = [s for s in pending if s.num_uncomputed_tokens]
        return result

    def _advance(self, search: _Search, logprobs: dict[int, torch.Tensor],
                 params: "BeamSearchParams") -> None:
        width = params.beam_width
        beams = search.beams
        if not beams:
            return
        totals = torch.stack([logprobs[b.seq.seq_id].double() + b.cum_logprob for b in beams])
        vocab = totals.shape[1]
        values, flat = torch.topk(totals.flatten(), min(2 * width, totals.numel()))
        eos = self.engine.eos_token_ids
        chosen: list[tuple[int, int, float]] = []  # (parent index, token, cum_logprob)
        for rank, (value, index) in enumerate(zip(values.tolist(), flat.tolist())):
            parent, token = divmod(index, vocab)
            if token in eos and not params.ignore_eos:
                if rank < width:
                    tokens = beams[parent].seq.output_token_ids + [token]
                    search.finished.append((tokens, value, "stop"))
                continue
            chosen.append((parent, token, value))
            if len(chosen) == width:
                break
        search.beams = self._branch(beams, chosen)

    def _branch(self, beams: list[_Beam], chosen: list[tuple[int, int, float]]) -> list[_Beam]:
        """New beams from `(parent, token, cum_logprob)`: the first branch of a parent reuses its
        sequence, others fork it (sharing blocks); parents with no branch are freed."""
        by_parent: dict[int, list[tuple[int, float]]] = {}
        for parent, token, value in chosen:
            by_parent.setdefault(parent, []).append((token, value))
        new: list[_Beam] = []
        for p, beam in enumerate(beams):
            branches = by_parent.get(p)
            if not branches:
                self.kvm.free(beam.seq.seq_id)
                continue
            seqs = [beam.seq]
            for _ in branches[1:]:
                child = beam.seq.fork(self.engine.next_seq_id(), 0)
                self.kvm.fork(beam.seq.seq_id, child.seq_id)
                seqs.append(child)
            for seq, (token, value) in zip(seqs, branches):
                seq.token_ids.append(token)
                seq.output_token_ids.append(token)
                new.append(_Beam(seq, value))
        return new

    def _result(self, search: _Search, params: "BeamSearchParams") -> BeamSearchOutput:
        decode = self.engine.tokenizer.decode
        ranked = sorted(search.finished, reverse=True,
                        key=lambda f: score(f[1], len(f[0]), params.length_penalty))
        group = search.group
        out = BeamSearchOutput(group.prompt, list(group.prompt_token_ids))
        for tokens, cum, reason in ranked[:params.beam_width]:
            out.sequences.append(BeamSearchSequence(
                list(tokens), decode(tokens, True), cum,
                score(cum, len(tokens), params.length_penalty), reason))
        return out
