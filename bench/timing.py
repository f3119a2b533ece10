"""Timing that is right on both devices: CUDA events around the region on a GPU (after warm-up),
a synchronised host clock on the CPU; the median of repeated runs."""

from __future__ import annotations

import statistics
import time
from typing import Callable, Sequence

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


def seconds_in_turns(fns: Sequence[Callable[[], object]], rounds: int) -> list[list[float]]:
    """Wall seconds of each of `fns` in every one of `rounds` rounds, the functions called in
    turns within a round (so that a drift in the machine's speed falls on all of them alike): the
    in-process A/B method of the scripts under bench/results. No warm-up call."""
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(rounds):
        for fn, taken in zip(fns, times):
            t0 = time.perf_counter()
            fn()
            taken.append(time.perf_counter() - t0)
    return times
