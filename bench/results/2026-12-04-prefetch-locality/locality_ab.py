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

import statistics
import sys

import torch

import cpu_impl.backend as cpu_backend
import paged_kernels as pk
from bench.build_ab import HEAD_SIZE, HEADS, LAYERS, engine_attention_case, load_extension
from bench.timing import seconds_in_turns

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
        print(f"threads {threads} context {context} {pages} {mode}: {cells} us/call"
              f" ({'equal' if equal else 'DIFFERENT'} outputs)", flush=True)


if __name__ == "__main__":
    main()
