"""Turns one step's logits into tokens, per request: logit_bias, penalties, min_tokens, the
structured-output mask, temperature, top-k, top-p, min-p, then greedy or random choice; plus the
log-probabilities vLLM reports.

Every row is processed independently of the others (row-wise operations only), and a row with a
`generator` draws its randomness from that generator alone, so a seeded request samples the same
tokens whatever else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional, Sequence

import torch

from engine.model import layer_ops
from engine.sampling_params import SamplingParams
from engine.structured_output import GrammarState, apply_grammar_masks


@dataclass
class SamplingState:
    """What the sampler needs to know about one sequence. `output_token_ids` is the live list of
    tokens generated so far (the caller appends to it). `generator` is the request's own random
    stream (seeded from `params.seed`), or None to use torch's global one. `eos_token_ids` is
    added to the sampler's own EOS ids for `min_tokens`. `grammar`: the sequence's
    structured-output matcher (the caller advances it with each accepted token), or None."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    generator: Optional[torch.Generator] = None
    eos_token_ids: frozenset[int] = field(default_factory=frozenset)
    grammar: Optional[GrammarState] = None


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
        x = self.processed_logits(logits, states)
        # the raw logits' argmax and log-sum-exp in one read: the greedy choice where nothing
        # changed the logits, and every chosen token's log-probability (no log-softmax of
        # every row: only rows that ask for top log-probabilities get one)
        raw_best, lse = layer_ops.argmax_logsumexp(logits)
        params = [s.params for s in states]
        chosen = torch.empty(len(states), dtype=torch.long)
        greedy = [i for i, p in enumerate(params) if p.greedy]
        rows = [i for i, p in enumerate(params) if not p.greedy]
        greedy_pick = self._raw_greedy(raw_best) if x is logits else self._greedy
        for subset, pick in ((greedy, greedy_pick), (rows, self._random)):
            if len(subset) == len(states):
                chosen = pick(x, subset, states)
            elif subset:
                chosen[subset] = pick(x[subset], subset, states)
        return raw_logprobs(logits, lse, params, chosen)

    @staticmethod
    def _greedy(x: torch.Tensor, rows: list[int], states: list[SamplingState]) -> torch.Tensor:
        return argmax(x)

    @staticmethod
    def _raw_greedy(best: torch.Tensor) -> Callable[..., torch.Tensor]:
        """The greedy pick when `x` is the raw logits: their argmax, already found."""
        return lambda x, rows, states: best[rows]

    @staticmethod
    def _random(x: torch.Tensor, rows: list[int], states: list[SamplingState]) -> torch.Tensor:
        probs = sampling_probs(x, [states[i].params for i in rows])
        return draw(probs, [states[i].generator for i in rows])

    def processed_logits(self, logits: torch.Tensor,
                         states: list[SamplingState]) -> torch.Tensor:
        """`logits` (float32 `[N, vocab]`) with `logit_bias` added, the penalties applied, for
        rows short of `min_tokens` EOS / `stop_token_ids` set to -inf, and for rows with a
        grammar every token it does not allow set to -inf; a copy when anything changes (the
        input is never modified). The grammar wins: a row it would leave without a token
        (its grammar must end, min_tokens bans the end) keeps only the grammar's mask.
        Greedy rows take its argmax; the others sample from `sampling_probs` of it."""
        x = logits.float()
        biased = [i for i, s in enumerate(states) if s.params.logit_bias]
        penalised = [i for i, s in enumerate(states) if _has_penalty(s)]
        masks = [(i, ids) for i, ids in enumerate(self._min_tokens_bans(states, x.shape[1]))
                 if ids]
        constrained = [i for i, s in enumerate(states) if s.grammar is not None]
        if not (biased or penalised or masks or constrained):
            return x
        x = x.clone()
        _add_logit_bias(x, [(i, states[i].params) for i in biased])
        _apply_penalties(x, [(i, states[i]) for i in penalised])
        for i, ids in masks:
            x[i, ids] = float("-inf")
        if constrained:
            grammars = [states[i].grammar for i in constrained]
            apply_grammar_masks(x, constrained, grammars)  # type: ignore[arg-type]
            stuck = [i for i, dead in zip(constrained, torch.isinf(x[constrained]).all(1).tolist())
                     if dead]
            if stuck:
                x[stuck] = logits[stuck].float()
                apply_grammar_masks(x, stuck, [states[i].grammar for i in stuck])  # type: ignore
        return x

    def _min_tokens_bans(self, states: list[SamplingState], vocab: int) -> list[list[int]]:
        """Per row, the ids that may not be sampled yet (EOS and stop ids before min_tokens)."""
        bans = []
        for s in states:
            p = s.params
            banned: set[int] = set()
            if len(s.output_token_ids) < p.min_tokens:
                banned = set(p.stop_token_ids or ())
                if not p.ignore_eos:
                    banned |= self.eos_token_ids | s.eos_token_ids
            bans.append(sorted(t for t in banned if 0 <= t < vocab))
        return bans


