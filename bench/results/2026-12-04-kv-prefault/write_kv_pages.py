"""`write_kv` of 1365 tokens (a prefill step's share at 16 x 256 tokens; 3 KV heads of 64, bf16)
into each of 30 layers' caches of one pool (`paged_kernels.zeros_cache`, 4000 blocks of 16 a
layer), round after round into fresh slots, then again into slots written before. MODE `lazy`:
the pool as allocated; `prefault`: after `paged_kernels.prefault` (timed). Prints ms per call.

    python write_kv_pages.py MODE
"""

from __future__ import annotations

import sys
import time

import torch

import paged_kernels as pk

TOKENS = 1365


def main() -> None:
    mode = sys.argv[1]
    pool = pk.zeros_cache((30, 2, 4000, 3, 16, 64), torch.bfloat16)
    if mode == "prefault":
        t = time.perf_counter()
        pk.prefault(pool)
        print(f"prefault of {pool.numel() * 2 / 2**30:.2f} GiB: {time.perf_counter() - t:.2f} s")
    key, value = torch.randn(TOKENS, 3, 64).bfloat16(), torch.randn(TOKENS, 3, 64).bfloat16()
    for label, rnd in [("fresh", r) for r in range(4)] + [("again", 1), ("again", 2)]:
        slots = torch.arange(rnd * TOKENS, (rnd + 1) * TOKENS)
        taken = []
        for layer in range(30):
            t = time.perf_counter()
            pk.write_kv(key, value, pool[layer, 0], pool[layer, 1], slots, backend="cpu")
            taken.append(time.perf_counter() - t)
        print(f"{mode} slots {rnd * TOKENS}-{(rnd + 1) * TOKENS} ({label}): "
              f"{sum(taken) / 30 * 1e3:.3f} ms per call", flush=True)


if __name__ == "__main__":
    main()
