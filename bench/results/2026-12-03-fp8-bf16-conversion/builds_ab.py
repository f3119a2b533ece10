"""In-process A/B of cpu-backend builds on the 8-bit decode shape of bench/kv_quant_speed.py.

    python builds_ab.py THREADS ROUNDS SO_A SO_B [SO_C ...]

Loads each compiled extension (a path under ~/.cache/torch_extensions) as its own module, runs
the decode call of every build in turns on the same query, caches and scales (16 sequences x
4096 tokens, 32 query heads over 8 KV heads, block size 16, bfloat16 query), per head size and
cache dtype, and prints each build's median and minimum ms per call and whether the outputs of
the builds are equal."""

from __future__ import annotations

import statistics
import sys

import torch

from bench.build_ab import cpu_decode_builds_in_turns, load_extension as load
from bench.kv_quant_speed import quantized_caches
from bench.shapes import make_mixed

CACHES = {"bfloat16": None, "float8_e4m3fn": torch.float8_e4m3fn,
          "float8_e5m2": torch.float8_e5m2, "int8": torch.int8}


def time_builds(exts: list, p, caches: tuple, threads: int, rounds: int
                ) -> tuple[list[list[float]], bool]:
    """Seconds per call of each build over `rounds` turns, and whether their outputs are equal.
    `caches` = (key_cache, value_cache, k_scale, v_scale). No paced prefetch: the builds of this
    run predate it."""
    return cpu_decode_builds_in_turns(exts, p, caches, threads, rounds, prefetch_lines=0)


def main() -> None:
    threads, rounds = int(sys.argv[1]), int(sys.argv[2])
    exts = [load(path) for path in sys.argv[3:]]
    torch.set_num_threads(threads)
    for head_size in (64, 128):
        p = make_mixed([4096] * 16, [1] * 16, head_size=head_size, dtype=torch.bfloat16)
        for cache, dtype in CACHES.items():
            caches = ((p.key_cache, p.value_cache, None, None) if dtype is None
                      else quantized_caches(p, dtype))
            times, same = time_builds(exts, p, caches, threads, rounds)
            cells = "  ".join(f"build{i} {statistics.median(t) * 1e3:6.2f} / {min(t) * 1e3:6.2f}"
                              for i, t in enumerate(times))
            print(f"d{head_size} {cache:14s} {cells}  equal={same}", flush=True)


if __name__ == "__main__":
    main()
