"""Causal varlen prefill (SEQS sequences of LENGTH tokens, 9 query heads over 3 KV heads of 64,
bf16, block size 16, a random block table) through the cpu backend with
`cpu_impl.backend.prefetch_lines` at each distance of LINES, in turns in one process:

    python prefill_ab.py THREADS ROUNDS SEQS LENGTH LINES [LINES ...]

Prints each distance's median ms per call and whether the outputs are equal bit for bit."""

from __future__ import annotations

import statistics
import sys

import torch

import cpu_impl.backend as cpu_backend
import paged_kernels as pk
from bench.shapes import make_mixed
from bench.timing import seconds_in_turns


def main() -> None:
    threads, rounds, seqs, length = (int(a) for a in sys.argv[1:5])
    distances = [int(a) for a in sys.argv[5:]]
    torch.set_num_threads(threads)
    p = make_mixed([length] * seqs, [length] * seqs, num_heads=9, num_kv_heads=3, head_size=64,
                   dtype=torch.bfloat16)
    outs = [torch.empty_like(p.query) for _ in distances]

    def call(i: int) -> None:
        cpu_backend.prefetch_lines = distances[i]
        pk.paged_attention(p.query, p.key_cache, p.value_cache, p.block_tables, p.seq_lens,
                           cu_seqlens_q=p.cu_seqlens_q, out=outs[i], backend="cpu")

    for i in range(len(distances)):
        call(i)
    times = seconds_in_turns([lambda i=i: call(i) for i in range(len(distances))], rounds)
    cpu_backend.prefetch_lines = cpu_backend.PREFETCH_LINES
    equal = all(torch.equal(outs[0], o) for o in outs[1:])
    cells = "  ".join(f"{lines} lines {statistics.median(t) * 1e3:.2f} ms"
                      for lines, t in zip(distances, times))
    print(f"threads {threads} prefill {seqs} x {length}: {cells}"
          f" ({'equal' if equal else 'DIFFERENT'} outputs)", flush=True)


if __name__ == "__main__":
    main()
