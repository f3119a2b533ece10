"""Decode steps of one engine (default model, gguf, bfloat16, batch BATCH, default 16) with two
builds of engine/csrc/tiled_matmul.cpp swapped in turns, 10 steps at a time, in one process:

    python engine_builds_ab.py ROUNDS A.cpp B.cpp [BATCH]

Both builds read the same packed weights (the packing code is the same in both). Prints each
build's median and mean ms per decode step over the rounds.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

from bench.serve_profile import decoding_engine
from engine.model import quant_tiled
from engine.model.loader import load_model
from engine.native_build import TILED_TIERS, TiledKernel
from paged_kernels.cpp_build import compile_flags, load_library


class Current:
    """Stands in for quant_tiled's lazy kernel: `get` returns the build in use."""

    def __init__(self, kernel: TiledKernel) -> None:
        self.kernel = kernel

    def get(self, kernel: TiledKernel | None = None) -> TiledKernel:
        return kernel or self.kernel


def main() -> None:
    rounds, sources = int(sys.argv[1]), sys.argv[2:4]
    batch = int(sys.argv[4]) if len(sys.argv) > 4 else 16
    torch.set_num_threads(2)
    builds = [TiledKernel(load_library(Path(s).resolve(), f"engine_ab{i}",
                                       compile_flags(TILED_TIERS), s))
              for i, s in enumerate(sources)]
    current = Current(builds[0])
    quant_tiled._KERNEL = current
    loaded = load_model(None, dtype=torch.bfloat16, quantization="gguf")
    engine = decoding_engine(loaded, batch, max_tokens=900)
    times: list[list[float]] = [[], []]
    for _ in range(rounds):
        for i, build in enumerate(builds):
            current.kernel = build
            engine.step()  # first step after the swap: not timed
            t = time.perf_counter()
            for _ in range(10):
                engine.step()
            times[i].append((time.perf_counter() - t) / 10 * 1e3)
    for source, ms in zip(sources, times):
        print(f"{source}: median {statistics.median(ms):.2f} ms, mean {statistics.mean(ms):.2f}"
              f" ms per step over {len(ms)} rounds of 10")


if __name__ == "__main__":
    main()
