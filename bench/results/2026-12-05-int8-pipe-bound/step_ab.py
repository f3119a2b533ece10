"""Engine decode steps (`gguf-int8`) with two builds of engine/csrc/int8_matmul.cpp in turns, in
one process: the layer loop and the output head call build A, then build B, for 10 timed steps
each per round (`bench.build_ab.steps_in_turns`). `rows` sequences after 256-token prompts,
greedy, the default model, 2 threads, the KV pool resident from the start.

    python bench/results/2026-12-05-int8-pipe-bound/step_ab.py A.so B.so ROWS ROUNDS
"""

from __future__ import annotations

import ctypes
import statistics
import sys

import torch

import engine.model.layer_loop as layer_loop
import engine.model.quant_int8 as quant_int8
from bench.build_ab import steps_in_turns
from bench.serve_profile import decoding_engine
from engine.model.loader import load_model
from engine.native_build import Int8Kernel


def main() -> None:
    paths, rows, rounds = sys.argv[1:3], int(sys.argv[3]), int(sys.argv[4])
    torch.set_num_threads(2)
    model = load_model(dtype=torch.bfloat16, quantization="gguf-int8")
    engine = decoding_engine(model, rows, max_tokens=2000, max_model_len=2304,
                             prefault_kv_cache=True)
    kernels = [Int8Kernel(ctypes.CDLL(p)) for p in paths]
    loops = []
    for kernel in kernels:  # a layer loop bound to each build's int8_linear
        quant_int8._KERNEL._kernel = kernel
        loops.append(layer_loop.LayerLoop(model.model))

    def switch(i: int):
        def go() -> None:
            quant_int8._KERNEL._kernel = kernels[i]
            model.model._layer_loop = loops[i]
        return go

    times, _ = steps_in_turns(engine, [switch(0), switch(1)], rounds, [])
    a, b = (statistics.median(t) for t in times)
    ratios = [y / x for x, y in zip(*times)]
    print(f"rows {rows}: A {a:.3f} ms, B {b:.3f} ms per step; B/A per round median "
          f"{statistics.median(ratios):.3f} (min {min(ratios):.3f}, max {max(ratios):.3f})")


if __name__ == "__main__":
    main()
