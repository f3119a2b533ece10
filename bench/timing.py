"""Timing that is right on both devices: CUDA events around the region on a GPU (after warm-up),
a synchronised host clock on the CPU; the median of repeated runs."""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch


def median_seconds(fn: Callable[[], object], device: str, *, warmup: int = 2,
                   repeat: int = 10) -> float:
    """Median wall time of `fn()` in seconds."""
    for _ in range(warmup):
        fn()
    times = []
    if device == "cuda":
        for _ in range(repeat):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
    else:
        for _ in range(repeat):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)
