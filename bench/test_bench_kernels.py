"""pytest-benchmark: decode, prefill, mixed batches and write_kv for every backend benchmarked by
default here (bench.kernels.default_backends), plus torch SDPA on contiguous K/V for decode and
prefill. Each benchmark's `extra_info` records bytes moved, GB/s, TFLOP/s and their fractions of
the copy bandwidth and matmul rate measured once in the same run (bench/ceilings.py), so runs on
different machines compare. On a GPU the timed call is eager (what a Python caller pays);
`extra_info` also holds `graph_*` metrics of the same calls replayed from a CUDA graph.

    python -m pytest bench/test_bench_kernels.py --benchmark-columns=median,ops
    PAGED_KERNELS_BENCH_BACKENDS=reference,triton python -m pytest bench/test_bench_kernels.py

On the CPU the shapes are tiny and interpreter/emulation backends (Triton's interpreter, the CUDA
host build) are left out unless named in PAGED_KERNELS_BENCH_BACKENDS.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported

from bench.ceilings import measure_ceilings  # noqa: E402
from bench.kernels import (  # noqa: E402
    SDPA,
    default_backends,
    graph_metrics,
    metrics,
    prepare,
    shapes,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32
BACKENDS_ENV = "PAGED_KERNELS_BENCH_BACKENDS"


def _backends() -> list[str]:
    named = os.environ.get(BACKENDS_ENV)
    return named.split(",") if named else default_backends(DEVICE)


def _cases() -> list[tuple[str, object]]:
    cases = []
    for shape in shapes(DEVICE, quick=DEVICE != "cuda"):
        names = _backends() + ([SDPA] if shape.kind in ("decode", "prefill") else [])
        cases += [(name, shape) for name in names]
    return cases


CASES = _cases()


@pytest.fixture(scope="module")
def ceilings() -> dict:
    return measure_ceilings(DEVICE, DTYPE)


@pytest.mark.parametrize("backend,shape", CASES, ids=[f"{b}-{s.id}" for b, s in CASES])
def test_kernel(benchmark, ceilings: dict, backend: str, shape) -> None:
    try:
        prepared = prepare(backend, shape, DTYPE, DEVICE)
        prepared.run()
    except NotImplementedError as exc:
        pytest.skip(str(exc))

    def run() -> None:
        prepared.run()
        if DEVICE == "cuda":
            torch.cuda.synchronize()

    benchmark.pedantic(run, rounds=20 if DEVICE == "cuda" else 5, warmup_rounds=2, iterations=1)
    benchmark.extra_info.update({"backend": backend, "shape": shape.id, "dtype": str(DTYPE)})
    if not benchmark.enabled:  # --benchmark-disable: one untimed call, no statistics
        return
    benchmark.extra_info.update(metrics(prepared, benchmark.stats.stats.median, ceilings))
    if DEVICE == "cuda":  # the kernels alone, without host-side checks and launch overhead
        benchmark.extra_info.update(graph_metrics(prepared, 10, ceilings))
    benchmark.extra_info.update({f"ceiling_{k}": v for k, v in ceilings.items()})
