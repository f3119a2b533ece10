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

import statistics
import sys

import torch

import cpu_impl.backend as cpu_backend
from bench.build_ab import HEAD_SIZE, HEADS, KV_HEADS, LAYERS, engine_attention_case
from bench.build_ab import load_extension
from bench.timing import seconds_in_turns

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

    def layers(i: int, mode: str) -> None:
        for layer in range(LAYERS):
            call(i, layer if mode == "cold" else 0)

    for mode in ("cold", "hot"):
        for i in range(len(variants)):
            call(i, 0)
        times = seconds_in_turns([lambda i=i, m=mode: layers(i, m) for i in range(len(variants))],
                                 rounds)
        equal = all(torch.equal(outs[0], o) for o in outs[1:])
        cells = " ".join(f"{statistics.median(t) / LAYERS * 1e6:8.1f}" for t in times)
        print(f"threads {threads} context {context} {sys.argv[4]} {mode}: {cells} us/call"
              f" ({'equal' if equal else 'DIFFERENT'} outputs)", flush=True)


if __name__ == "__main__":
    main()
