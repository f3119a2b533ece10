"""The engine's decode attention shape, 30 layers, with the cpu backend's read-ahead off and on
in turns in one process.

    python read_ahead_ab.py CONTEXT

Each of 30 layers is its own problem (16 sequences x CONTEXT tokens, 9 query heads over 3 KV
heads, head size 64, block size 16, bf16, random block tables), so a step reads every layer's
K/V from memory as the engine's does. 12 rounds; each round times one 30-layer step per setting.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

import cpu_impl.backend as cpu_backend
import paged_kernels as pk
from bench.shapes import make_mixed

LAYERS = 30


def main() -> None:
    torch.set_num_threads(2)
    ctx = int(sys.argv[1])
    problems = [make_mixed([ctx] * 16, [1] * 16, num_heads=9, num_kv_heads=3, head_size=64,
                           seed=i) for i in range(LAYERS)]
    outs = [torch.empty_like(p.query) for p in problems]

    def step() -> None:
        for p, o in zip(problems, outs):
            pk.paged_attention(p.query, p.key_cache, p.value_cache, p.block_tables, p.seq_lens,
                               out=o, backend="cpu", check=False)

    print("default read_ahead", cpu_backend.read_ahead)
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(12):
        for read_ahead in (False, True):
            cpu_backend.read_ahead = read_ahead
            t0 = time.perf_counter()
            step()
            times[read_ahead].append(time.perf_counter() - t0)
    for read_ahead, t in times.items():
        print(f"ctx {ctx} read_ahead={read_ahead}: median {statistics.median(t) * 1e3:.2f} ms "
              f"min {min(t) * 1e3:.2f}")


if __name__ == "__main__":
    main()
