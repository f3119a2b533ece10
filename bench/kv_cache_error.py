"""Attention error of 8-bit KV caches against float64 attention on the unquantised K/V.

The conformance suite checks kernels against the oracle on the *dequantised* cache (exact
inputs); this measures what quantisation itself costs. For each cache dtype (bfloat16 as the
baseline, fp8 e4m3fn, fp8 e5m2, int8) and scale form (per tensor, per KV head), random K/V whose
KV heads differ in magnitude (x1 to x`--head-spread`, channel 0 of each an outlier, x4) are written
through `write_kv` with amax scales (`amax / format max`), then a decode step runs through
`paged_attention`; the output is compared with float64 attention on the float64 K/V:
relative norm error and the largest absolute error.

    python -m bench.kv_cache_error [--backends reference,cpu] [--context 1024] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Optional

import torch

import paged_kernels as pk
from paged_kernels.kv_quant import FP8_MAX, INT8_RANGE

CACHE_DTYPES = (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2, torch.int8)


def format_max(dtype: torch.dtype) -> float:
    """The largest magnitude the cache dtype stores (the amax scale maps amax onto it)."""
    return FP8_MAX[dtype] if dtype in FP8_MAX else float(INT8_RANGE[1])


def make_kv(num_seqs: int, context: int, num_kv_heads: int, head_size: int, spread: float,
            gen: torch.Generator) -> torch.Tensor:
    """float64 `[2, num_seqs * context, num_kv_heads, head_size]`: K and V, head h scaled by
    spread ** (h / (num_kv_heads - 1)), channel 0 of each head an outlier (x4)."""
    kv = torch.randn(2, num_seqs * context, num_kv_heads, head_size, generator=gen,
                     dtype=torch.float64)
    steps = torch.arange(num_kv_heads, dtype=torch.float64) / max(num_kv_heads - 1, 1)
    kv = kv * (spread ** steps).view(1, 1, -1, 1)
    kv[..., 0] *= 4
    return kv


def amax_scales(x: torch.Tensor, dtype: torch.dtype, per_head: bool) -> torch.Tensor:
    """float32 scales mapping the amax (per KV head, or over the tensor) onto the format's max."""
    amax = x.abs().amax(dim=(0, 2)) if per_head else x.abs().max().expand(x.shape[1])
    return (amax / format_max(dtype)).float().contiguous()


def dense_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_seqs: int,
                 context: int) -> torch.Tensor:
    """float64 decode attention: query row s attends to sequence s's `context` keys."""
    num_heads, head_size = q.shape[1], q.shape[2]
    group = num_heads // k.shape[1]
    k = k.view(num_seqs, context, -1, head_size).repeat_interleave(group, dim=2)
    v = v.view(num_seqs, context, -1, head_size).repeat_interleave(group, dim=2)
    s = torch.einsum("shd,sthd->sht", q.double(), k) / math.sqrt(head_size)
    return torch.einsum("sht,sthd->shd", torch.softmax(s, dim=-1), v)


def measure(backend: str, dtype: torch.dtype, per_head: Optional[bool], kv: torch.Tensor,
            q: torch.Tensor, num_seqs: int, context: int, block_size: int) -> dict:
    """One cache dtype and scale form on one backend: the decode output's errors."""
    tokens, num_kv_heads, head_size = kv.shape[1:]
    num_blocks = tokens // block_size
    storage = torch.uint8 if dtype != torch.bfloat16 else dtype
    caches = [torch.zeros(num_blocks, num_kv_heads, block_size, head_size, dtype=storage)
              .view(dtype) for _ in range(2)]
    scales = {}
    if per_head is not None:
        scales = {"k_scale": amax_scales(kv[0], dtype, per_head),
                  "v_scale": amax_scales(kv[1], dtype, per_head)}
    rows = kv.to(torch.bfloat16)
    pk.write_kv(rows[0], rows[1], *caches, torch.arange(tokens), backend=backend, **scales)
    tables = torch.arange(num_blocks, dtype=torch.int32).view(num_seqs, -1)
    lens = torch.full((num_seqs,), context, dtype=torch.int32)
    out = pk.paged_attention(q, *caches, tables, lens, backend=backend, **scales)
    want = dense_decode(q, kv[0], kv[1], num_seqs, context)
    err = out.double() - want
    return {"backend": backend, "cache": str(dtype).replace("torch.", ""),
            "scales": {None: "-", False: "per tensor", True: "per KV head"}[per_head],
            "rel_error": float(err.norm() / want.norm()), "max_abs_error": float(err.abs().max())}


def run(backends: list[str], num_seqs: int, context: int, num_heads: int, num_kv_heads: int,
        head_size: int, block_size: int, spread: float, seed: int) -> list[dict]:
    """Every backend x cache dtype x scale form on one random problem."""
    gen = torch.Generator().manual_seed(seed)
    kv = make_kv(num_seqs, context, num_kv_heads, head_size, spread, gen)
    q = torch.randn(num_seqs, num_heads, head_size, generator=gen).to(torch.bfloat16)
    rows = []
    for backend in backends:
        for dtype in CACHE_DTYPES:
            forms = (None,) if dtype == torch.bfloat16 else (False, True)
            rows += [measure(backend, dtype, f, kv, q, num_seqs, context, block_size)
                     for f in forms]
    return rows


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="reference",
                        help="comma-separated backend names (default: reference)")
    parser.add_argument("--num-seqs", type=int, default=4)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--heads", type=int, nargs=2, default=(32, 8),
                        metavar=("NUM_HEADS", "NUM_KV_HEADS"))
    parser.add_argument("--head-size", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--head-spread", type=float, default=4.0,
                        help="largest / smallest KV head magnitude (default 4)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="also write the rows as JSON to this file")
    args = parser.parse_args(argv)
    if args.context % args.block_size:
        parser.error(f"--context must be a multiple of --block-size, got {args.context}")
    rows = run(args.backends.split(","), args.num_seqs, args.context, args.heads[0],
               args.heads[1], args.head_size, args.block_size, args.head_spread, args.seed)
    print("| backend | cache | scales | rel. error | max abs. error |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['backend']} | {r['cache']} | {r['scales']} | {r['rel_error']:.2e} | "
              f"{r['max_abs_error']:.2e} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
