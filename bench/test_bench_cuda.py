"""pytest-benchmark: the CUDA backend's decode (heuristic partitions and fixed partition sizes) and
varlen prefill, with bytes moved, GB/s, the fraction of the device-to-device copy bandwidth and
the ratio to torch's scaled_dot_product_attention on the same K/V stored contiguously, all
measured in the same run.

    python -m pytest bench/test_bench_cuda.py --benchmark-columns=median,ops

On a GPU it runs backend "cuda" (the built extension if PAGED_KERNELS_CUDA_EXT_DIR or an
installed `_pk_cuda` is found, else NVRTC). Without one it runs the same kernels through the
host emulator ("cuda-host") on tiny shapes: those numbers only show that the benchmark runs.

The GPU target (issue 4): decode, batch 32, context 4096, head size 128, 32 query heads over 8 KV
heads, bfloat16, at >= 0.85 of the measured copy bandwidth (`fraction_of_copy` in extra_info).
"""

from __future__ import annotations

import pytest
import torch

import paged_kernels as pk
from bench.ceilings import copy_bandwidth
from bench.shapes import BenchProblem, make_problem, sdpa_dense
from bench.timing import median_seconds
from cuda.paged_cuda import planner, settings

GPU = torch.cuda.is_available()
BACKEND = "cuda" if GPU else "cuda-host"
if BACKEND not in pk.available_backends():
    pytest.skip(f"{BACKEND} unavailable: {pk.unavailable_backends().get(BACKEND)}",
                allow_module_level=True)

DEVICE = "cuda" if GPU else "cpu"
DTYPE = torch.bfloat16 if GPU else torch.float32
HEADS = ({"num_heads": 32, "num_kv_heads": 8, "head_size": 128} if GPU
         else {"num_heads": 4, "num_kv_heads": 2, "head_size": 64})
# (batch, context, q_len); the first decode shape is the target.
DECODE = [(32, 4096, 1), (128, 4096, 1), (1, 16384, 1), (8, 32768, 1)] if GPU else [(2, 64, 1)]
PREFILL = [(1, 4096, 4096), (8, 8192, 512)] if GPU else [(1, 48, 48)]
PARTITIONS = ["heuristic", "256", "512", "1024"] if GPU else ["heuristic", "32"]
REPEAT = 20 if GPU else 2


@pytest.fixture(scope="module")
def copy_gbps() -> float:
    return copy_bandwidth(DEVICE)["copy_GBps"]


def _runner(p: BenchProblem):
    out = torch.empty_like(p.query)
    return lambda: pk.paged_attention(p.query, p.key_cache, p.value_cache, p.block_tables,
                                      p.seq_lens, cu_seqlens_q=p.cu_seqlens_q, out=out,
                                      backend=BACKEND)


def _record(benchmark, p: BenchProblem, fn, copy: float, **extra) -> None:
    def run() -> None:
        fn()
        if GPU:
            torch.cuda.synchronize()

    benchmark.pedantic(run, rounds=REPEAT, warmup_rounds=1, iterations=1)
    seconds = median_seconds(fn, DEVICE, repeat=REPEAT)
    sdpa = median_seconds(sdpa_dense(p), DEVICE, repeat=REPEAT)
    moved = p.bytes_moved()
    benchmark.extra_info.update({
        "bytes_moved": moved, "seconds": seconds, "GB/s": moved / seconds / 1e9,
        "copy_GBps": copy, "fraction_of_copy": moved / seconds / 1e9 / copy,
        "sdpa_contiguous_s": sdpa, "time_over_sdpa": seconds / sdpa, **extra,
    })


@pytest.mark.parametrize("partition", PARTITIONS)
@pytest.mark.parametrize("batch,context,q_len", DECODE,
                         ids=[f"b{b}-ctx{c}" for b, c, _ in DECODE])
def test_decode(benchmark, monkeypatch, copy_gbps: float, partition: str, batch: int,
                context: int, q_len: int) -> None:
    if partition != "heuristic":
        monkeypatch.setenv(settings.PARTITION_ENV, partition)
    p = make_problem(batch, context, q_len, dtype=DTYPE, device=DEVICE, **HEADS)
    problem = pk.abi.check_attention_args(p.query, p.key_cache, p.value_cache, p.block_tables,
                                          p.seq_lens)
    sms = torch.cuda.get_device_properties(0).multi_processor_count if GPU else 4
    plan = planner.plan_attention(problem, sms)
    _record(benchmark, p, _runner(p), copy_gbps, partition_size=plan.partition_size,
            num_splits=plan.num_splits, launcher=getattr(pk.get_backend(BACKEND),
                                                         "launcher_kind", "host"))


@pytest.mark.parametrize("batch,context,q_len", PREFILL,
                         ids=[f"b{b}-ctx{c}-q{q}" for b, c, q in PREFILL])
def test_prefill(benchmark, copy_gbps: float, batch: int, context: int, q_len: int) -> None:
    p = make_problem(batch, context, q_len, dtype=DTYPE, device=DEVICE, **HEADS)
    _record(benchmark, p, _runner(p), copy_gbps, flops=p.flops())
    benchmark.extra_info["TFLOP/s"] = p.flops() / benchmark.extra_info["seconds"] / 1e12

