"""Decode over an 8-bit KV cache against a bfloat16 one on the `cpu` backend, in the same run:
time per call, speed-up over bfloat16, and GB/s of cache read.

The problem is the issue's decode shape: `--seqs` sequences of `--context` tokens (16 x 4096),
32 query heads over 8 KV heads, block size 16, bfloat16 queries, per head size. The 8-bit caches
hold the bfloat16 cache's K/V written by `write_kv` (per-KV-head scales from the amax, so the
codes span the format); each call reads the same blocks. Variants are timed in turns (round
robin, `--rounds` rounds of `bench.timing.median_seconds`), and each variant's time is the
median of its rounds, so that a change in the machine's load falls on every variant alike. The
process CPU time per call (all threads, median over every call) is reported next to the wall
time: on a shared machine it leaves out the time other processes held the cores.

"GB/s of cache read" counts the bytes the attention needs, every K and V row of every sequence
once, in the cache's own width (1 byte an element for 8-bit, 2 for bfloat16), over the wall time
of the call; the copy bandwidth of the same run (`bench.ceilings`, read + written) is the scale.

Each cache is timed in two kinds of memory (`--pages`): transparent huge pages
(`paged_kernels.empty_cache`, as the engine allocates its cache) and the 4 KiB pages of
`torch.empty`; the speed-up over bfloat16 compares caches in the same kind.

    python -m bench.kv_quant_speed [--head-sizes 64 128] [--threads 2] [--pages huge 4k]
                                   [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Callable, Optional, Sequence

import torch

import paged_kernels as pk
from bench.ceilings import copy_bandwidth
from bench.shapes import BenchProblem, make_mixed
from bench.timing import median_seconds

#: Cache dtypes timed against bfloat16, and the largest magnitude of each (the scale maps the
#: amax of each KV head there).
CACHE_DTYPES = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0, torch.int8: 127.0}
#: Kinds of cache memory: name -> allocator `(shape, dtype=) -> tensor`.
PAGES: dict[str, Callable[..., torch.Tensor]] = {"huge": pk.empty_cache, "4k": torch.empty}


def placed(cache: torch.Tensor, pages: str) -> torch.Tensor:
    """A copy of `cache` in memory of the kind `pages`."""
    out = PAGES[pages](tuple(cache.shape), dtype=cache.dtype)
    out.copy_(cache)
    return out


def quantized_caches(p: BenchProblem, dtype: torch.dtype, pages: str = "4k"
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(key_cache, value_cache, k_scale, v_scale): `p`'s caches written into `dtype` caches (in
    memory of the kind `pages`) by the cpu backend's `write_kv`, slot for slot, with per-KV-head
    scales amax / format max."""
    num_blocks, heads, block_size, head_size = p.key_cache.shape
    slots = torch.arange(num_blocks * block_size)
    out = []
    scales = []
    for cache in (p.key_cache, p.value_cache):
        rows = cache.permute(0, 2, 1, 3).reshape(-1, heads, head_size)
        amax = rows.float().abs().amax(dim=(0, 2)).clamp(min=1e-6)
        scales.append(amax / CACHE_DTYPES[dtype])
        out.append(PAGES[pages](tuple(cache.shape), dtype=dtype))
    pk.write_kv(p.key_cache.permute(0, 2, 1, 3).reshape(-1, heads, head_size),
                p.value_cache.permute(0, 2, 1, 3).reshape(-1, heads, head_size),
                out[0], out[1], slots, k_scale=scales[0], v_scale=scales[1], backend="cpu")
    return out[0], out[1], scales[0], scales[1]


def cache_bytes_read(p: BenchProblem, element_size: int) -> int:
    """K and V rows of every sequence, once each, in a cache of `element_size` bytes."""
    heads, head_size = p.key_cache.shape[1], p.key_cache.shape[3]
    return 2 * int(p.seq_lens.sum()) * heads * head_size * element_size


