"""The issue's 8-bit decode shape (bench/kv_quant_speed.py: 16 sequences x 4096 tokens, 32 query
heads over 8 KV heads, block size 16, bfloat16 query, caches in transparent huge pages) with the
cpu backend's paced prefetch at each distance of LINES, every (cache, distance) pair timed in
turns in one process:

    python quant_ab.py THREADS ROUNDS LINES [LINES ...]

Prints, per head size and cache, the median ms per call at each distance and the speed-up of
each 8-bit cache over bfloat16 at the same distance."""

from __future__ import annotations

import statistics
import sys

import torch

import cpu_impl.backend as cpu_backend
from bench.kv_quant_speed import decode_calls
from bench.shapes import make_mixed
from bench.timing import median_seconds


def with_distance(fn, lines: int):
    """`fn` run with `cpu_impl.backend.prefetch_lines` set to `lines`."""
    def call():
        cpu_backend.prefetch_lines = lines
        return fn()
    return call


def main() -> None:
    threads, rounds = int(sys.argv[1]), int(sys.argv[2])
    distances = [int(a) for a in sys.argv[3:]]
    torch.set_num_threads(threads)
    for head_size in (64, 128):
        p = make_mixed([4096] * 16, [1] * 16, head_size=head_size, dtype=torch.bfloat16)
        calls = {(name, lines): with_distance(fn, lines)
                 for name, (fn, _) in decode_calls(p, "huge").items() for lines in distances}
        times = {key: [] for key in calls}
        for _ in range(rounds):
            for key, fn in calls.items():
                times[key].append(median_seconds(fn, "cpu", warmup=1, repeat=3))
        for (name, lines), t in times.items():
            ms = statistics.median(t) * 1e3
            base = statistics.median(times["bfloat16", lines]) * 1e3
            print(f"d{head_size} {name:14s} prefetch_lines {lines:4d}: {ms:7.2f} ms"
                  f"  x bf16 {base / ms:.2f}", flush=True)
    cpu_backend.prefetch_lines = cpu_backend.PREFETCH_LINES


if __name__ == "__main__":
    main()
