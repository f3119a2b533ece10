"""The cpu backend's decode attention with Q.K^T on AMX tiles against the vdpbf16ps path of the
same build, in one process (the extension's `use_amx` switch), alternating 10 rounds; median time
per call. "cold": the 30 layers' caches of the engine's step in turn (16 x 280 tokens, 9 query
heads over 3 KV heads of 64: 100 MB, read from memory as a decode step reads them); "hot": one
sequence of 1024 tokens (0.8 MB, in L2) called again and again.

    PYTHONPATH=$PWD python amx_scores_ab.py THREADS
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

import paged_kernels as pk
from bench.shapes import make_mixed
from cpu_impl import build


def ab(ext, problems, rounds: int = 10) -> tuple[float, float]:
    out = torch.empty_like(problems[0].query)

    def sweep() -> None:
        for p in problems:
            pk.paged_attention(p.query, p.key_cache, p.value_cache, p.block_tables, p.seq_lens,
                               out=out, backend="cpu")

    times: dict[bool, list[float]] = {False: [], True: []}
    for r in range(rounds):
        for on in ((False, True) if r % 2 == 0 else (True, False)):
            ext.use_amx(on)
            sweep()
            t = time.perf_counter()
            sweep()
            times[on].append((time.perf_counter() - t) / len(problems))
    ext.use_amx(True)
    return statistics.median(times[False]), statistics.median(times[True])


def main() -> None:
    threads = int(sys.argv[1])
    torch.set_num_threads(threads)
    ext = build.load()
    if not ext.use_amx(True):
        sys.exit("AMX is not built in or not granted on this machine")
    cases = {
        "cold 16 x 280, 30 layers": [make_mixed([280] * 16, [1] * 16, num_heads=9, num_kv_heads=3,
                                                head_size=64, seed=i) for i in range(30)],
        "hot 1 x 1024": [make_mixed([1024], [1], num_heads=9, num_kv_heads=3, head_size=64)] * 30,
    }
    for name, problems in cases.items():
        dots, amx = ab(ext, problems)
        print(f"{name}, {threads} threads: vdpbf16ps {dots * 1e6:.0f} us, AMX {amx * 1e6:.0f} us,"
              f" x{dots / amx:.2f}")


if __name__ == "__main__":
    main()