def decode_calls(p: BenchProblem, pages: str = "4k"
                 ) -> dict[str, tuple[Callable[[], object], int]]:
    """Per cache name ("bfloat16", "float8_e4m3fn", ...): a decode call over caches in memory of
    the kind `pages`, and its cache bytes."""
    out = torch.empty_like(p.query)
    calls: dict[str, tuple[Callable[[], object], int]] = {}

    def call(k, v, ks, vs):
        return lambda: pk.paged_attention(p.query, k, v, p.block_tables, p.seq_lens, out=out,
                                          k_scale=ks, v_scale=vs, backend="cpu")

    calls["bfloat16"] = (call(placed(p.key_cache, pages), placed(p.value_cache, pages), None,
                              None), cache_bytes_read(p, 2))
    for dtype in CACHE_DTYPES:
        k, v, ks, vs = quantized_caches(p, dtype, pages)
        calls[str(dtype).removeprefix("torch.")] = (call(k, v, ks, vs), cache_bytes_read(p, 1))
    return calls


def with_cpu_time(fn: Callable[[], object], cpu: list[float]) -> Callable[[], object]:
    """`fn` that appends the process CPU time of each call to `cpu`."""
    def timed():
        t0 = time.process_time()
        fn()
        cpu.append(time.process_time() - t0)
    return timed


def measure(head_size: int, seqs: int, context: int, rounds: int, repeat: int,
            pages: Sequence[str] = ("huge", "4k")) -> list[dict]:
    """One row per kind of memory and cache dtype for this head size: median wall time over the
    rounds, median CPU time per call, speed-ups over bfloat16 in the same kind of memory, GB/s
    of cache read."""
    p = make_mixed([context] * seqs, [1] * seqs, head_size=head_size, dtype=torch.bfloat16)
    calls = {(kind, name): call for kind in pages
             for name, call in decode_calls(p, kind).items()}
    times: dict[tuple[str, str], list[float]] = {key: [] for key in calls}
    cpu: dict[tuple[str, str], list[float]] = {key: [] for key in calls}
    for _ in range(rounds):
        for key, (fn, _) in calls.items():
            timed = with_cpu_time(fn, cpu[key])
            times[key].append(median_seconds(timed, "cpu", warmup=1, repeat=repeat))
    rows = []
    for (kind, name), (_, nbytes) in calls.items():
        base = statistics.median(times[kind, "bfloat16"])
        base_cpu = statistics.median(cpu[kind, "bfloat16"])
        t, c = statistics.median(times[kind, name]), statistics.median(cpu[kind, name])
        rows.append({"head_size": head_size, "pages": kind, "cache": name, "seconds": t,
                     "round_seconds": times[kind, name], "speedup_vs_bf16": base / t,
                     "cpu_seconds": c, "cpu_speedup_vs_bf16": base_cpu / c,
                     "cache_bytes": nbytes, "cache_GBps": nbytes / t / 1e9})
    return rows


def table(rows: list[dict], copy_gbps: float) -> str:
    """The rows as a Markdown table."""
    lines = [f"copy bandwidth (read + written): {copy_gbps:.1f} GB/s", "",
             "| head size | pages | cache | ms / call | x bf16 | cache GB/s | CPU ms / call "
             "| x bf16 (CPU) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['head_size']} | {r['pages']} | {r['cache']} | "
                     f"{r['seconds'] * 1e3:.2f} | "
                     f"{r['speedup_vs_bf16']:.2f} | {r['cache_GBps']:.2f} | "
                     f"{r['cpu_seconds'] * 1e3:.2f} | {r['cpu_speedup_vs_bf16']:.2f} |")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--head-sizes", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5, help="turns over the variants")
    ap.add_argument("--repeat", type=int, default=3, help="calls per variant per turn")
    ap.add_argument("--pages", nargs="+", choices=sorted(PAGES), default=["huge", "4k"],
                    help="kinds of cache memory (huge: transparent huge pages; 4k: torch.empty)")
    ap.add_argument("--out", help="write the rows and the run's settings as JSON")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    copy = copy_bandwidth("cpu")
    rows = []
    for head_size in args.head_sizes:
        rows += measure(head_size, args.seqs, args.context, args.rounds, args.repeat,
                        args.pages)
    print(table(rows, copy["copy_GBps"]))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"settings": vars(args), "copy": copy, "rows": rows,
                       "load_average_before_after": [load_before, os.getloadavg()]}, f, indent=1)


if __name__ == "__main__":
    main()
