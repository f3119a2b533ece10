# ruff: noqa: E402, E501, E701, B023  (kept as it ran: a one-off measurement script)
"""AVX2 int8 path vs portable build vs torch dense float32 on SmolLM2-135M shapes, 1 thread,
calling thread's CPU time, variants interleaved; distinct weight copies cycled so weights come
from memory (beyond L3) rather than cache."""
import statistics
import sys
import time
import numpy as np
import torch
sys.path[:0] = [".", "tests"]
from engine.native_build import INT8_TIERS, load_int8
from paged_kernels.cpp_build import compile_flags
from engine.model.quant import GGUFBlocks
from engine.model.quant_int8 import pack_int8, int8_linear
from test_quant import random_blocks
from gguf.quants import dequantize
import gguf

torch.set_num_threads(1)
avx2 = load_int8(compile_flags(INT8_TIERS, frozenset({"avx2", "fma", "f16c"})))
port = load_int8(compile_flags(INT8_TIERS, frozenset()))
SHAPES = [("Q4_1", 576, 576, 40), ("Q4_1", 192, 576, 60), ("Q4_1", 1536, 576, 16),
          ("Q4_1", 576, 1536, 16), ("Q8_0", 49152, 576, 2)]
BYTES = {"Q4_1": 20, "Q8_0": 34}
ms = [int(a) for a in sys.argv[1:]] or [1, 16]
rng = np.random.default_rng(0)
print("| shape (N x K) | type | M | AVX2 ms | portable ms | torch f32 ms | AVX2 GB/s | portable GB/s | torch GB/s |")
print("|---|---|---|---|---|---|---|---|---|")
for qt, n, k, copies in SHAPES:
    raws = [random_blocks(rng, qt, n, k) for _ in range(copies)]
    packed = [pack_int8(GGUFBlocks(qt, torch.from_numpy(r), k), kernel=avx2) for r in raws]
    dense = [torch.from_numpy(dequantize(r, getattr(gguf.GGMLQuantizationType, qt))
                              .reshape(n, k).astype(np.float32)) for r in raws]
    wbytes = n * k // 32 * BYTES[qt]
    for m in ms:
        x = torch.randn(m, k)
        fns = {"avx2": lambda w: int8_linear(x, w, kernel=avx2),
               "portable": lambda w: int8_linear(x, w, kernel=port)}
        times = {v: [] for v in ("avx2", "portable", "torch")}
        reps = 7 if (qt == "Q4_1" or m == 1) else 5
        for rep in range(reps + 1):
            for v in ("avx2", "portable", "torch"):
                ws = dense if v == "torch" else packed
                t = time.thread_time()
                for w in ws:
                    (x @ w.T) if v == "torch" else fns[v](w)
                dt = (time.thread_time() - t) * 1e3 / len(ws)
                if rep:
                    times[v].append(dt)
        med = {v: statistics.median(t) for v, t in times.items()}
        dbytes = n * k * 4
        print(f"| {n}x{k} | {qt} | {m} | {med['avx2']:.3f} | {med['portable']:.3f} | "
              f"{med['torch']:.3f} | {wbytes / med['avx2'] / 1e6:.1f} | "
              f"{wbytes / med['portable'] / 1e6:.2f} | {dbytes / med['torch'] / 1e6:.1f} |",
              flush=True)
