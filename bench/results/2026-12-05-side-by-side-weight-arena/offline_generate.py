"""Offline engine throughput on the side-by-side's c16 work: 32 prompts of 256 random token ids,
128 greedy tokens each (EOS ignored), at most 16 sequences at a time, bfloat16, 2 threads, the KV
pool (1 GiB) resident first. Prints output tokens/s. Run from a checkout's root:

    PYTHONPATH=. python \
        bench/results/2026-12-05-side-by-side-weight-arena/offline_generate.py gguf-int8
"""

from __future__ import annotations

import random
import sys
import time

import torch

from engine.llm import LLM
from engine.sampling_params import SamplingParams


def main() -> None:
    quantization = sys.argv[1]
    torch.set_num_threads(2)
    llm = LLM(dtype=torch.bfloat16, quantization=quantization, max_num_seqs=16,
              prefault_kv_cache=True, kv_cache_memory_bytes=1 << 30)
    rng = random.Random(0)
    prompts = [[rng.randrange(256, 32000) for _ in range(256)] for _ in range(32)]
    llm.generate([{"prompt_token_ids": prompts[0][:16]}],
                 SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts],
                 SamplingParams(max_tokens=128, ignore_eos=True, temperature=0.0),
                 use_tqdm=False)
    seconds = time.perf_counter() - start
    print(f"{quantization} {32 * 128 / seconds:.1f} tok/s {seconds:.2f} s")


if __name__ == "__main__":
    main()
