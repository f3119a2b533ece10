"""Turns one step's logits into tokens, per request: penalties, min_tokens, temperature, top-k,
top-p, min-p, then greedy or random choice; plus the log-probabilities vLLM reports.

Every row is processed independently of the others (row-wise operations only), and a row with a
`generator` draws its randomness from that generator alone, so a seeded request samples the same
tokens whatever else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

import torch

from engine.sampling_params import SamplingParams


@dataclass
class SamplingState:
    """What the sampler needs to know about one sequence. `output_token_ids` is the live list of
    tokens generated so far (the caller appends to it). `generator` is the request's own random
    stream (seeded from `params.seed`), or None to use torch's global one. `eos_token_ids` is
    added to the sampler's own EOS ids for `min_tokens`."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    generator: Optional[torch.Generator] = None
    eos_token_ids: frozenset[int] = field(default_factory=frozenset)


@dataclass
class SamplerOutput:
    """Per row: the chosen token, its log-probability under the raw logits (log-softmax before
    any penalty, temperature or truncation, as vLLM reports by default), and, for rows whose
    params ask for `logprobs`, a dict of the top ones plus the chosen token (else None)."""

    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[Optional[dict[int, float]]]


class Sampler:
    """`sample(logits, states)` chooses one token per row. `eos_token_ids` are the model's EOS
    ids, masked (with `stop_token_ids`) while a row has fewer than `min_tokens` outputs unless
    it sets `ignore_eos`."""

    def __init__(self, eos_token_ids: Iterable[int] = ()) -> None:
        self.eos_token_ids = frozenset(eos_token_ids)

    @torch.no_grad()
    def sample(self, logits: torch.Tensor, states: list[SamplingState]) -> SamplerOutput:
        """`logits` float32 `[N, vocab]`, one row per state. Returns the chosen tokens."""
        if logits.dim() != 2 or logits.shape[0] != len(states):
            raise ValueError(f"logits: expected a [{len(states)}, vocab] tensor (one row per "
                             f"state), got shape {tuple(logits.shape)}")
        logits = logits.float()
        raw_logprobs = torch.log_softmax(logits, dim=-1)
        x = self.processed_logits(logits, states)
        params = [s.params for s in states]
        greedy = torch.tensor([p.greedy for p in params])
        chosen = x.argmax(dim=-1)
        if not bool(greedy.all()):
            rows = torch.nonzero(~greedy).flatten()
            probs = sampling_probs(x[rows], [params[i] for i in rows.tolist()])
            drawn = _draw(probs, [states[i].generator for i in rows.tolist()])
            chosen[rows] = drawn
        token_ids = chosen.tolist()
        chosen_lp = raw_logprobs.gather(1, chosen[:, None]).squeeze(1).tolist()
        return SamplerOutput(token_ids, chosen_lp, _top_logprobs(raw_logprobs, params, token_ids,
                                                                 chosen_lp))

    def processed_logits(self, logits: torch.Tensor,
                         states: list[SamplingState]) -> torch.Tensor:
        """A copy of `logits` (float32 `[N, vocab]`) with the penalties applied and, for rows
        short of `min_tokens`, EOS / `stop_token_ids` set to -inf. Greedy rows take its argmax;
        the others sample from `sampling_probs` of it."""
        x = logits.float().clone()
        _apply_penalties(x, states)
        self._mask_until_min_tokens(x, states)
        return x

    def _mask_until_min_tokens(self, x: torch.Tensor, states: list[SamplingState]) -> None:
        for i, s in enumerate(states):
            p = s.params
            if len(s.output_token_ids) >= p.min_tokens:
                continue
            banned = set(p.stop_token_ids or ())
            if not p.ignore_eos:
                banned |= self.eos_token_ids | s.eos_token_ids
            ids = [t for t in banned if 0 <= t < x.shape[1]]
            if ids:
                x[i, ids] = float("-inf")


