"""In-process A/B of builds of engine/csrc/tiled_matmul.cpp at one decode batch.

    python tiled_ab.py THREADS ROUNDS M SOURCE[+MACRO...] [SOURCE[+MACRO...] ...]

Each SOURCE is a copy of tiled_matmul.cpp (kept next to the original, whose relative include it
needs); `+NAME` adds `-DNAME`, `+NOAMX` builds the AVX-512 BF16 tier without AMX. Every build runs
the layer's four Q4_1 shapes of the default model and its Q8_0 LM head on the same random weights
(f16 scales in [0, 0.01)) and x; prints whether each build's outputs equal the first's, then the
median microseconds per call over ROUNDS rounds, the builds called in turns within each round.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

from bench.build_ab import packed_tiles
from engine.native_build import TILED_TIERS, TiledKernel
from paged_kernels.cpp_build import compile_flags, load_library

SHAPES = [("qkv", 960, 576, "Q4_1"), ("o", 576, 576, "Q4_1"), ("gate_up", 3072, 576, "Q4_1"),
          ("down", 576, 1536, "Q4_1"), ("lm_head", 49152, 576, "Q8_0")]


def build(i: int, spec: str) -> TiledKernel:
    source, *extra = spec.split("+")
    flags = compile_flags(TILED_TIERS[1:] if "NOAMX" in extra else TILED_TIERS)
    flags += [f"-D{m}" for m in extra if m != "NOAMX"]
    return TiledKernel(load_library(Path(source).resolve(), f"tiled_ab{i}", flags, spec))


def main() -> None:
    threads, rounds, m = (int(a) for a in sys.argv[1:4])
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    kernels = [build(i, spec) for i, spec in enumerate(sys.argv[4:])]
    cases = [(name, n, k, q, packed_tiles(n, k, q), torch.randn(m, k).to(torch.bfloat16))
             for name, n, k, q in SHAPES]
    for name, n, _, q, w, x in cases:
        outs = [kernel.linear(x, w, q, n, threads) for kernel in kernels]
        print(name, ["equal" if torch.equal(outs[0], o) else "different" for o in outs[1:]])
    times: dict[tuple[int, str], list[float]] = {}
    for _ in range(rounds):
        for i, kernel in enumerate(kernels):
            for name, n, _, q, w, x in cases:
                reps = 3 if name == "lm_head" else 30
                kernel.linear(x, w, q, n, threads)
                t = time.perf_counter()
                for _ in range(reps):
                    kernel.linear(x, w, q, n, threads)
                times.setdefault((i, name), []).append((time.perf_counter() - t) / reps * 1e6)
    print(f"threads {threads}, M {m}: median us per call, builds in argument order")
    for name, *_ in cases:
        print(f"{name:8s}", "  ".join(f"{statistics.median(times[i, name]):8.1f}"
                                      for i in range(len(kernels))))
    layer = [sum(statistics.median(times[i, n]) for n, *_ in SHAPES[:4])
             for i in range(len(kernels))]
    print("layer   ", "  ".join(f"{v:8.1f}" for v in layer))


if __name__ == "__main__":
    main()
