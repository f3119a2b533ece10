"""pytest-benchmark: the reference backend at a few decode and prefill shapes, with bytes moved,
GB/s, and the ratio to torch's scaled_dot_product_attention on the same K/V stored contiguously
(the cost of paging plus the reference's gather), measured in the same run.

    python -m pytest bench/test_bench_reference.py --benchmark-columns=median,ops
"""

from __future__ import annotations

import pytest
import torch

from bench.shapes import make_problem, sdpa_dense
from bench.timing import median_seconds
from paged_kernels import paged_attention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = [  # (batch, context, q_len)
    (8, 512, 1),
    (32, 1024, 1),
    (2, 512, 512),
    (1, 1024, 128),
]


@pytest.mark.parametrize("batch,context,q_len", SHAPES,
                         ids=[f"b{b}-ctx{c}-q{q}" for b, c, q in SHAPES])
def test_reference(benchmark, batch, context, q_len):
    p = make_problem(batch, context, q_len, num_heads=16, num_kv_heads=4, head_size=64,
                     dtype=torch.float32 if DEVICE == "cpu" else torch.bfloat16, device=DEVICE)

    def run():
        paged_attention(p.query, p.key_cache, p.value_cache, p.block_tables, p.seq_lens,
                        cu_seqlens_q=p.cu_seqlens_q, backend="reference")
        if DEVICE == "cuda":
            torch.cuda.synchronize()

    benchmark.pedantic(run, rounds=5, warmup_rounds=1, iterations=1)
    if not benchmark.enabled:  # --benchmark-disable: one untimed call, no statistics
        return
    seconds = benchmark.stats.stats.median
    sdpa = median_seconds(sdpa_dense(p), DEVICE, repeat=5)
    benchmark.extra_info.update({
        "bytes_moved": p.bytes_moved(),
        "GB/s": p.bytes_moved() / seconds / 1e9,
        "sdpa_contiguous_s": sdpa,
        "time_over_sdpa": seconds / sdpa,
    })
