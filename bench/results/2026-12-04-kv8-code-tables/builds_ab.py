"""In-process A/B of cpu-backend builds on the 8-bit decode shape of bench/kv_quant_speed.py.

    python builds_ab.py THREADS ROUNDS SO_A SO_B [SO_C ...]

Loads each compiled extension (a path under ~/.cache/torch_extensions) as its own module, runs
the decode call of every build in turns on the same query, caches and scales (16 sequences x
4096 tokens, 32 query heads over 8 KV heads, block size 16, bfloat16 query, caches in huge pages
as the engine allocates them, the backend's default paced prefetch), per head size and cache
dtype, and prints each build's median and minimum ms per call and whether the outputs of the
builds are equal. (The 2026-12-03 script of the same name predates the prefetch argument.)"""

from __future__ import annotations

import itertools
import statistics
import sys

import torch

from bench.build_ab import cpu_decode_builds_in_turns, load_extension as load
from bench.kv_quant_speed import CACHE_DTYPES, placed, quantized_caches
from bench.shapes import make_mixed

#: The caches timed, by name: None for bfloat16, else the 8-bit dtype written by write_kv.
CACHES = {"bfloat16": None, **{str(d).removeprefix("torch."): d for d in CACHE_DTYPES}}


def huge_caches(p, dtype) -> tuple:
    """(key_cache, value_cache, k_scale, v_scale) of `p` in huge pages, as `dtype` (None: bf16)."""
    if dtype is None:
        return placed(p.key_cache, "huge"), placed(p.value_cache, "huge"), None, None
    return quantized_caches(p, dtype, "huge")


def cell(t: list[float]) -> str:
    """Median / minimum ms of the calls `t` (seconds)."""
    return f"{statistics.median(t) * 1e3:6.2f} / {min(t) * 1e3:6.2f}"


def main() -> None:
    threads, rounds = int(sys.argv[1]), int(sys.argv[2])
    exts = [load(path) for path in sys.argv[3:]]
    torch.set_num_threads(threads)
    problems = {d: make_mixed([4096] * 16, [1] * 16, head_size=d, dtype=torch.bfloat16)
                for d in (64, 128)}
    for (head_size, p), (name, dtype) in itertools.product(problems.items(), CACHES.items()):
        times, same = cpu_decode_builds_in_turns(exts, p, huge_caches(p, dtype), threads, rounds)
        builds = "  ".join(f"build{i} {cell(t)}" for i, t in enumerate(times))
        print(f"d{head_size} {name:14s} {builds}  equal={same}", flush=True)


if __name__ == "__main__":
    main()
