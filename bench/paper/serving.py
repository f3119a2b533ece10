"""The paper's serving experiments on the real engine (reduced scale, `max_model_len` 512).

- `shared_prefix` (Fig. 16): requests that share a few-shot translation prompt (one or five
  examples of about 80 tokens each, then a short question), served with prefix caching on and
  off: output tokens per second and the prefix-cache hit rate (`prefix_cache_hits /
  prefix_cache_queries` of the KV cache manager, counted over the run).
- `block_size_latency` (Fig. 18): normalized latency (end-to-end seconds / output tokens, mean)
  at a fixed rate for each block size, the number of KV slots fixed.
- `preemption` (Fig. 19): a trace of equal requests (a long prompt, a short output) under a KV
  budget that forces preemptions at every block size (their sequences cross a block boundary
  together when the pool is full), by recompute and by swap: the time per preempted token
  (`PreemptionMeter`).

Every run is a fresh engine over the same loaded model (`engine_run.make_engine`), clocked as
`engine_run.run_trace` clocks it. Prefix caching is off in Fig. 18 and 19 (the paper's runs
have none; with it, a recomputed prefix would be found in the cache instead of recomputed).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np

from engine.model.loader import LoadedModel
from engine.request import SequenceStatus

from bench.paper import engine_run
from bench.paper.traces import TraceRequest, make_trace, trace_summary

#: The names `--figures` accepts for this module's experiments.
FIGURES = ("16", "18", "19")

#: Fig. 16's prompt: an instruction, few-shot English -> French pairs (about 80 tokens each
#: with the default model's tokenizer), then the request's own question.
HEADER = "Translate English to French.\n\n"
EXAMPLES = (
    ("The old lighthouse on the northern cliff has guided fishing boats home for more than two "
     "hundred years, and the keeper still climbs its stairs every evening.",
     "Le vieux phare de la falaise nord guide les bateaux de pêche vers le port depuis plus de "
     "deux cents ans, et le gardien monte encore ses marches chaque soir."),
    ("When the market opens on Saturday morning, farmers from the valley bring fresh bread, "
     "cheese, apples and honey to sell in the square.",
     "Quand le marché ouvre le samedi matin, les agriculteurs de la vallée apportent du pain "
     "frais, du fromage, des pommes et du miel à vendre sur la place."),
    ("My grandmother taught me to read before I went to school, and she always kept a small "
     "library of novels in the kitchen.",
     "Ma grand-mère m'a appris à lire avant que j'aille à l'école, et elle gardait toujours "
     "une petite bibliothèque de romans dans la cuisine."),
    ("The train to the mountains leaves at seven, so we should pack our bags tonight and go to "
     "bed early.",
     "Le train pour les montagnes part à sept heures, alors nous devrions faire nos valises ce "
     "soir et nous coucher tôt."),
    ("After the storm, the children walked along the beach collecting shells, pieces of wood "
     "and smooth stones.",
     "Après la tempête, les enfants se sont promenés sur la plage en ramassant des "
     "coquillages, des morceaux de bois et des pierres lisses."),
)
THINGS = ("apples", "tickets", "chairs", "books")
DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")


@dataclass(frozen=True)
class ServingSettings:
    """Sizes of the three experiments (lengths / `scale` of the paper's data sets)."""

    scale: float = 4
    max_model_len: int = 512
    prefix_shots: tuple[int, ...] = (1, 5)
    prefix_requests: int = 16
    prefix_rate: float = 20.0       # requests/s: the engine is saturated after the first
    prefix_output_len: int = 16
    prefix_blocks: int = 245        # of 16 tokens, the reduced-scale budget of bench.paper
    block_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
    block_size_slots: int = 2048
    block_size_rate: float = 20.0
    block_size_requests: tuple[tuple[str, int], ...] = (("sharegpt", 8), ("alpaca", 16))
    preemption_slots: int = 768     # 3 requests' prompts at block size 256
    preemption_rate: float = 20.0
    preemption_requests: int = 6
    preemption_prompt_len: int = 240   # crosses 256 during the output
    preemption_output_len: int = 24

    def usable_block_sizes(self, slots: int, max_len: int) -> tuple[int, ...]:
        """The block sizes up to `max_len` that divide `slots` (the slots stay fixed)."""
        return tuple(b for b in self.block_sizes if b <= max_len and slots % b == 0)


SERVING_FULL = ServingSettings()
SERVING_SMOKE = ServingSettings(prefix_shots=(1,), prefix_requests=3, prefix_output_len=2,
                                block_sizes=(16, 32), block_size_requests=(("alpaca", 3),),
                                preemption_slots=64, preemption_requests=3,
                                preemption_prompt_len=24, preemption_output_len=16)


def few_shot_prompt(shots: int, index: int) -> str:
    """The prompt of request `index` with `shots` examples (1 to len(EXAMPLES))."""
    if not 1 <= shots <= len(EXAMPLES):
        raise ValueError(f"shots: expected 1 to {len(EXAMPLES)}, got {shots!r}")
    examples = "".join(f"English: {e}\nFrench: {f}\n\n" for e, f in EXAMPLES[:shots])
    question = f"We need {index + 2} {THINGS[index % len(THINGS)]} for {DAYS[index % len(DAYS)]}."
    return f"{HEADER}{examples}English: {question}\nFrench:"


def prefix_trace(tokenizer: Any, shots: int, settings: ServingSettings, seed: int = 0
                 ) -> list[TraceRequest]:
    """Fig. 16's trace: Poisson arrivals at `prefix_rate`, few-shot prompts, outputs of
    `prefix_output_len` tokens."""
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1 / settings.prefix_rate, settings.prefix_requests))
    return [TraceRequest(f"req-{i}", float(arrivals[i]),
                         tuple(tokenizer.encode(few_shot_prompt(shots, i))),
                         settings.prefix_output_len) for i in range(settings.prefix_requests)]


