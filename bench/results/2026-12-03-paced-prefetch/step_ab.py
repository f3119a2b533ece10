"""Decode steps of one engine (default model, gguf, bfloat16, batch BATCH; the KV cache's dtype
from the environment variable KV_CACHE_DTYPE, default "auto") with the cpu
backend's paced prefetch at each distance of LINES in turns (`cpu_impl.backend.prefetch_lines`,
read at every call), 10 steps at a time, in one process:

    python step_ab.py ROUNDS BATCH LINES [LINES ...]

Prints each distance's median and mean ms per decode step over the rounds, and the median ms per
step spent in the backend's `paged_attention` calls (30 layers)."""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch

import cpu_impl.backend as cpu_backend
from bench.serve_profile import decoding_engine
from engine.model.loader import load_model


ATTENTION: list[float] = []


def timed_attention(original):
    """`CpuBackend.paged_attention` that adds each call's seconds to ATTENTION."""
    def call(self, problem):
        t = time.perf_counter()
        original(self, problem)
        ATTENTION.append(time.perf_counter() - t)
    return call


def main() -> None:
    rounds, batch = int(sys.argv[1]), int(sys.argv[2])
    distances = [int(a) for a in sys.argv[3:]]
    torch.set_num_threads(2)
    cpu_backend.CpuBackend.paged_attention = timed_attention(cpu_backend.CpuBackend.paged_attention)
    loaded = load_model(None, dtype=torch.bfloat16, quantization="gguf")
    engine = decoding_engine(loaded, batch, max_tokens=900,
                             kv_cache_dtype=os.environ.get("KV_CACHE_DTYPE", "auto"))
    times: list[list[float]] = [[] for _ in distances]
    attention: list[list[float]] = [[] for _ in distances]
    for _ in range(rounds):
        for i, lines in enumerate(distances):
            cpu_backend.prefetch_lines = lines
            engine.step()  # first step after the switch: not timed
            ATTENTION.clear()
            t = time.perf_counter()
            for _ in range(10):
                engine.step()
            times[i].append((time.perf_counter() - t) / 10 * 1e3)
            attention[i].append(sum(ATTENTION) / 10 * 1e3)
    for lines, ms, att in zip(distances, times, attention):
        print(f"prefetch_lines {lines}: median {statistics.median(ms):.2f} ms, mean "
              f"{statistics.mean(ms):.2f} ms per step over {len(ms)} rounds of 10; attention "
              f"median {statistics.median(att):.2f} ms per step")


if __name__ == "__main__":
    main()
