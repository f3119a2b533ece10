"""In-process A/B of cpu-backend builds on the engine's batch-16 decode attention: 16 sequences x
CONTEXT tokens, 9 query heads over 3 KV heads of 64, bf16 query and caches, block size 16, a
random non-contiguous block table. "cold" rotates 30 layers' caches (as a decode step reads
them), "hot" reuses one layer's. The builds run in turns, each round timing 30 calls per build.

    python builds_ab.py THREADS ROUNDS CONTEXT SO_A SO_B [SO_C ...]

Prints each build's median microseconds per call per mode and whether the builds' outputs are
equal bit for bit."""

from __future__ import annotations

import statistics
import sys
import time

import torch

import cpu_impl.backend as cpu_backend
from bench.build_ab import HEAD_SIZE, HEADS, LAYERS, engine_attention_case, load_extension

SEQS = 16


def main() -> None:
    threads, rounds, context = (int(a) for a in sys.argv[1:4])
    exts = [load_extension(p) for p in sys.argv[4:]]
    torch.set_num_threads(threads)
    case = engine_attention_case(SEQS, context, LAYERS)
    query = torch.randn(SEQS, HEADS, HEAD_SIZE, dtype=torch.bfloat16)
    outs = [torch.empty_like(query) for _ in exts]

    def call(i: int, layer: int) -> None:
        k, v = case.caches[layer]
        exts[i].paged_attention(query, k, v, case.block_tables, case.seq_lens, None, outs[i],
                                None, None, HEAD_SIZE ** -0.5, 0, 0.0, cpu_backend.QUERY_TILE,
                                threads, False, None, None)

    for mode in ("cold", "hot"):
        times: list[list[float]] = [[] for _ in exts]
        for i in range(len(exts)):
            call(i, 0)
        for _ in range(rounds):
            for i in range(len(exts)):
                t0 = time.perf_counter()
                for layer in range(LAYERS):
                    call(i, layer if mode == "cold" else 0)
                times[i].append((time.perf_counter() - t0) / LAYERS)
        equal = all(torch.equal(outs[0], o) for o in outs[1:])
        cells = " ".join(f"{statistics.median(t) * 1e6:8.1f}" for t in times)
        print(f"threads {threads} context {context} {mode}: {cells} us/call"
              f" ({'equal' if equal else 'DIFFERENT'} outputs)")


if __name__ == "__main__":
    main()
