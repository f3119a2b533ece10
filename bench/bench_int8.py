"""The int8 matmul (quantization "gguf-int8") against oneDNN's bfloat16 matmul on SmolLM2-135M's
projection shapes, 30 layers of distinct random Q4_1 weights (so they come from memory, as in a
decode step), interleaved in one process; the calling thread's CPU time, so run it with one
thread on a shared machine.

    python -m bench.bench_int8 --threads 1 --m 1 16 2048
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from engine.model.quant import GGUFBlocks
from engine.model.quant_int8 import int8_linear, pack_int8

#: name -> (N, K) of one layer's projections (q/k/v fused, gate/up fused).
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}


def random_q4_1(rng: np.random.Generator, rows: int, cols: int) -> GGUFBlocks:
    nb = cols // 32
    d = rng.normal(0.0, 0.01, (rows, nb)).astype(np.float16).view(np.uint8).reshape(rows, nb, 2)
    m = rng.normal(0.0, 0.05, (rows, nb)).astype(np.float16).view(np.uint8).reshape(rows, nb, 2)
    qs = rng.integers(0, 256, (rows, nb, 16), dtype=np.uint8)
    raw = np.concatenate([d, m, qs], axis=-1).reshape(rows, -1)
    return GGUFBlocks("Q4_1", torch.from_numpy(raw), cols)


def cpu_ms(fn, repeats: int) -> list[float]:
    fn()
    out = []
    for _ in range(repeats):
        t = time.thread_time()
        fn()
        out.append((time.thread_time() - t) * 1e3)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--m", type=int, nargs="+", default=[1, 16, 2048], help="activation rows")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    int8 = [{n: pack_int8(random_q4_1(rng, *s)) for n, s in SHAPES.items()}
            for _ in range(args.layers)]
    dense = [{n: torch.randn(*s).bfloat16() for n, s in SHAPES.items()}
             for _ in range(args.layers)]
    print("| M | int8 ms (median) | oneDNN bf16 ms (median) | int8 GOP/s | bf16 GOP/s |")
    print("|---|---|---|---|---|")
    for m in args.m:
        packed = [{n: torch.ops.mkldnn._reorder_linear_weight(w, m) for n, w in layer.items()}
                  for layer in dense]
        xs = {k: torch.randn(m, k).bfloat16() for k in (576, 1536)}

        def run_int8(xs: dict = xs) -> None:
            for layer in int8:
                for n, (_, k) in SHAPES.items():
                    int8_linear(xs[k], layer[n])

        def run_dense(xs: dict = xs, packed: list = packed) -> None:
            for layer in packed:
                for n, (_, k) in SHAPES.items():
                    torch.ops.mkldnn._linear_pointwise(xs[k], layer[n], None, "none", [], "")

        repeats = max(1, args.repeats // 2) if m >= 1024 else args.repeats
        a, b = [], []
        for _ in range(2):  # interleaved halves: the same machine state for both
            a += cpu_ms(run_int8, repeats)
            b += cpu_ms(run_dense, repeats)
        ops = 2 * m * sum(n * k for n, k in SHAPES.values()) * args.layers
        ta, tb = statistics.median(a), statistics.median(b)
        print(f"| {m} | {ta:.2f} | {tb:.2f} | {ops / ta / 1e6:.0f} | {ops / tb / 1e6:.0f} |",
              flush=True)


if __name__ == "__main__":
    main()
