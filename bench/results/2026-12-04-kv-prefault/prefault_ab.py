"""Fresh engines (default model, gguf, bfloat16, 2 threads, the default 1 GiB KV budget) with
`prefault_kv_cache` off and on, in turns: each builds an engine, prefills 16 random 256-token
prompts and decodes 16 steps, the wave a server's first 16 requests make. Per engine: the build's
seconds, the prefill's seconds and the seconds in `write_kv` during it, the decode steps' median
ms and the process's resident memory after the wave.

    python prefault_ab.py ROUNDS
"""

from __future__ import annotations

import gc
import statistics
import sys
import time

import torch

from bench.serve_profile import add_prompts, prefill
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model.loader import load_model
from paged_kernels.plan import AttentionPlan

WRITE_KV: list[float] = []


def timed_write_kv(original):
    def call(self, *args, **kwargs):
        t = time.perf_counter()
        original(self, *args, **kwargs)
        WRITE_KV.append(time.perf_counter() - t)
    return call


def rss_mib() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def wave(loaded, prefault: bool) -> dict[str, float]:
    t = time.perf_counter()
    engine = LLMEngine(loaded, config=EngineConfig(max_model_len=1024,
                                                   prefault_kv_cache=prefault))
    built = time.perf_counter() - t
    add_prompts(engine, 16, 256, 32)
    WRITE_KV.clear()
    t = time.perf_counter()
    prefill(engine)
    filled = time.perf_counter() - t
    write_kv = sum(WRITE_KV)
    steps = []
    for _ in range(16):
        t = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t)
    out = {"build_s": built, "prefill_s": filled, "prefill_write_kv_s": write_kv,
           "decode_ms": statistics.median(steps) * 1e3, "rss_mib": rss_mib()}
    del engine
    gc.collect()
    return out


def main() -> None:
    rounds = int(sys.argv[1])
    torch.set_num_threads(2)
    AttentionPlan.write_kv = timed_write_kv(AttentionPlan.write_kv)
    loaded = load_model(None, dtype=torch.bfloat16, quantization="gguf")
    wave(loaded, False)  # warm-up: first-use builds, the model's own pages
    for r in range(rounds):
        for prefault in (False, True):
            row = wave(loaded, prefault)
            print(f"round {r} prefault {prefault!s:5}: " +
                  " ".join(f"{k} {v:.3f}" for k, v in row.items()), flush=True)


if __name__ == "__main__":
    main()
