"""A snapshot of the engine's state, with vLLM's metric names."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class EngineStats:
    """Counts at one moment. `kv_cache_usage_perc` is the share of device KV blocks in use, in
    [0, 1] (as vLLM's gauge of that name); prefix-cache counters are in tokens since start.
    The `spec_decode_*` counters (vLLM's names, zero without speculative decoding) count since
    start: verification steps with at least one proposal, proposed tokens, accepted tokens, and
    accepted tokens by position (index 0: the first proposal of a step)."""

    num_running: int
    num_waiting: int
    num_swapped: int
    kv_cache_usage_perc: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_free_blocks: int
    num_total_blocks: int
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: tuple[int, ...] = field(default_factory=tuple)

    def as_dict(self) -> dict:
        return asdict(self)
