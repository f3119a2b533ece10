"""Engine decode steps with `runner.build_inputs` as it is (a decode step takes `decode_inputs`)
against the same engine forced through `varlen_inputs` (numpy), alternating rounds of 4 steps on
one engine: `rows` sequences after 256-token prompts, greedy, the default model, 2 threads, the
KV pool resident from the start (as in the server: without it, the variant whose turn holds the
steps that enter new blocks would pay their pages' first-touch faults).

    python bench/results/2026-12-05-decode-inputs/step_ab.py ROWS ROUNDS [QUANTIZATION]
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

import engine.runner as runner
from bench.serve_profile import decoding_engine
from engine.model.loader import load_model


def main() -> None:
    rows, rounds = int(sys.argv[1]), int(sys.argv[2])
    quantization = sys.argv[3] if len(sys.argv) > 3 else "gguf"
    torch.set_num_threads(2)
    engine = decoding_engine(load_model(dtype=torch.bfloat16, quantization=quantization), rows,
                             max_tokens=2000, max_model_len=2304, prefault_kv_cache=True)
    paths = {"varlen_inputs": lambda *a: runner.varlen_inputs(*a),
             "build_inputs": runner.build_inputs}
    times: dict[str, list[float]] = {name: [] for name in paths}
    for r in range(rounds):
        for name in (list(paths) if r % 2 == 0 else list(paths)[::-1]):
            runner.build_inputs = paths[name]
            start = time.perf_counter()
            for _ in range(4):
                engine.step()
            times[name].append((time.perf_counter() - start) / 4)
    old, new = times["varlen_inputs"], times["build_inputs"]
    print(f"{quantization} rows {rows}: varlen_inputs {statistics.median(old) * 1e3:.3f} ms, "
          f"build_inputs {statistics.median(new) * 1e3:.3f} ms per step; per-round ratio "
          f"{statistics.median(n / o for o, n in zip(old, new)):.3f}, saved "
          f"{statistics.median(o - n for o, n in zip(old, new)) * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
