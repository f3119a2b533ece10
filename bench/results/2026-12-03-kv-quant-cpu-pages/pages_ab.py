"""Same-process A/B of one decode problem with its caches in 4 KiB pages and in huge pages.

    python bench/results/2026-12-03-kv-quant-cpu-pages/pages_ab.py [THREADS]

16 sequences x 4096 tokens, 32 query heads over 8 KV heads, block size 16, bfloat16 query, head
sizes 64 and 128; bfloat16, float8_e4m3fn and int8 caches (bench.kv_quant_speed's), each copied
into `torch.empty` and into `paged_kernels.empty_cache`; every variant in turns, 5 rounds of
`median_seconds` (5 calls), median ms per call."""

from __future__ import annotations

import statistics
import sys

import torch

import paged_kernels as pk
from bench.kv_quant_speed import quantized_caches
from bench.shapes import make_mixed
from bench.timing import median_seconds


def decode_call(p, out, k, v, ks, vs):
    """The cpu backend's decode of problem `p` over caches `k`, `v` (scales `ks`, `vs`)."""
    return lambda: pk.paged_attention(p.query, k, v, p.block_tables, p.seq_lens, out=out,
                                      k_scale=ks, v_scale=vs, backend="cpu")


def main() -> None:
    torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
    for d in (64, 128):
        p = make_mixed([4096] * 16, [1] * 16, head_size=d, dtype=torch.bfloat16)
        out = torch.empty_like(p.query)
        caches = {"bf16": (p.key_cache, p.value_cache, None, None),
                  "e4m3": quantized_caches(p, torch.float8_e4m3fn),
                  "int8": quantized_caches(p, torch.int8)}
        variants = {}
        for name, (k, v, ks, vs) in caches.items():
            kh = pk.empty_cache(tuple(k.shape), k.dtype)
            vh = pk.empty_cache(tuple(v.shape), v.dtype)
            kh.copy_(k)
            vh.copy_(v)
            for pages, (kk, vv) in (("4k", (k, v)), ("huge", (kh, vh))):
                variants[f"{name}-{pages}"] = decode_call(p, out, kk, vv, ks, vs)
        times = {n: [] for n in variants}
        for _ in range(5):
            for n, fn in variants.items():
                times[n].append(median_seconds(fn, "cpu", warmup=1, repeat=5))
        base = {pg: statistics.median(times[f"bf16-{pg}"]) for pg in ("4k", "huge")}
        for n in variants:
            t, pg = statistics.median(times[n]), n.split("-")[1]
            print(f"d{d} {n:10s} {t * 1e3:7.2f} ms  x bf16 same pages {base[pg] / t:4.2f}")


if __name__ == "__main__":
    main()
