"""The engine's decode step over a bfloat16, an int8 and an fp8_e4m3 KV cache, in turns.

    python engine_steps.py BATCH PROMPT_LEN ROUNDS [STEPS_PER_ROUND]

One engine per cache dtype on the default model (bfloat16, `quantization="auto"`, the cpu
backend, the KV pool prefaulted), each with BATCH greedy requests of PROMPT_LEN random tokens
prefilled; then ROUNDS turns in which each engine takes STEPS_PER_ROUND decode steps. Prints per
cache dtype the median step (ms) and the median attention time per step by the native layer
loop's own clock (bench.serve_profile's timers)."""

from __future__ import annotations

import statistics
import sys
import time

import torch

from bench import serve_profile
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model.loader import load_model
from engine.model import layer_loop

CACHES = ("auto", "int8", "fp8_e4m3")


def main() -> None:
    batch, prompt_len, rounds = (int(a) for a in sys.argv[1:4])
    per_round = int(sys.argv[4]) if len(sys.argv) > 4 else 4
    loaded = load_model(None, dtype=torch.bfloat16, quantization="auto")
    serve_profile.install_model_timers(loaded.model)
    engines = {}
    for name in CACHES:
        engine = LLMEngine(loaded, config=EngineConfig(
            max_model_len=prompt_len + rounds * per_round + 64, kv_cache_dtype=name,
            prefault_kv_cache=True))
        serve_profile.add_prompts(engine, batch, prompt_len, rounds * per_round + 32)
        serve_profile.prefill(engine)
        for _ in range(2):
            engine.step()
        engines[name] = engine
    steps = {name: [] for name in CACHES}
    attention = {name: [] for name in CACHES}
    for _ in range(rounds):
        for name, engine in engines.items():
            for _ in range(per_round):
                layer_loop.timers.zero_()
                t0 = time.perf_counter()
                engine.step()
                steps[name].append(time.perf_counter() - t0)
                attention[name].append(float(layer_loop.timers[1]))
    for name in CACHES:
        print(f"{name:9s} step {statistics.median(steps[name]) * 1e3:7.2f} ms  attention "
              f"{statistics.median(attention[name]) * 1e3:6.2f} ms", flush=True)


if __name__ == "__main__":
    main()
