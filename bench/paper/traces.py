"""Request traces: Poisson arrivals, prompt and output lengths drawn like the paper's data sets.

The vLLM paper (Kwon et al., "Efficient Memory Management for Large Language Model Serving with
PagedAttention", SOSP 2023, §6.1 and Fig. 11) serves two traces: ShareGPT (mean input 161.31,
mean output 337.99 tokens, long-tailed) and Alpaca (mean input 19.31, mean output 58.45). The
paper publishes the means and histograms, not the data, so lengths here are drawn from
log-normal distributions with those means and a stated sigma (the shape parameter: a wider one
for ShareGPT's long tail):

    ShareGPT-like: input lognormal(mean 161.31, sigma 1.0), output lognormal(mean 337.99, sigma 1.0)
    Alpaca-like:   input lognormal(mean 19.31, sigma 0.6),  output lognormal(mean 58.45, sigma 0.6)

(`mu = ln(mean) - sigma^2 / 2`.) A trace divides each drawn length by `scale` (4 for the real
engine on this machine, 1 at the paper's lengths), rounds it and clips it: the prompt to
`[1, max_model_len - 1]`, the output to `[1, max_model_len - prompt]`, so clipping shortens a
few long-tail requests (the realized means are in `trace_summary`). Arrivals form a Poisson
process: exponential gaps of mean `1 / rate` seconds. Everything is drawn from one seeded
generator, prompt token ids included, so a trace is a pure function of its arguments.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class LengthDistribution:
    """Log-normal prompt and output lengths given by their means (tokens) and sigmas."""

    input_mean: float
    input_sigma: float
    output_mean: float
    output_sigma: float
    source: str


DATASETS: dict[str, LengthDistribution] = {
    "sharegpt": LengthDistribution(161.31, 1.0, 337.99, 1.0,
                                   "ShareGPT, vLLM paper (SOSP 2023) §6.1 / Fig. 11a"),
    "alpaca": LengthDistribution(19.31, 0.6, 58.45, 0.6,
                                 "Alpaca, vLLM paper (SOSP 2023) §6.1 / Fig. 11b"),
}


@dataclass(frozen=True)
class TraceRequest:
    """One request: arrival time (seconds from the trace's start), prompt token ids and the
    exact number of output tokens it generates."""

    request_id: str
    arrival_s: float
    prompt_token_ids: tuple[int, ...]
    output_len: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


def check_dataset(dataset: str) -> LengthDistribution:
    """The distribution of `dataset`; ValueError naming the known ones otherwise."""
    if dataset not in DATASETS:
        raise ValueError(f"dataset: expected one of {sorted(DATASETS)}, got {dataset!r}")
    return DATASETS[dataset]


def check_rate(rate: float) -> float:
    """`rate` as a float; ValueError unless it is a finite number > 0 (requests per second)."""
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not math.isfinite(rate) \
            or rate <= 0:
        raise ValueError(f"rate: expected a finite number of requests per second > 0, "
                         f"got {rate!r}")
    return float(rate)


def _lognormal(rng: np.random.Generator, mean: float, sigma: float, size: int) -> np.ndarray:
    return rng.lognormal(math.log(mean) - sigma * sigma / 2, sigma, size)


def make_trace(dataset: str, rate: float, num_requests: int, seed: int = 0, scale: float = 1,
               max_model_len: int = 2048, vocab_size: int = 32000) -> list[TraceRequest]:
    """`num_requests` requests of `dataset` arriving as a Poisson process of `rate` requests/s.

    Lengths are drawn, divided by `scale`, rounded and clipped as the module docstring states;
    prompt token ids are uniform in `[0, vocab_size)`. ValueError for an unknown data set, a
    rate <= 0, `num_requests < 1`, `scale <= 0` or `max_model_len < 2`.
    """
    dist = check_dataset(dataset)
    rate = check_rate(rate)
    for name, value, low in (("num_requests", num_requests, 1), ("max_model_len", max_model_len, 2),
                             ("vocab_size", vocab_size, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name}: expected an int >= {low}, got {value!r}")
    if not scale > 0:
        raise ValueError(f"scale: expected a number > 0, got {scale!r}")
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1 / rate, num_requests))
    inputs = _lognormal(rng, dist.input_mean, dist.input_sigma, num_requests) / scale
    outputs = _lognormal(rng, dist.output_mean, dist.output_sigma, num_requests) / scale
    trace = []
    for i in range(num_requests):
        prompt_len = int(min(max(round(inputs[i]), 1), max_model_len - 1))
        output_len = int(min(max(round(outputs[i]), 1), max_model_len - prompt_len))
        ids = tuple(int(t) for t in rng.integers(0, vocab_size, prompt_len))
        trace.append(TraceRequest(f"req-{i}", float(arrivals[i]), ids, output_len))
    return trace


def trace_summary(trace: list[TraceRequest]) -> dict:
    """The realized statistics of a trace: count, mean and max prompt and output lengths, and
    the realized rate (requests over the last arrival time)."""
    prompts = [r.prompt_len for r in trace]
    outputs = [r.output_len for r in trace]
    return {"num_requests": len(trace),
            "mean_prompt_len": float(np.mean(prompts)), "max_prompt_len": max(prompts),
            "mean_output_len": float(np.mean(outputs)), "max_output_len": max(outputs),
            "realized_rate": len(trace) / trace[-1].arrival_s if trace[-1].arrival_s else None}
