"""What one run records, and the figures' numbers computed from it.

A run (the replay or the real engine) appends one `StepRecord` per engine step: the clock after
the step, the requests running, and the KV cache manager's `memory_stats()` then (slot counts of
`engine.kv_cache_manager.KVMemoryStats`). It records each request's arrival, first-token and
finish times on the same clock (seconds) and its output length.

Averages are over steps that hold at least one allocated slot (an idle engine has no share).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Optional

import numpy as np

#: The slot counts kept from each `memory_stats()` (the rest are derived from them).
SLOT_FIELDS = ("total_slots", "allocated_slots", "token_slots", "reserved_unused_slots",
               "internal_fragment_slots", "free_slots", "shared_blocks_saved")


@dataclass
class StepRecord:
    """The state after one step: clock (s), running requests, memory slot counts."""

    clock_s: float
    num_running: int
    memory: dict[str, int]


@dataclass
class RequestRecord:
    """One request's times on the run's clock and the tokens it generated (per sequence)."""

    arrival_s: float
    output_len: int
    first_token_s: Optional[float] = None
    finish_s: Optional[float] = None


@dataclass
class RunRecord:
    """Steps and requests of one run, and the figures' numbers (`summary`)."""

    steps: list[StepRecord] = field(default_factory=list)
    requests: dict[str, RequestRecord] = field(default_factory=dict)

    def add_step(self, clock_s: float, num_running: int, stats: Any) -> None:
        """Records a step; `stats` is a `KVMemoryStats` (or anything with its slot fields)."""
        memory = {name: int(getattr(stats, name)) for name in SLOT_FIELDS}
        self.steps.append(StepRecord(clock_s, num_running, memory))

    # ------------------------------------------------------------------ memory
    def _busy(self) -> list[dict[str, int]]:
        return [s.memory for s in self.steps if s.memory["allocated_slots"] > 0]

    def token_share(self) -> float:
        """Mean over steps of token_slots / allocated_slots (the paper's Fig. 2 number)."""
        busy = self._busy()
        return float(np.mean([m["token_slots"] / m["allocated_slots"] for m in busy])) \
            if busy else float("nan")

    def pool_split(self) -> dict[str, float]:
        """Mean over steps of each part of the pool over total_slots: tokens, reserved-unused,
        internal fragmentation (last blocks), free (they sum to 1)."""
        busy = self._busy()
        parts = {"tokens": "token_slots", "reserved_unused": "reserved_unused_slots",
                 "internal_fragmentation": "internal_fragment_slots", "free": "free_slots"}
        return {k: float(np.mean([m[v] / m["total_slots"] for m in busy])) if busy
                else float("nan") for k, v in parts.items()}

    def sharing_saved(self, block_size: int) -> float:
        """Mean over steps of blocks saved by sharing / (allocated blocks + saved)."""
        busy = self._busy()
        shares = [m["shared_blocks_saved"] /
                  (m["allocated_slots"] / block_size + m["shared_blocks_saved"]) for m in busy]
        return float(np.mean(shares)) if shares else float("nan")

    def mean_running(self) -> float:
        """Mean over steps of the number of running requests (the paper's Fig. 13)."""
        return float(np.mean([s.num_running for s in self.steps])) if self.steps else 0.0

    # ----------------------------------------------------------------- latency
    def normalized_latencies(self) -> list[float]:
        """Per finished request: (finish - arrival) seconds / output tokens."""
        return [(r.finish_s - r.arrival_s) / r.output_len for r in self.requests.values()
                if r.finish_s is not None]

    def summary(self, block_size: int) -> dict:
        """The figures' numbers of this run, JSON-ready."""
        lat = self.normalized_latencies()
        unfinished = sum(1 for r in self.requests.values() if r.finish_s is None)
        return {"steps": len(self.steps), "token_share": self.token_share(),
                "pool_split": self.pool_split(), "mean_running": self.mean_running(),
                "sharing_saved": self.sharing_saved(block_size),
                "normalized_latency_mean": float(np.mean(lat)) if lat else float("nan"),
                "normalized_latency_p90": float(np.percentile(lat, 90)) if lat else float("nan"),
                "duration_s": self.steps[-1].clock_s if self.steps else 0.0,
                "unfinished": unfinished}

    def as_dict(self) -> dict:
        return {"steps": [asdict(s) for s in self.steps],
                "requests": {k: asdict(v) for k, v in self.requests.items()}}
