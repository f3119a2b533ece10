"""Where one decode step's time goes outside the streams: `bench.serve_profile`'s timers (the
model's forward, the output head's matmul and its float cast, sampling) and the native layer
loop's own four timers (matmuls, attention, KV writes, the rest: norms, rotary, SiLU), over 100
steps of `rows` sequences after 256-token prompts, 2 threads, the KV pool resident.

    python bench/results/2026-12-05-int8-pipe-bound/step_split.py QUANTIZATION ROWS
"""

from __future__ import annotations

import sys
import time

import torch

import bench.serve_profile as sp
import engine.model.layer_loop as layer_loop
from engine.model.loader import load_model


def main() -> None:
    quantization, rows = sys.argv[1], int(sys.argv[2])
    torch.set_num_threads(2)
    loaded = load_model(None, dtype=torch.bfloat16, quantization=quantization)
    sp.install_model_timers(loaded.model)
    engine = sp.decoding_engine(loaded, rows, prefault_kv_cache=True)
    engine.sampler.sample = sp.timed("sampling", engine.sampler.sample)
    for _ in range(5):
        engine.step()
    sp.clear_times()
    steps = 100
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    step = (time.perf_counter() - start) / steps * 1e3
    t = {k: v / steps * 1e3 for k, v in sp.TIMES.items()}
    loop = dict(zip(sp.LOOP_PARTS, (layer_loop.timers / steps * 1e3).tolist()))
    in_loop = sum(loop.values())
    print(f"{quantization} rows {rows}: step {step:.3f} ms | layer loop {in_loop:.3f} "
          f"(matmul {loop['matmul']:.3f}, attention {loop['attention']:.3f}, write_kv "
          f"{loop['write_kv']:.3f}, rest {loop['other']:.3f}) | forward outside the loop "
          f"{t['forward'] - in_loop:.3f} | output head {t['logits']:.3f} (matmul "
          f"{t['matmul']:.3f}) | sampling {t['sampling']:.3f} | rest of the step "
          f"{step - t['forward'] - t['logits'] - t['sampling']:.3f}")


if __name__ == "__main__":
    main()
