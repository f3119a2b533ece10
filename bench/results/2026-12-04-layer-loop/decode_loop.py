"""Decode steps of one engine in a loop for SECONDS (for `perf record -p PID`, once it prints
"ready PID"); then the median step.

    python decode_loop.py BATCH QUANTIZATION SECONDS
"""

import os
import sys
import time

import torch

from bench.serve_profile import decoding_engine
from engine.model.loader import load_model
torch.set_num_threads(2)
batch, quant, seconds = int(sys.argv[1]), sys.argv[2], float(sys.argv[3])
loaded = load_model(None, dtype=torch.bfloat16, quantization=quant)
eng = decoding_engine(loaded, batch, max_tokens=4000, max_model_len=4096)
for _ in range(5):
    eng.step()
print("ready", os.getpid(), flush=True)
ts = []
end = time.time() + seconds
while time.time() < end:
    t = time.perf_counter()
    eng.step()
    ts.append(time.perf_counter() - t)
ts.sort()
print(f"steps {len(ts)} median {ts[len(ts)//2]*1e3:.2f} ms", flush=True)
