"""In-process A/B of the layer loop's row-op threshold (engine/csrc/layer_rows.h's
kParallelElems): builds of the loop with 1 << 15 (the fused ops' earlier value) and with this
tree's default, on one engine with BATCH requests of 256 random prompt tokens prefilled (KV pool
prefaulted, as the server does), taking turns for ROUNDS rounds of 20 decode steps. Prints each
round's median step and the loop's own clock for its row ops (norms, rotary, SiLU), ms per step.

    python rows_ab.py QUANTIZATION BATCH ROUNDS
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from bench.serve_profile import add_prompts, prefill
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model import layer_loop, layer_ops
from engine.model.loader import load_model
from paged_kernels.cpp_build import load


def main() -> None:
    quantization, batch, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    torch.set_num_threads(2)
    loaded = load_model(None, dtype=torch.bfloat16, quantization=quantization)
    engine = LLMEngine(loaded, config=EngineConfig(max_model_len=4096, prefault_kv_cache=True))
    add_prompts(engine, batch, 256, 4000)
    prefill(engine)
    builds = {"1 << 15": load(layer_loop.SOURCE, "engine_layer_loop_ab",
                              layer_ops.compile_flags() + ["-DLAYER_ROWS_PARALLEL_ELEMS=32768"],
                              "layer loop, 1 << 15"),
              "default": layer_loop.native()}
    layer_loop.timers = torch.zeros(4, dtype=torch.float64)
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in builds}
    for r in range(rounds):
        for name in (list(builds) if r % 2 == 0 else list(builds)[::-1]):
            layer_loop._module = builds[name]
            loaded.model.weights_changed()
            for _ in range(3):
                engine.step()
            layer_loop.timers.zero_()
            times = []
            for _ in range(20):
                t = time.perf_counter()
                engine.step()
                times.append(time.perf_counter() - t)
            rows_ms = float(layer_loop.timers[3]) / 20 * 1e3
            results[name].append((statistics.median(times) * 1e3, rows_ms))
    print(f"{quantization}, batch {batch}, {rounds} rounds of 20 steps, 2 threads")
    for name, rows in results.items():
        steps = [s for s, _ in rows]
        print(f"{name}: step " + " ".join(f"{s:.2f}" for s in steps)
              + f" (median {statistics.median(steps):.2f}) | row ops "
              + " ".join(f"{r:.3f}" for _, r in rows))


if __name__ == "__main__":
    main()
