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

import torch

import cpu_impl.backend as cpu_backend
from bench.build_ab import steps_in_turns, timed_attention
from bench.serve_profile import decoding_engine
from engine.model.loader import load_model


def main() -> None:
    rounds, batch = int(sys.argv[1]), int(sys.argv[2])
    distances = [int(a) for a in sys.argv[3:]]
    torch.set_num_threads(2)
    attention: list[float] = []
    timed_attention(cpu_backend.CpuBackend, attention)
    loaded = load_model(None, dtype=torch.bfloat16, quantization="gguf")
    engine = decoding_engine(loaded, batch, max_tokens=900,
                             kv_cache_dtype=os.environ.get("KV_CACHE_DTYPE", "auto"))
    switches = [lambda n=lines: setattr(cpu_backend, "prefetch_lines", n) for lines in distances]
    times, in_attention = steps_in_turns(engine, switches, rounds, attention)
    for lines, ms, att in zip(distances, times, in_attention):
        print(f"prefetch_lines {lines}: median {statistics.median(ms):.2f} ms, mean "
              f"{statistics.mean(ms):.2f} ms per step over {len(ms)} rounds of 10; attention "
              f"median {statistics.median(att):.2f} ms per step")


if __name__ == "__main__":
    main()
