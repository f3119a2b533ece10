"""In-process A/B of builds of engine/csrc/tiled_matmul.cpp (KIND `tiled`) or int8_matmul.cpp
(KIND `int8`) on a whole decode step's matmuls at
M rows, the weights streamed from memory as a decode step streams them: the default model's
four Q4_1 projections for each of 30 layers (random blocks, f16 scales in [0, 0.01)), then its
Q8_0 LM head, every matrix a separate allocation (~96 MB in all, three times the L3 of the
machines measured). One pass runs all 121 products in order; the builds take turns pass by
pass.

    python stream_ab.py KIND THREADS ROUNDS M SOURCE [SOURCE ...]

Each SOURCE is a copy of the kernel's source next to the original (its relative include). The
tile-blocks: Q4_1 320 bytes (both kernels), Q8_0 544 (tiled) or 576 (int8), f16 scales last. Prints
whether each build's outputs equal the first's, then per build the median ms per pass and the
weights' GB/s at that median.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

from bench.build_ab import packed_tiles
from engine.native_build import INT8_TIERS, TILED_TIERS, Int8Kernel, TiledKernel
from paged_kernels.cpp_build import compile_flags, load_library

LAYER = [(960, 576, "Q4_1"), (576, 576, "Q4_1"), (3072, 576, "Q4_1"), (576, 1536, "Q4_1")]
HEAD = (49152, 576, "Q8_0")
LAYERS = 30


def main() -> None:
    kind = sys.argv[1]
    threads, rounds, m = (int(a) for a in sys.argv[2:5])
    sources = sys.argv[5:]
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    cls, tiers = (TiledKernel, TILED_TIERS) if kind == "tiled" else (Int8Kernel, INT8_TIERS)
    kernels = [cls(load_library(Path(s).resolve(), f"stream_ab_{kind}{i}", compile_flags(tiers),
                                s))
               for i, s in enumerate(sources)]
    mats = [(n, q, packed_tiles(n, k, q, kind), torch.randn(m, k).to(torch.bfloat16))
            for _ in range(LAYERS) for n, k, q in LAYER]
    mats.append((HEAD[0], HEAD[2], packed_tiles(*HEAD, kind), torch.randn(m, HEAD[1]).bfloat16()))
    nbytes = sum(w.numel() for _, _, w, _ in mats)
    firsts = [[kernel.linear(x, w, q, n, threads) for n, q, w, x in mats[:4] + mats[-1:]]
              for kernel in kernels]
    print("outputs equal to the first build's:",
          [all(torch.equal(a, b) for a, b in zip(firsts[0], f)) for f in firsts[1:]])
    times: list[list[float]] = [[] for _ in kernels]
    for _ in range(rounds):
        for i, kernel in enumerate(kernels):
            t = time.perf_counter()
            for n, q, w, x in mats:
                kernel.linear(x, w, q, n, threads)
            times[i].append(time.perf_counter() - t)
    print(f"threads {threads}, M {m}, {nbytes / 1e6:.1f} MB of weights per pass")
    for source, ts in zip(sources, times):
        med = statistics.median(ts)
        print(f"{Path(source).name}: median {med * 1e3:.3f} ms per pass, {nbytes / med / 1e9:.1f}"
              f" GB/s (min {min(ts) * 1e3:.3f} ms)", flush=True)


if __name__ == "__main__":
    main()
