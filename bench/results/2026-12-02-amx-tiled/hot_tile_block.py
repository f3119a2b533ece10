"""The tiled bf16 matmul on one hot weight (random Q4_1 blocks, 3072 x 576 and 576 x 1536), the
AMX build against the AVX-512 BF16 build of this machine, M = 1-32, one thread by default:
microseconds per call (best of 7 x 20 calls) and cycles per 16 x 16 x 32 tile-block at a nominal
2 GHz. Usage: PYTHONPATH=<repo>:<repo>/tests python hot_tile_block.py [THREADS]"""

import sys
import time

import numpy as np
import torch
from test_quant import random_blocks

from engine.model.gguf_blocks import GGUFBlocks
from engine.model.quant_tiled import pack_tiled, tiled_linear
from engine.native_build import TILED_TIERS, load_tiled
from paged_kernels.cpp_build import compile_flags


def main() -> None:
    threads = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    torch.set_num_threads(threads)
    builds = {"amx": load_tiled(compile_flags(TILED_TIERS)),
              "avx512": load_tiled(compile_flags(TILED_TIERS[1:]))}
    rng = np.random.default_rng(0)
    for n, k in ((3072, 576), (576, 1536)):
        blocks = GGUFBlocks("Q4_1", torch.from_numpy(random_blocks(rng, "Q4_1", n, k)), k)
        tile_blocks = (n // 16) * (k // 32)
        for name, kernel in builds.items():
            weight = pack_tiled(blocks, kernel)
            for m in (1, 4, 8, 16, 32):
                x = torch.randn(m, k).bfloat16()
                for _ in range(5):
                    tiled_linear(x, weight, kernel)
                best = float("inf")
                for _ in range(7):
                    t = time.perf_counter()
                    for _ in range(20):
                        tiled_linear(x, weight, kernel)
                    best = min(best, (time.perf_counter() - t) / 20)
                print(f"{n}x{k} {name} ({kernel.simd_paths}) M={m}: {best * 1e6:.1f} us, "
                      f"{best * threads * 2e9 / tile_blocks:.0f} cycles per tile-block")


if __name__ == "__main__":
    main()
