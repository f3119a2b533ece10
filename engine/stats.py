"""A snapshot of the engine's state, with vLLM's metric names."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class EngineStats:
    """Counts at one moment. `kv_cache_usage_perc` is the share of device KV blocks in use, in
    [0, 1] (as vLLM's gauge of that name); prefix-cache counters are in tokens since start."""

    num_running: int
    num_waiting: int
    num_swapped: int
    kv_cache_usage_perc: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_free_blocks: int
    num_total_blocks: int

    def as_dict(self) -> dict:
        return asdict(self)
