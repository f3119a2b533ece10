"""Two builds of engine/csrc/tiled_matmul.cpp, A and B (two source files placed next to it, so
that its includes resolve), on the default model's packed weights (a WeightArena, as loaded):
alternating sweeps of every projection and the LM head at ROWS rows, called from Python; checks
that both give the same bits first.

    python bench/results/2026-12-05-m1-stream-probes/builds_ab.py A.cpp B.cpp ROWS ROUNDS
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

import engine.native_build as nb
from bench.weight_pages import step_weights
from engine.model.loader import load_model
from paged_kernels.cpp_build import compile_flags


def main() -> None:
    a_src, b_src = Path(sys.argv[1]), Path(sys.argv[2])
    rows, rounds = int(sys.argv[3]), int(sys.argv[4])
    torch.set_num_threads(2)
    flags = compile_flags(nb.TILED_TIERS)
    kernels = {"A": nb._load(nb.TiledKernel, a_src, "probe_tiled_a", "A", flags),
               "B": nb._load(nb.TiledKernel, b_src, "probe_tiled_b", "B", flags)}
    weights = step_weights(load_model(dtype=torch.bfloat16, quantization="gguf").model)
    x = {c: torch.randn(rows, c).bfloat16() for c in (576, 1536)}

    def run(k: nb.TiledKernel) -> list[torch.Tensor]:
        return [k.linear(x[w.shape[1]], w.blocks.packed, w.blocks.qtype, w.shape[0], 2)
                for w in weights]
    assert all(torch.equal(a, b) for a, b in zip(run(kernels["A"]), run(kernels["B"])))
    times: dict[str, list[float]] = {"A": [], "B": []}
    for r in range(rounds):
        for name in ("A", "B") if r % 2 == 0 else ("B", "A"):
            start = time.perf_counter()
            run(kernels[name])
            times[name].append(time.perf_counter() - start)
    for name, t in times.items():
        print(f"{name}: median {statistics.median(t) * 1e3:.3f} ms per sweep")
    print(f"B / A, median of rounds: "
          f"{statistics.median(b / a for a, b in zip(times['A'], times['B'])):.3f}")


if __name__ == "__main__":
    main()
