"""In-process A/B of cpu-backend builds on the engine's batch-16 decode attention: 16 sequences x
CONTEXT tokens, 9 query heads over 3 KV heads of 64, block size 16, a random non-contiguous block
table, bf16 query and caches. "cold" rotates 30 layers' caches (as a decode step reads them),
"hot" reuses one layer's. PAGES is `huge` (the caches in `paged_kernels.empty_cache` memory, as
the engine allocates them) or `4k` (`torch.empty`). Each variant is `PATH@LINES` or
`PATH@LINES@ra`: a compiled extension, its `prefetch_lines`, and `ra` for the decode read-ahead
(csrc/read_ahead.h) on. The variants run in turns, each round timing 30 calls each.

    python locality_ab.py THREADS ROUNDS CONTEXT PAGES VARIANT [VARIANT ...]

Prints each variant's median microseconds per call per mode and whether the outputs are equal
bit for bit."""

from __future__ import annotations

import sys

import torch

import cpu_impl.backend as cpu_backend
import paged_kernels as pk
from bench.build_ab import HEAD_SIZE, HEADS, LAYERS, cold_and_hot_in_turns, engine_attention_case
from bench.build_ab import load_extension, print_cold_and_hot

SEQS = 16
PAGES = {"huge": pk.empty_cache, "4k": torch.empty}


def placed(t: torch.Tensor, pages: str) -> torch.Tensor:
    out = PAGES[pages](tuple(t.shape), dtype=t.dtype)
    out.copy_(t)
    return out


def main() -> None:
    threads, rounds, context = (int(a) for a in sys.argv[1:4])
    pages = sys.argv[4]
    variants = [(load_extension(v.split("@")[0]), int(v.split("@")[1]), v.endswith("@ra"))
                for v in sys.argv[5:]]
    torch.set_num_threads(threads)
    case = engine_attention_case(SEQS, context, LAYERS)
    caches = [(placed(k, pages), placed(v, pages)) for k, v in case.caches]
    query = torch.randn(SEQS, HEADS, HEAD_SIZE).to(torch.bfloat16)
    outs = [torch.empty_like(query) for _ in variants]

    def call(i: int, layer: int) -> None:
        ext, lines, read_ahead = variants[i]
        k, v = caches[layer]
        ext.paged_attention(query, k, v, case.block_tables, case.seq_lens, None, outs[i], None,
                            None, HEAD_SIZE ** -0.5, 0, 0.0, cpu_backend.QUERY_TILE, threads,
                            read_ahead, None, None, lines)

    per_call = cold_and_hot_in_turns(call, len(variants), rounds)
    print_cold_and_hot(f"threads {threads} context {context} {pages}", per_call, outs)

if __name__ == "__main__":
    main()
