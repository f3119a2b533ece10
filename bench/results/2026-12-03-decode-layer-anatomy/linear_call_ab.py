"""Batch-16 decode steps of one engine (default model, gguf, bfloat16) with the model's `_linear`
as shipped and with a shortest-path stand-in for its tiled matmuls (the ctypes function called
with the weight's pointer and sizes taken once, no checks, no wrapper frames), swapped every 10
steps in one process:

    python linear_call_ab.py ROUNDS

Both give the same outputs (the same kernel on the same operands). Prints the median and mean
ms per step of each and their paired differences.
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any, Optional

import torch

import engine.model.decoder as decoder
from bench.serve_profile import decoding_engine
from engine.model import quant_tiled
from engine.model.loader import load_model
from engine.model.quant import QuantizedWeight
from engine.native_build import _QTYPES


def shortest(linear: Any) -> Any:
    call = quant_tiled._KERNEL.get()._linear
    known: dict[int, Any] = {}

    def run(x: torch.Tensor, weight: Any, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        args = known.get(id(weight))
        if args is None:
            tiled = (isinstance(weight, QuantizedWeight) and weight.int8 is None
                     and weight.tiled)
            t = weight.blocks if tiled else None
            args = known[id(weight)] = ((weight, t.packed.data_ptr(), _QTYPES[t.qtype], t.rows,
                                         t.cols, weight.max_rows) if tiled else (weight,))
        if len(args) > 1 and x.shape[0] <= args[5]:
            y = torch.empty(x.shape[0], args[3], dtype=torch.bfloat16)
            call(x.data_ptr(), args[1], args[2], y.data_ptr(), x.shape[0], args[3], args[4],
                 torch.get_num_threads())
            return y if bias is None else y.add_(bias)
        return linear(x, weight, bias)
    return run


def main() -> None:
    rounds = int(sys.argv[1])
    torch.set_num_threads(2)
    loaded = load_model(None, dtype=torch.bfloat16, quantization="gguf")
    engine = decoding_engine(loaded, 16, max_tokens=900)
    shipped = decoder._linear
    variants = {"shipped": shipped, "shortest": shortest(shipped)}
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, linear in variants.items():
            decoder._linear = linear
            engine.step()
            t = time.perf_counter()
            for _ in range(10):
                engine.step()
            times[name].append((time.perf_counter() - t) / 10 * 1e3)
    decoder._linear = shipped
    for name, ms in times.items():
        print(f"{name}: median {statistics.median(ms):.2f} ms, mean {statistics.mean(ms):.2f} ms")
    diff = [a - b for a, b in zip(times["shipped"], times["shortest"])]
    print(f"shipped - shortest, paired: median {statistics.median(diff):.2f} ms, "
          f"range {min(diff):.2f} to {max(diff):.2f}")


if __name__ == "__main__":
    main()
