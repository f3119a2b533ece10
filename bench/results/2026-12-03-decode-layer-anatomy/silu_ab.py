"""`silu_mul` of two builds of engine/csrc/layer_ops.cpp in one process, 16 and 1365 rows of
[*, 2 x 1536] bfloat16 (a decode step's and a prefill chunk's MLP), three timings each:

    python silu_ab.py THREADS A.cpp B.cpp

Prints how many outputs differ and the best of 5 repeats per timing, in µs per call.
"""

from __future__ import annotations

import sys
import timeit
from pathlib import Path

import torch

from engine.model import layer_ops
from paged_kernels.cpp_build import load


def best_us(build, gate_up: torch.Tensor, n: int) -> float:
    return min(timeit.repeat(lambda: build.silu_mul(gate_up), number=n, repeat=5)) / n * 1e6


def main() -> None:
    torch.set_num_threads(int(sys.argv[1]))
    builds = [load(Path(s).resolve(), f"silu_ab{i}", layer_ops.compile_flags(), s)
              for i, s in enumerate(sys.argv[2:4])]
    for rows in (16, 1365):
        gate_up = (4 * torch.randn(rows, 3072)).to(torch.bfloat16)
        a, b = (m.silu_mul(gate_up) for m in builds)
        print(f"rows {rows}: {(a != b).sum().item()} of {a.numel()} outputs differ, largest "
              f"difference {(a.float() - b.float()).abs().max().item()}")
        n = 200 if rows == 16 else 10
        for _ in range(3):
            print(f"rows {rows:5d}", "  ".join(f"{best_us(m, gate_up, n):8.1f}" for m in builds))


if __name__ == "__main__":
    main()
