"""In-process A/B of the cpu backend's paced prefetch on the engine's batch-16 decode attention: 16
sequences x CONTEXT tokens, 9 query heads over 3 KV heads of 64, block size 16, a random
non-contiguous block table, query and caches of DTYPE. "cold" rotates 30 layers' caches (as a
decode step reads them), "hot" reuses one layer's. Each variant is a compiled extension and a
prefetch distance: `PATH@LINES` calls a build that takes `prefetch_lines` with that distance,
`PATH` a build from before it (its own prefetch). The variants run in turns, each round timing
30 calls per variant.

    python prefetch_ab.py THREADS ROUNDS CONTEXT DTYPE VARIANT [VARIANT ...]

Prints each variant's median microseconds per call per mode and whether the outputs are equal
bit for bit."""

from __future__ import annotations

import sys

import torch

import cpu_impl.backend as cpu_backend
from bench.build_ab import HEAD_SIZE, HEADS, KV_HEADS, LAYERS, cold_and_hot_in_turns
from bench.build_ab import engine_attention_case, load_extension, print_cold_and_hot

SEQS = 16


def main() -> None:
    threads, rounds, context = (int(a) for a in sys.argv[1:4])
    dtype = getattr(torch, sys.argv[4])
    variants = [(load_extension(v.split("@")[0]), int(v.split("@")[1]) if "@" in v else None)
                for v in sys.argv[5:]]
    torch.set_num_threads(threads)
    case = engine_attention_case(SEQS, context, LAYERS)
    caches = [(k.to(dtype), v.to(dtype)) for k, v in case.caches]
    query = torch.randn(SEQS, HEADS, HEAD_SIZE).to(dtype)
    outs = [torch.empty_like(query) for _ in variants]
    assert HEADS % KV_HEADS == 0

    def call(i: int, layer: int) -> None:
        ext, lines = variants[i]
        k, v = caches[layer]
        args = (query, k, v, case.block_tables, case.seq_lens, None, outs[i], None, None,
                HEAD_SIZE ** -0.5, 0, 0.0, cpu_backend.QUERY_TILE, threads, False, None, None)
        if lines is None:
            ext.paged_attention(*args)
        else:
            ext.paged_attention(*args, lines)

    per_call = cold_and_hot_in_turns(call, len(variants), rounds)
    print_cold_and_hot(f"threads {threads} context {context} {sys.argv[4]}", per_call, outs)

if __name__ == "__main__":
    main()
