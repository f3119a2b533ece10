"""Batch-16 decode steps of the default model for SECONDS, for a profiler to attach to: prefills
16 random 256-token prompts, runs 5 decode steps, writes this process's pid to STARTED, then
steps until SECONDS have passed and prints the mean step time.

    python decode_loop.py SECONDS STARTED
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

from bench.serve_profile import decoding_engine
from engine.model.loader import load_model


def main() -> None:
    seconds, started = float(sys.argv[1]), Path(sys.argv[2])
    torch.set_num_threads(2)
    loaded = load_model(None, dtype=torch.bfloat16, quantization="gguf")
    engine = decoding_engine(loaded, 16, max_tokens=700)
    for _ in range(5):
        engine.step()
    started.write_text(str(os.getpid()))
    t, steps = time.perf_counter(), 0
    while time.perf_counter() - t < seconds:
        engine.step()
        steps += 1
    print(f"{steps} steps, {(time.perf_counter() - t) / steps * 1e3:.1f} ms per step")


if __name__ == "__main__":
    main()
