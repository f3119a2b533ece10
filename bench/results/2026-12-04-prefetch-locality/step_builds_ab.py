"""Decode steps of one engine (default model, gguf, bfloat16, batch BATCH, 2 threads) with
cpu-backend builds swapped in turns, 10 steps at a time, in one process. Each variant is
`PATH@LINES` or `PATH@LINES@ra`: a compiled extension, its `prefetch_lines`, and `ra` for the
decode read-ahead on (csrc/read_ahead.h):

    python step_builds_ab.py ROUNDS BATCH VARIANT [VARIANT ...]

Prints each variant's median and mean ms per decode step over the rounds, and the median ms per
step spent in the backend's `paged_attention` calls (30 layers)."""

from __future__ import annotations

import statistics
import sys
import time

import torch

import cpu_impl.backend as cpu_backend
import paged_kernels as pk
from bench.build_ab import load_extension
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
    variants = [(load_extension(v.split("@")[0]), int(v.split("@")[1]), v.endswith("@ra"))
                for v in sys.argv[3:]]
    torch.set_num_threads(2)
    cpu_backend.CpuBackend.paged_attention = timed_attention(cpu_backend.CpuBackend.paged_attention)
    backend = pk.backends.get_backend("cpu")
    loaded = load_model(None, dtype=torch.bfloat16, quantization="gguf")
    engine = decoding_engine(loaded, batch, max_tokens=900)
    times: list[list[float]] = [[] for _ in variants]
    attention: list[list[float]] = [[] for _ in variants]
    for _ in range(rounds):
        for i, (ext, lines, read_ahead) in enumerate(variants):
            backend._ext = ext
            cpu_backend.prefetch_lines = lines
            cpu_backend.read_ahead = read_ahead
            engine.step()  # first step after the switch: not timed
            ATTENTION.clear()
            t = time.perf_counter()
            for _ in range(10):
                engine.step()
            times[i].append((time.perf_counter() - t) / 10 * 1e3)
            attention[i].append(sum(ATTENTION) / 10 * 1e3)
    for name, ms, att in zip(sys.argv[3:], times, attention):
        print(f"{name.rsplit('/', 1)[-1]}: median {statistics.median(ms):.2f} ms, mean "
              f"{statistics.mean(ms):.2f} ms per step over {len(ms)} rounds of 10; attention "
              f"median {statistics.median(att):.2f} ms per step", flush=True)


if __name__ == "__main__":
    main()