def shared_prefix(loaded: LoadedModel, settings: ServingSettings, seed: int = 0) -> dict:
    """Fig. 16: per number of shots, the run with prefix caching on and off (`_prefix_run`),
    and the throughput ratio on / off."""
    out: dict = {"rate": settings.prefix_rate, "block_size": 16,
                 "kv_slots": settings.prefix_blocks * 16, "shots": {}}
    for shots in settings.prefix_shots:
        trace = prefix_trace(loaded.tokenizer, shots, settings, seed)
        runs = {name: _prefix_run(loaded, trace, settings, caching)
                for name, caching in (("on", True), ("off", False))}
        out["shots"][shots] = {
            "trace": trace_summary(trace),
            "shared_prefix_len": _common_prefix_len([r.prompt_token_ids for r in trace]),
            **runs, "throughput_ratio": runs["on"]["throughput"] / runs["off"]["throughput"]}
    return out


def _prefix_run(loaded: LoadedModel, trace: list[TraceRequest], settings: ServingSettings,
                caching: bool) -> dict:
    llm = engine_run.make_engine(loaded, block_size=16, num_kv_blocks=settings.prefix_blocks,
                                 max_model_len=settings.max_model_len,
                                 enable_prefix_caching=caching)
    kvm = llm.llm_engine.kv_cache_manager
    queries, hits = kvm.prefix_cache_queries, kvm.prefix_cache_hits
    record, _ = engine_run.run_trace(llm, trace)
    queries, hits = kvm.prefix_cache_queries - queries, kvm.prefix_cache_hits - hits
    span = max(r.finish_s for r in record.requests.values()) - min(r.arrival_s for r in trace)
    summary = record.summary(16)
    return {"throughput": sum(r.output_len for r in trace) / span, "duration_s": span,
            "prefix_cache_queries": queries, "prefix_cache_hits": hits,
            "hit_rate": hits / queries if queries else 0.0,
            "normalized_latency_mean": summary["normalized_latency_mean"],
            "mean_running": summary["mean_running"], "unfinished": summary["unfinished"]}


