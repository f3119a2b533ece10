"""Verification of one sequence's proposals against the target's logits.

The target scored the sequence's last token and its m proposals d_1..d_m in one step: row j of
its logits predicts the token after d_j (row 0: after the last token). Row j is processed as the
sampler processes a plain step's row (engine/sampler.py: logit_bias, penalties, min_tokens,
temperature, top-k, top-p, min-p), with d_1..d_j counted as output tokens, giving p_j.

- Greedy requests accept d_{j+1} while it is the argmax of processed row j; the first mismatch is
  replaced by that argmax; when all are accepted, the argmax of row m is the bonus token. The
  result equals decoding without speculation token for token.
- Other requests use rejection sampling (Leviathan et al. 2023, Chen et al. 2023): d_{j+1}, drawn
  from the draft's q_j, is accepted with probability min(1, p_j(d)/q_j(d)); the first rejected
  one is replaced by a draw from the normalised (p_j - q_j)+; when all are accepted a bonus token
  is drawn from p_m. Each emitted token is then distributed as p_j exactly. A proposal without
  `probs` was chosen deterministically: q_j is one-hot on d_{j+1}, so the acceptance probability
  is p_j(d) and the residual is p_j without d.

Every draw comes from the request's generator (torch's global one when unseeded), so a seeded
request gives the same tokens for the same proposals. Log-probabilities are those of the raw
logits, as the sampler reports them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from engine.model import layer_ops
from engine.sampler import (Sampler, SamplingState, argmax, draw, raw_logprobs,
                            sampling_probs)
from engine.spec_decode.proposer import Proposal


@dataclass
class Verdict:
    """What verification emits for one sequence: the accepted proposals then one more token
    (the replacement of the first rejected one, or the bonus), with their raw log-probabilities
    and, when the request asks for logprobs, the top ones per token."""

    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[Optional[dict[int, float]]]
    num_accepted: int


def row_states(state: SamplingState, draft: list[int]) -> list[SamplingState]:
    """One sampling state per target row: row j sees the proposals before it as output."""
    out = list(state.output_token_ids)
    return [SamplingState(state.params, state.prompt_token_ids, out + draft[:j],
                          state.generator, state.eos_token_ids)
            for j in range(len(draft) + 1)]


def accept_greedy(x: torch.Tensor, draft: list[int]) -> list[int]:
    """Tokens emitted for processed target rows `x` `[m + 1, vocab]` under greedy decoding."""
    targets = argmax(x).tolist()
    for j, d in enumerate(draft):
        if d != targets[j]:
            return draft[:j] + [targets[j]]
    return draft + [targets[len(draft)]]


def accept_random(p: torch.Tensor, draft: list[int], q: Optional[torch.Tensor],
                  generator: Optional[torch.Generator]) -> list[int]:
    """Rejection sampling (see the module docstring) of `draft` (m tokens) against the target's
    distributions `p` `[m + 1, vocab]`; `q` `[m, vocab]` the draft's, None for one-hot."""
    m = len(draft)
    if m == 0:
        return [int(draw(p[:1], [generator])[0])]
    index = torch.tensor(draft)[:, None]
    p_d = p[:m].gather(1, index).squeeze(1)
    q_d = torch.ones(m, dtype=p.dtype) if q is None else q.to(p.dtype).gather(1, index).squeeze(1)
    u = torch.rand(m, generator=generator, dtype=p.dtype)
    rejected = (u * q_d >= p_d).nonzero()
    if not len(rejected):
        return draft + [int(draw(p[m:], [generator])[0])]
    j = int(rejected[0, 0])
    if q is None:
        residual = p[j].clone()
        residual[draft[j]] = 0.0
    else:
        residual = (p[j] - q[j].to(p.dtype)).clamp_(min=0.0)
    if not float(residual.sum()) > 0.0:  # p == q up to rounding: any draw from p will do
        residual = p[j]
    return draft[:j] + [int(draw(residual[None], [generator])[0])]


def verify(sampler: Sampler, logits: torch.Tensor, state: SamplingState,
           proposal: Proposal) -> Verdict:
    """Verifies `proposal` for one sequence against its target `logits` (float32
    `[len(proposal.token_ids) + 1, vocab]`, see the module docstring)."""
    draft = list(proposal.token_ids)
    if logits.shape[0] != len(draft) + 1:
        raise ValueError(f"logits: expected {len(draft) + 1} rows (one per proposal, plus one), "
                         f"got shape {tuple(logits.shape)}")
    logits = logits.float()
    x = sampler.processed_logits(logits, row_states(state, draft))
    params = state.params
    if params.greedy:
        tokens = accept_greedy(x, draft)
    else:
        p = sampling_probs(x, [params] * x.shape[0])
        tokens = accept_random(p, draft, proposal.probs, state.generator)
    n = len(tokens)
    raw = logits[:n]
    _, lse = layer_ops.argmax_logsumexp(raw)
    out = raw_logprobs(raw, lse, [params] * n, torch.tensor(tokens))
    return Verdict(out.token_ids, out.logprobs, out.top_logprobs, n - 1)
