"""In-process A/B of cpu-backend builds on the engine's prefill attention: 16 sequences of
CONTEXT new tokens each (a whole prompt per sequence, varlen), 9 query heads over 3 KV heads of
64, bf16 query and caches, block size 16, a random non-contiguous block table. The builds run
in turns, one call each per round.

    python prefill_ab.py THREADS ROUNDS CONTEXT SO_A SO_B [SO_C ...]

Prints each build's median milliseconds per call and the largest difference of each build's
output from the first build's."""

from __future__ import annotations

import statistics
import sys
import time

import torch

import cpu_impl.backend as cpu_backend
from bench.build_ab import HEAD_SIZE, HEADS, engine_attention_case, load_extension

SEQS = 16


def main() -> None:
    threads, rounds, context = (int(a) for a in sys.argv[1:4])
    exts = [load_extension(p) for p in sys.argv[4:]]
    torch.set_num_threads(threads)
    case = engine_attention_case(SEQS, context, 1)
    key_cache, value_cache = case.caches[0]
    cu_seqlens_q = torch.arange(SEQS + 1, dtype=torch.int32) * context
    query = torch.randn(SEQS * context, HEADS, HEAD_SIZE, dtype=torch.bfloat16)
    outs = [torch.empty_like(query) for _ in exts]
    times: list[list[float]] = [[] for _ in exts]
    for r in range(rounds + 1):  # round 0 warms up
        for i, ext in enumerate(exts):
            t0 = time.perf_counter()
            ext.paged_attention(query, key_cache, value_cache, case.block_tables, case.seq_lens,
                                cu_seqlens_q, outs[i], None, None, HEAD_SIZE ** -0.5, 0, 0.0,
                                cpu_backend.QUERY_TILE, threads, False, None, None)
            if r:
                times[i].append(time.perf_counter() - t0)
    cells = " ".join(f"{statistics.median(t) * 1e3:7.2f}" for t in times)
    diffs = " ".join(f"{float((outs[0].float() - o.float()).abs().max()):.4g}" for o in outs)
    print(f"threads {threads} context {context}: {cells} ms/call; max |out - out[0]|: {diffs}")


if __name__ == "__main__":
    main()
