"""The cpu backend against the reference on the CPU, at the engine's decode shape (SmolLM2-135M:
9 query heads, 3 KV heads, head size 64, bf16, block size 16; 16 sequences x 300 tokens, and one
sequence x 300) and a 256-token prefill, at 1 and 2 threads. Prints the fastest and the median ms per call of 30 (the
fastest is the stable figure on a shared machine); no speed assertion (docs/cpu.md).

    python -m pytest bench/test_bench_cpu.py -q -s
    python bench/test_bench_cpu.py            # the same table without pytest
"""

from __future__ import annotations

import time

import pytest
import torch

from bench.shapes import make_problem
from paged_kernels import available_backends, paged_attention

SHAPES = {  # name -> (batch, context, q_len)
    "decode-16x300": (16, 300, 1),
    "decode-16x300-cold": (16, 300, 1),  # 30 layers' caches in turn, as in an engine step
    "decode-1x300-cold": (1, 300, 1),  # single stream: 30 layers' caches (~1.8 MB) in turn
    "prefill-256": (1, 256, 256),
}
#: Distinct problems cycled through for a "-cold" shape: 30 layers of K/V (~55 MB in bf16) do not
#: fit the last-level cache, so every call reads its K/V from memory, as in the engine.
COLD_LAYERS = 30
HEADS = {"num_heads": 9, "num_kv_heads": 3, "head_size": 64, "block_size": 16}


def ms_per_call(shape: str, backend: str, threads: int, dtype: torch.dtype,
                repeat: int = 30) -> tuple[float, float]:
    """(fastest, median) milliseconds of one `paged_attention` call with `threads` torch threads."""
    batch, context, q_len = SHAPES[shape]
    layers = COLD_LAYERS if shape.endswith("-cold") else 1
    problems = [make_problem(batch, context, q_len, dtype=dtype, device="cpu", **HEADS)
                for _ in range(layers)]
    out = torch.empty_like(problems[0].query)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    times = []
    try:
        for i in range(repeat + 3):
            p = problems[i % layers]
            start = time.perf_counter()
            paged_attention(p.query, p.key_cache, p.value_cache, p.block_tables, p.seq_lens,
                            cu_seqlens_q=p.cu_seqlens_q, out=out, backend=backend)
            if i >= 3:  # warm-up calls excluded
                times.append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(previous)
    times.sort()
    return 1e3 * times[0], 1e3 * times[len(times) // 2]


@pytest.mark.skipif("cpu" not in available_backends(), reason="cpu backend unavailable")
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_cpu_vs_reference(shape: str, threads: int) -> None:
    cpu = ms_per_call(shape, "cpu", threads, torch.bfloat16)
    ref = ms_per_call(shape, "reference", threads, torch.bfloat16)
    print(f"\n{shape} bf16 threads={threads}: cpu {cpu[0]:.3f} ms (median {cpu[1]:.3f}), "
          f"reference {ref[0]:.3f} ms (median {ref[1]:.3f}), speed-up {ref[0] / cpu[0]:.1f}x")


if __name__ == "__main__":
    print("| shape (bf16) | threads | cpu ms: fastest / median | reference ms: fastest / median "
          "| speed-up (fastest) |")
    print("| --- | --- | --- | --- | --- |")
    for name in SHAPES:
        for n in (1, 2):
            c = ms_per_call(name, "cpu", n, torch.bfloat16)
            r = ms_per_call(name, "reference", n, torch.bfloat16)
            print(f"| {name} | {n} | {c[0]:.3f} / {c[1]:.3f} | {r[0]:.2f} / {r[1]:.2f} | "
                  f"{r[0] / c[0]:.1f}x |")