def _add_logit_bias(x: torch.Tensor, rows: list[tuple[int, SamplingParams]]) -> None:
    """Adds each row's `logit_bias` to its logits, in place, in one scatter for all rows
    (ids beyond the row's width are the caller's error: the engine checks them on entry)."""
    if not rows:
        return
    parts = [(i, p.logit_bias_tensors) for i, p in rows]
    row_ids = torch.cat([torch.full((len(t[0]),), i, dtype=torch.long)
                         for i, t in parts if t is not None])
    token_ids = torch.cat([t[0] for _, t in parts if t is not None])
    values = torch.cat([t[1] for _, t in parts if t is not None]).to(x.dtype)
    x.index_put_((row_ids, token_ids), values, accumulate=True)


def _has_penalty(s: SamplingState) -> bool:
    p = s.params
    return p.repetition_penalty != 1.0 or bool(
        (p.presence_penalty or p.frequency_penalty) and len(s.output_token_ids))


def _apply_penalties(x: torch.Tensor, rows: list[tuple[int, SamplingState]]) -> None:
    """Repetition penalty over prompt + output tokens; presence and frequency penalties over the
    output tokens (vLLM's definitions). In place, on the given rows."""
    vocab = x.shape[1]
    for i, s in rows:
        p = s.params
        output = torch.tensor(list(s.output_token_ids), dtype=torch.long)
        if p.repetition_penalty != 1.0:
            seen = torch.zeros(vocab, dtype=torch.bool)
            seen[torch.tensor(list(s.prompt_token_ids), dtype=torch.long)] = True
            seen[output] = True
            row = x[i]
            penalised = torch.where(row > 0, row / p.repetition_penalty,
                                    row * p.repetition_penalty)
            x[i] = torch.where(seen, penalised, row)
        if (p.presence_penalty or p.frequency_penalty) and output.numel():
            counts = torch.bincount(output, minlength=vocab)[:vocab].float()
            x[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()


#: How many of the best tokens top-p examines first, then next, before sorting a whole row.
_CANDIDATES = (256, 4096)


def sampling_probs(x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distribution a non-greedy row samples from: softmax of `x / temperature` restricted
    by top-k, then top-p, then min-p (dropped tokens get probability 0, the rest are
    renormalised). `x` is `[R, vocab]`, one row per params. A token tied with the last kept one
    is kept too."""
    temps = torch.tensor([p.temperature for p in params], dtype=x.dtype)
    if bool((temps != 1.0).any()):
        x = x / temps[:, None]
    x = _top_k_top_p(x, params)
    probs = torch.softmax(x, dim=-1)
    min_p = torch.tensor([p.min_p for p in params], dtype=x.dtype)
    if bool((min_p > 0).any()):
        threshold = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        probs = torch.where(probs < threshold, torch.zeros_like(probs), probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def _top_k_top_p(x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Sets to -inf, per row, every logit below the last token kept by top-k then top-p.

    Only the best few logits are sorted (`topk` of `_CANDIDATES[0]`, or of the largest top_k,
    or of just the largest top_k when every row has one);
    rows whose top-p nucleus may extend past them are redone with more, then with a full sort.
    Either way a row's kept set depends on that row alone."""
    vocab = x.shape[1]
    rows = [i for i, p in enumerate(params) if 0 < p.top_k < vocab or p.top_p < 1.0]
    if not rows:
        return x
    sub = x[rows]
    top_k = torch.tensor([params[i].top_k if 0 < params[i].top_k < vocab else vocab
                          for i in rows])
    top_p = torch.tensor([params[i].top_p for i in rows], dtype=torch.float64)
    threshold = torch.empty(len(rows), 1, dtype=x.dtype)
    pending = torch.arange(len(rows))
    for width in (*_CANDIDATES, vocab):
        part, part_k = sub[pending], top_k[pending]
        limits = [int(t) for t in part_k if t < vocab]
        # rows cut by top-k never need more than their k (topk's cost grows with k)
        k = min(vocab, max(limits if len(limits) == len(part_k) else [width] + limits))
        values = part.topk(k, dim=-1, sorted=True).values if k < vocab else \
            part.sort(dim=-1, descending=True).values
        n_keep, incomplete = _kept_counts(part, values, part_k, top_p[pending])
        done = ~incomplete
        threshold[pending[done]] = values[done].gather(1, (n_keep[done] - 1)[:, None])
        pending = pending[incomplete]
        if not len(pending):
            break
    if len(rows) == x.shape[0]:
        return sub.masked_fill_(sub < threshold, float("-inf"))  # sub is a copy already
    x = x.clone()
    x[rows] = sub.masked_fill(sub < threshold, float("-inf"))
    return x


def _kept_counts(sub: torch.Tensor, values: torch.Tensor, top_k: torch.Tensor,
                 top_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """How many of the best tokens (`values`, sorted, a prefix of each row of `sub`) top-k then
    top-p keep, and whether that count may be cut short by the prefix's length."""
    k = values.shape[1]
    rank = torch.arange(k)[None, :]
    in_k = rank < top_k[:, None]
    # normalise over the top-k when it is set (all inside the prefix), else over the whole row
    limited = (top_k <= k)[:, None]
    # float64: which token crosses top_p is decided by a long sum
    masked = values.double().masked_fill(~in_k, float("-inf"))
    lse = torch.logsumexp(masked, dim=-1, keepdim=True)
    if not bool(limited.all()):
        lse = torch.where(limited, lse, torch.logsumexp(sub.double(), dim=-1, keepdim=True))
    probs = torch.exp(masked - lse)
    before = probs.cumsum(dim=-1) - probs  # probability of the strictly better-ranked tokens
    # top_p == 1 keeps everything, even where rounding lets `before` reach 1
    keep = in_k & ((before < top_p[:, None]) | (rank == 0) | (top_p[:, None] >= 1.0))
    n_keep = keep.sum(dim=-1)
    incomplete = keep[:, -1] & ~limited[:, 0] & (k < sub.shape[1])
    return n_keep, incomplete


def draw(probs: torch.Tensor, generators: list[Optional[torch.Generator]]) -> torch.Tensor:
    """One token per row with probability proportional to `probs`, by inverting the row's
    cumulative distribution at one uniform draw from the row's own generator (or torch's global
    one)."""
    u = torch.empty(probs.shape[0], dtype=probs.dtype)
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if unseeded:
        u[unseeded] = torch.rand(len(unseeded), dtype=probs.dtype)
    for i, g in enumerate(generators):
        if g is not None:
            u[i] = torch.rand(1, generator=g, dtype=probs.dtype)[0]
    cdf = probs.cumsum(dim=-1)
    # side="right": the first token whose cdf exceeds the draw; zero-probability tokens have
    # the same cdf as their predecessor, so they are never that token
    target = (u * cdf[:, -1])[:, None]
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=probs.shape[1] - 1)


def argmax(x: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """`x.argmax(dim=-1)` of a 2-D tensor (the first index of each row's maximum), found in two
    levels: the chunk holding the row's maximum first (by `amax`, vectorised), then the index
    inside it. Torch's CPU argmax is a scalar loop: ~5x slower on a [16, 49152] float32 row
    block (0.66 vs 0.12 ms on one core)."""
    rows, n = x.shape
    if n < 2 * chunk:
        return x.argmax(dim=-1)
    whole = n - n % chunk
    maxima = x[:, :whole].reshape(rows, -1, chunk).amax(dim=-1)
    if whole < n:
        maxima = torch.cat((maxima, x[:, whole:].amax(dim=-1, keepdim=True)), dim=1)
    best = maxima.argmax(dim=-1)  # the first chunk holding the maximum
    # a short last chunk repeats its last index; the first occurrence still wins
    index = ((best * chunk)[:, None] + torch.arange(chunk, device=x.device)).clamp_(max=n - 1)
    return index.gather(1, x.gather(1, index).argmax(dim=-1, keepdim=True)).squeeze(1)


def raw_logprobs(logits: torch.Tensor, lse: torch.Tensor, params: list[SamplingParams],
                 chosen: torch.Tensor) -> SamplerOutput:
    """The `chosen` tokens (int64 `[N]`) with their log-probabilities under the raw `logits`
    (`logit - lse`, `lse` each row's log-sum-exp) and, for rows whose params ask, the top ones
    (top_logprobs)."""
    token_ids = chosen.tolist()
    chosen_lp = (logits.gather(1, chosen[:, None]).squeeze(1) - lse).tolist()
    return SamplerOutput(token_ids, chosen_lp,
                         top_logprobs(logits, lse, params, token_ids, chosen_lp))


def top_logprobs(logits: torch.Tensor, lse: torch.Tensor, params: list[SamplingParams],
                 token_ids: list[int], chosen_lp: list[float]) -> list[Optional[dict[int, float]]]:
    """For rows with `logprobs=n`: the n best raw log-probabilities (the raw `logits`' top n,
    minus each row's log-sum-exp `lse`) plus the chosen token's."""
    wanted = [p.logprobs for p in params]
    result: list[Optional[dict[int, float]]] = [None] * len(params)
    k = max((n for n in wanted if n is not None), default=None)
    if k is None:
        return result
    if k:
        values, ids = logits.topk(min(k, logits.shape[1]), dim=-1)
        values = values - lse[:, None]
    for i, n in enumerate(wanted):
        if n is None:
            continue
        top: dict[int, float] = {}
        if n:
            top = dict(zip(ids[i, :n].tolist(), values[i, :n].tolist()))
        top[token_ids[i]] = chosen_lp[i]
        result[i] = top
    return result