def _apply_penalties(x: torch.Tensor, states: list[SamplingState]) -> None:
    """Repetition penalty over prompt + output tokens; presence and frequency penalties over the
    output tokens (vLLM's definitions). In place, on the rows that set any."""
    vocab = x.shape[1]
    for i, s in enumerate(states):
        p = s.params
        if p.repetition_penalty != 1.0:
            seen = torch.zeros(vocab, dtype=torch.bool)
            seen[torch.tensor(list(s.prompt_token_ids), dtype=torch.long)] = True
            seen[torch.tensor(list(s.output_token_ids), dtype=torch.long)] = True
            row = x[i]
            penalised = torch.where(row > 0, row / p.repetition_penalty,
                                    row * p.repetition_penalty)
            x[i] = torch.where(seen, penalised, row)
        if (p.presence_penalty or p.frequency_penalty) and len(s.output_token_ids):
            counts = torch.bincount(torch.tensor(list(s.output_token_ids), dtype=torch.long),
                                    minlength=vocab)[:vocab].float()
            x[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()


def sampling_probs(x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distribution a non-greedy row samples from: softmax of `x / temperature` restricted
    by top-k, then top-p, then min-p (dropped tokens get probability 0, the rest are
    renormalised). `x` is `[R, vocab]`, one row per params."""
    temps = torch.tensor([p.temperature for p in params], dtype=x.dtype)
    x = x / temps[:, None]
    vocab = x.shape[1]
    top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params])
    top_p = torch.tensor([p.top_p for p in params], dtype=x.dtype)
    if bool((top_k < vocab).any()) or bool((top_p < 1.0).any()):
        x = _top_k_top_p(x, top_k, top_p)
    probs = torch.softmax(x, dim=-1)
    min_p = torch.tensor([p.min_p for p in params], dtype=x.dtype)
    if bool((min_p > 0).any()):
        threshold = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        probs = torch.where(probs < threshold, torch.zeros_like(probs), probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def _top_k_top_p(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Sets to -inf every logit outside the row's `top_k` best, then outside the smallest set of
    best tokens whose probability (after top-k) reaches `top_p`. Ties broken by the sort."""
    sorted_x, order = x.sort(dim=-1, descending=True)
    rank = torch.arange(x.shape[1])[None, :]
    sorted_x = sorted_x.masked_fill(rank >= top_k[:, None], float("-inf"))
    probs = torch.softmax(sorted_x, dim=-1)
    before = probs.cumsum(dim=-1) - probs  # probability of the strictly better-ranked tokens
    # top_p == 1 keeps everything, even where rounding lets `before` reach 1
    drop = (before >= top_p[:, None]) & (rank > 0) & (top_p[:, None] < 1.0)
    sorted_x = sorted_x.masked_fill(drop, float("-inf"))
    return torch.full_like(x, float("-inf")).scatter(1, order, sorted_x)


def _draw(probs: torch.Tensor, generators: list[Optional[torch.Generator]]) -> torch.Tensor:
    """One token per row, with probability proportional to `probs`, each row drawing from its own
    generator: argmax of probs / E with E ~ Exponential(1) (the exponential-race method)."""
    noise = torch.empty_like(probs)
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if unseeded:
        noise[unseeded] = torch.empty(len(unseeded), probs.shape[1]).exponential_()
    for i, g in enumerate(generators):
        if g is not None:
            noise[i].exponential_(generator=g)
    noise.clamp_(min=torch.finfo(noise.dtype).tiny)  # a draw of exactly 0 would divide by 0
    return (probs / noise).argmax(dim=-1)


def _top_logprobs(raw: torch.Tensor, params: list[SamplingParams], token_ids: list[int],
                  chosen_lp: list[float]) -> list[Optional[dict[int, float]]]:
    wanted = [p.logprobs for p in params]
    result: list[Optional[dict[int, float]]] = [None] * len(params)
    k = max((n for n in wanted if n is not None), default=None)
    if k is None:
        return result
    values, ids = raw.topk(min(k, raw.shape[1]), dim=-1) if k else (None, None)
    for i, n in enumerate(wanted):
        if n is None:
            continue
        top: dict[int, float] = {}
        if n:
            top = dict(zip(ids[i, :n].tolist(), values[i, :n].tolist()))
        top[token_ids[i]] = chosen_lp[i]
        result[i] = top
    return result
