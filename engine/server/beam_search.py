"""Beam search through the server (vLLM's `use_beam_search` extra field), interleaved with the
other requests.

The offline `LLM.beam_search` drives an idle engine; a server's engine is never idle, so the
search runs as vLLM's server runs it: at every step each live beam is one engine request of one
token (the prompt plus the beam's tokens, `max_tokens=1`, `logprobs=2 * beam_width`, greedy),
whose prefill reuses the beam's cached blocks through the prefix cache. The selection is the
offline searcher's (`engine.beam_search`): every beam's top `2 * beam_width` next tokens are
added to its cumulative log-probability, the best candidates are visited best first, a
candidate ending in EOS (unless `ignore_eos`) among the first `beam_width` becomes a finished
hypothesis, other candidates become the next beams until there are `beam_width`; after
`max_tokens` steps the live beams join the finished ones, ranked by `cum_logprob /
len(tokens) ** length_penalty`, best first.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.beam_search import score
from engine.server.async_engine import AsyncEngine
from engine.server.streaming import add_all, merge

__all__ = ["Hypothesis", "MAX_BEAM_WIDTH", "beam_search"]

#: The widest search: `2 * beam_width` top log-probabilities per step (the engine's limit is 20).
MAX_BEAM_WIDTH = 10


@dataclass
class Hypothesis:
    """One result: generated token ids, cumulative log-probability, its length-penalised
    score and why it ended ("stop": EOS, "length": `max_tokens`)."""

    token_ids: list[int]
    cum_logprob: float
    score: float
    finish_reason: str


async def beam_search(engine: AsyncEngine, request_id: str, prompt: list[int],
                      beam_width: int, max_tokens: int, eos_token_ids: set[int],
                      ignore_eos: bool = False, length_penalty: float = 1.0
                      ) -> list[Hypothesis]:
    """The best `beam_width` hypotheses of `prompt` (module docstring), best first."""
    beams: list[tuple[list[int], float]] = [([], 0.0)]
    finished: list[tuple[list[int], float, str]] = []
    for step in range(max_tokens):
        if not beams:
            break
        tops = await _next_logprobs(engine, f"{request_id}-{step}", prompt, beams, beam_width)
        candidates = sorted(((cum + lp, tokens, token) for (tokens, cum), top in zip(beams, tops)
                             for token, lp in top.items()), key=lambda c: -c[0])
        beams = []
        for rank, (value, tokens, token) in enumerate(candidates[:2 * beam_width]):
            if token in eos_token_ids and not ignore_eos:
                if rank < beam_width:
                    finished.append((tokens + [token], value, "stop"))
                continue
            beams.append((tokens + [token], value))
            if len(beams) == beam_width:
                break
    finished += [(tokens, cum, "length") for tokens, cum in beams]
    ranked = sorted(finished, key=lambda f: -score(f[1], len(f[0]), length_penalty))
    return [Hypothesis(tokens, cum, score(cum, len(tokens), length_penalty), reason)
            for tokens, cum, reason in ranked[:beam_width]]


async def _next_logprobs(engine: AsyncEngine, request_id: str, prompt: list[int],
                         beams: list[tuple[list[int], float]], beam_width: int
                         ) -> list[dict[int, float]]:
    """Each beam's `2 * beam_width` most likely next tokens with their log-probabilities (one
    engine request per beam, all in flight together)."""
    from engine.sampling_params import SamplingParams  # engine is heavy

    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=2 * beam_width,
                            ignore_eos=True)
    streams = await add_all(engine, request_id, [prompt + tokens for tokens, _ in beams],
                            [params] * len(beams))
    tops: list[dict[int, float]] = [{} for _ in beams]
    async for index, delta in merge(streams):
        if delta.error is not None:
            raise delta.error
        for choice in delta.choices:
            for entry in choice.logprobs or []:
                tops[index] = dict(sorted(entry.items(), key=lambda kv: -kv[1])[:2 * beam_width])
    return tops
