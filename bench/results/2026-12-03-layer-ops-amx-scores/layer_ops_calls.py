"""Per-call time of the engine's decode-step element-wise work at batch 16 on the default model's
shapes, in the tree on PYTHONPATH: `silu_mul` of [16, 2 x 1536] bf16, and the sampler's row
statistics over [16, 49152] float32 logits (`argmax_logsumexp` where the tree has it, and the
log-softmax + argmax it replaces). Median of 7 rounds of 300 calls, 2 threads.

    PYTHONPATH=TREE python layer_ops_calls.py
"""

from __future__ import annotations

import statistics
import time

import torch

from engine.model import layer_ops
from engine.sampler import argmax


def per_call_us(f, calls: int = 300, rounds: int = 7) -> float:
    f()
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(calls):
            f()
        times.append((time.perf_counter() - t) / calls * 1e6)
    return statistics.median(times)


def main() -> None:
    torch.set_num_threads(2)
    gen = torch.Generator().manual_seed(0)
    gate_up = torch.randn(16, 3072, generator=gen).bfloat16()
    logits = 4 * torch.randn(16, 49152, generator=gen)
    print(f"silu_mul [16, 3072] bf16: {per_call_us(lambda: layer_ops.silu_mul(gate_up)):.1f} us")
    print(f"log_softmax + argmax [16, 49152]: "
          f"{per_call_us(lambda: (torch.log_softmax(logits, -1), argmax(logits))):.1f} us")
    if hasattr(layer_ops, "argmax_logsumexp"):
        print(f"argmax_logsumexp [16, 49152]: "
              f"{per_call_us(lambda: layer_ops.argmax_logsumexp(logits)):.1f} us")


if __name__ == "__main__":
    main()