def _common_prefix_len(prompts: list[tuple[int, ...]]) -> int:
    first = prompts[0]
    n = len(first)
    for p in prompts[1:]:
        n = next((i for i, (a, b) in enumerate(zip(first[:n], p)) if a != b), min(n, len(p)))
    return n


def block_size_latency(loaded: LoadedModel, settings: ServingSettings, seed: int = 0) -> dict:
    """Fig. 18: per data set and block size, the normalized latency (mean, p90), mean batch and
    KV slots holding a token, with `block_size_slots` slots at every block size."""
    slots = settings.block_size_slots
    out: dict = {"rate": settings.block_size_rate, "kv_slots": slots, "datasets": {}}
    for dataset, num in settings.block_size_requests:
        trace = make_trace(dataset, settings.block_size_rate, num, seed, settings.scale,
                           settings.max_model_len)
        rows = {}
        for bs in settings.usable_block_sizes(slots, settings.max_model_len):
            llm = engine_run.make_engine(loaded, block_size=bs, num_kv_blocks=slots // bs,
                                         max_model_len=settings.max_model_len,
                                         enable_prefix_caching=False)
            s = engine_run.run_trace(llm, trace)[0].summary(bs)
            rows[bs] = {k: s[k] for k in ("normalized_latency_mean", "normalized_latency_p90",
                                          "mean_running", "token_share", "unfinished")}
        best = min(rows, key=lambda b: rows[b]["normalized_latency_mean"])
        out["datasets"][dataset] = {"trace": trace_summary(trace), "block_sizes": rows,
                                    "best": best}
    return out


class PreemptionMeter:
    """Counts, step by step, the tokens preempted (by swap or by recompute) and the tokens
    recomputed, and times the swap copies.

    Preempted tokens: a preempted sequence's computed tokens (K/V in the cache) when it is
    preempted. Recomputed tokens: tokens computed again below a sequence's high-water mark of
    computed tokens. Swap time: the wall time of the KV cache's `swap_out` and `swap_in` calls.
    """

    def __init__(self) -> None:
        self.computed: dict[int, int] = {}
        self.high: dict[int, int] = {}
        self.preempted_tokens = {"swap": 0, "recompute": 0}
        self.step_recomputed: list[int] = []
        self.step_tokens: list[int] = []
        self.swap_seconds = 0.0

    def on_step(self, out: Any) -> None:
        """After `execute_step(out)`: the step's recomputed tokens, then its preemptions."""
        recomputed = 0
        for seq, n in out.scheduled:
            after = seq.num_computed_tokens
            high = self.high.get(seq.seq_id, 0)
            recomputed += max(0, min(after, high) - (after - n))
            self.high[seq.seq_id] = max(high, after)
            self.computed[seq.seq_id] = after
        for group in out.preempted:
            for seq in group.seqs:
                swapped = seq.status is SequenceStatus.SWAPPED
                self.preempted_tokens["swap" if swapped else "recompute"] += \
                    self.computed.get(seq.seq_id, 0)
                if not swapped:
                    self.computed[seq.seq_id] = 0
        self.step_recomputed.append(recomputed)
        self.step_tokens.append(out.num_batched_tokens)

    def recompute_seconds(self, step_seconds: list[float]) -> float:
        """Each step's measured time times its share of recomputed tokens, summed."""
        assert len(step_seconds) == len(self.step_tokens), "one measured step per on_step"
        return sum(s * r / t for s, r, t in zip(step_seconds, self.step_recomputed,
                                                self.step_tokens) if t)

    @contextmanager
    def timing_swaps(self, kv_cache: Any) -> Iterator[None]:
        """While inside, `kv_cache.swap_out` and `swap_in` add their wall time to
        `swap_seconds` (the instance attributes are removed at the exit)."""
        for name in ("swap_out", "swap_in"):
            setattr(kv_cache, name, self._timed(getattr(kv_cache, name)))
        try:
            yield
        finally:
            del kv_cache.swap_out, kv_cache.swap_in

    def _timed(self, copy: Any) -> Any:
        def timed(pairs: Any) -> None:
            start = time.perf_counter()
            copy(pairs)
            if pairs:  # an empty list is a no-op of every step, not a swap
                self.swap_seconds += time.perf_counter() - start
        return timed


