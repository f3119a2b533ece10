"""Microseconds per one-shot `paged_kernels.paged_attention` call on the cpu backend at a tiny
decode (1 sequence of 16 tokens, 8 query heads over 8 KV heads, head size 64), where the call's
Python checks outweigh the kernel: bfloat16 and the 8-bit caches with per-KV-head scale tensors.

    PYTHONPATH=<checkout> python api_overhead.py [SECONDS]
"""

from __future__ import annotations

import sys
import time

import torch

import paged_kernels as pk
from bench.kv_quant_speed import quantized_caches
from bench.shapes import make_mixed


def main() -> None:
    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 2.0
    torch.set_num_threads(1)
    p = make_mixed([16], [1], head_size=64, num_heads=8, num_kv_heads=8, dtype=torch.bfloat16)
    out = torch.empty_like(p.query)
    caches = {"bfloat16": (p.key_cache, p.value_cache, None, None)}
    for dtype in (torch.float8_e4m3fn, torch.int8):
        caches[str(dtype).removeprefix("torch.")] = quantized_caches(p, dtype)
    for name, (k, v, ks, vs) in caches.items():
        def call(k=k, v=v, ks=ks, vs=vs) -> None:
            pk.paged_attention(p.query, k, v, p.block_tables, p.seq_lens, out=out, k_scale=ks,
                               v_scale=vs, backend="cpu")
        call()
        best = float("inf")
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            t0 = time.perf_counter()
            for _ in range(100):
                call()
            best = min(best, (time.perf_counter() - t0) / 100)
        print(f"{name:14s} {best * 1e6:6.1f} us per call", flush=True)


if __name__ == "__main__":
    main()