def preemption(loaded: LoadedModel, settings: ServingSettings, seed: int = 0) -> dict:
    """Fig. 19: per preemption mode and block size, under `preemption_slots` KV slots, the
    preemptions, tokens preempted and recomputed, and the time per preempted token: by swap,
    the swap copies' time over the tokens swapped out; by recompute, the recomputed tokens'
    share of their steps' time over the tokens preempted."""
    slots = settings.preemption_slots
    trace = preemption_trace(settings, seed)
    out: dict = {"rate": settings.preemption_rate, "kv_slots": slots,
                 "trace": trace_summary(trace), "modes": {}}
    for mode in ("recompute", "swap"):
        out["modes"][mode] = {bs: _preemption_run(loaded, trace, settings, mode, bs)
                              for bs in settings.usable_block_sizes(slots, settings.max_model_len)}
    return out


def preemption_trace(settings: ServingSettings, seed: int = 0) -> list[TraceRequest]:
    """Fig. 19's trace: Poisson arrivals at `preemption_rate`, uniform random prompts of
    `preemption_prompt_len` tokens, outputs of `preemption_output_len`."""
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1 / settings.preemption_rate,
                                         settings.preemption_requests))
    return [TraceRequest(f"req-{i}", float(arrivals[i]),
                         tuple(int(t) for t in rng.integers(0, 32000,
                                                            settings.preemption_prompt_len)),
                         settings.preemption_output_len)
            for i in range(settings.preemption_requests)]


def _preemption_run(loaded: LoadedModel, trace: list[TraceRequest], settings: ServingSettings,
                    mode: str, bs: int) -> dict:
    llm = engine_run.make_engine(loaded, block_size=bs,
                                 num_kv_blocks=settings.preemption_slots // bs,
                                 max_model_len=settings.max_model_len,
                                 enable_prefix_caching=False, preemption_mode=mode)
    meter = PreemptionMeter()
    before = llm.llm_engine.scheduler.num_preemptions
    with meter.timing_swaps(llm.llm_engine.kv_cache):
        record, samples = engine_run.run_trace(llm, trace, on_step=meter.on_step)
    recompute_s = meter.recompute_seconds([s.seconds for s in samples])
    seconds = meter.swap_seconds if mode == "swap" else recompute_s
    tokens = meter.preempted_tokens[mode]
    summary = record.summary(bs)
    return {"preemptions": llm.llm_engine.scheduler.num_preemptions - before,
            "preempted_tokens": dict(meter.preempted_tokens),
            "recomputed_tokens": sum(meter.step_recomputed),
            "swap_seconds": meter.swap_seconds, "recompute_seconds": recompute_s,
            "seconds_per_token": seconds / tokens if tokens else None,
            "normalized_latency_mean": summary["normalized_latency_mean"],
            "duration_s": summary["duration_s"], "unfinished": summary["unfinished"]}


def measure(figures: tuple[str, ...], loaded: LoadedModel, settings: ServingSettings,
            seed: int = 0) -> dict:
    """The numbers of the selected figures of `FIGURES`, under their JSON keys."""
    runs = {"16": ("shared_prefix", shared_prefix), "18": ("block_size", block_size_latency),
            "19": ("preemption", preemption)}
    return {runs[f][0]: runs[f][1](loaded, settings, seed) for f in figures if f in runs}

