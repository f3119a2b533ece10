"""pytest-benchmark: the Triton backend's decode (split-K heuristic and fixed split) and varlen
prefill, with bytes moved, GB/s, the fraction of the device-to-device copy bandwidth and the ratio
to torch's scaled_dot_product_attention on the same K/V stored contiguously, all measured in the
same run. On a GPU it also times candidate launch configurations of the target decode shape, to
fill triton_impl/configs.py from measurements.

    python -m pytest bench/test_bench_triton.py --benchmark-columns=median,ops

The GPU target (issue 3): decode, batch 32, context 4096, head size 128, 32 query heads over 8 KV
heads, bfloat16: >= 0.8 of the copy bandwidth and time_over_sdpa <= 1.1. On the CPU the shapes are
tiny and run in Triton's interpreter: the numbers only show that the benchmark runs.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported
pytest.importorskip("triton")

import paged_kernels as pk  # noqa: E402
from bench.ceilings import copy_bandwidth  # noqa: E402
from bench.shapes import BenchProblem, make_problem, sdpa_dense  # noqa: E402
from bench.timing import median_seconds  # noqa: E402

if "triton" not in pk.available_backends():
    pytest.skip(f"triton unavailable: {pk.unavailable_backends().get('triton')}",
                allow_module_level=True)

from triton_impl import configs, decode  # noqa: E402

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
DTYPE = torch.bfloat16 if GPU else torch.float32
HEADS = dict(num_heads=32, num_kv_heads=8, head_size=128) if GPU else \
    dict(num_heads=4, num_kv_heads=2, head_size=32)
# (batch, context, q_len); the first decode shape is the target.
DECODE = [(32, 4096, 1), (128, 4096, 1), (1, 16384, 1), (8, 32768, 1)] if GPU else [(2, 64, 1)]
PREFILL = [(1, 4096, 4096), (8, 8192, 512)] if GPU else [(1, 48, 48)]
REPEAT = 20 if GPU else 3


@pytest.fixture(scope="module")
def copy_gbps() -> float:
    return copy_bandwidth(DEVICE)["copy_GBps"]


def _problem(batch: int, context: int, q_len: int) -> BenchProblem:
    return make_problem(batch, context, q_len, dtype=DTYPE, device=DEVICE, **HEADS)


def _runner(p: BenchProblem):
    out = torch.empty_like(p.query)
    return lambda: pk.paged_attention(p.query, p.key_cache, p.value_cache, p.block_tables,
                                      p.seq_lens, cu_seqlens_q=p.cu_seqlens_q, out=out,
                                      backend="triton")


def _graph_seconds(fn) -> float | None:
    """Median seconds of `fn` replayed from a CUDA graph (no host launch overhead), or None when
    capture fails. The engine's GPU path replays graphs, so this is the kernels' own time."""
    if not GPU:
        return None
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()  # warm-up off the capture: compiles and caches the kernels
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
    except RuntimeError:
        return None
    return median_seconds(graph.replay, DEVICE, repeat=REPEAT)


def _record(benchmark, p: BenchProblem, fn, copy: float, **extra) -> None:
    """Runs `fn` under pytest-benchmark, then times it and SDPA with device timers (eager, and
    replayed from a CUDA graph on a GPU); the ratios use the graph time when there is one."""

    def run() -> None:
        fn()
        if GPU:
            torch.cuda.synchronize()

    benchmark.pedantic(run, rounds=REPEAT, warmup_rounds=2, iterations=1)
    eager = median_seconds(fn, DEVICE, repeat=REPEAT)
    graph = _graph_seconds(fn)
    sdpa_fn = sdpa_dense(p)
    sdpa = _graph_seconds(sdpa_fn) or median_seconds(sdpa_fn, DEVICE, repeat=REPEAT)
    seconds = graph or eager
    moved = p.bytes_moved()
    benchmark.extra_info.update({
        "bytes_moved": moved, "eager_s": eager, "graph_s": graph, "seconds": seconds,
        "GB/s": moved / seconds / 1e9, "copy_GBps": copy,
        "fraction_of_copy": moved / seconds / 1e9 / copy, "sdpa_contiguous_s": sdpa,
        "time_over_sdpa": seconds / sdpa, **extra,
    })


SPLITS = ["heuristic", "fixed-256", "fixed-512", "fixed-1024"] if GPU else ["heuristic", "fixed-64"]


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("batch,context,q_len", DECODE,
                         ids=[f"b{b}-ctx{c}" for b, c, _ in DECODE])
def test_decode(benchmark, copy_gbps: float, split: str, batch: int, context: int,
                q_len: int) -> None:
    p = _problem(batch, context, q_len)
    decode.set_fixed_split_size(None if split == "heuristic" else int(split.split("-")[1]))
    try:
        problem = pk.abi.check_attention_args(p.query, p.key_cache, p.value_cache,
                                              p.block_tables, p.seq_lens)
        cfg = configs.launch_config("decode", problem.head_size, problem.block_size, DTYPE)
        split_size, num_splits = decode.plan_splits(problem, cfg.tile_n)
        _record(benchmark, p, _runner(p), copy_gbps, split_size=split_size,
                num_splits=num_splits, config=str(cfg))
    finally:
        decode.set_fixed_split_size(None)


@pytest.mark.parametrize("batch,context,q_len", PREFILL,
                         ids=[f"b{b}-ctx{c}-q{q}" for b, c, q in PREFILL])
def test_prefill(benchmark, copy_gbps: float, batch: int, context: int, q_len: int) -> None:
    p = _problem(batch, context, q_len)
    cfg = configs.launch_config("varlen", HEADS["head_size"], 16, DTYPE)
    _record(benchmark, p, _runner(p), copy_gbps, flops=p.flops(),
            config=str(cfg))
    benchmark.extra_info["TFLOP/s"] = p.flops() / benchmark.extra_info["seconds"] / 1e12


CANDIDATES = [configs.LaunchConfig(t, 16, w, s) for t in (32, 64, 128) for w in (4, 8)
              for s in (2, 3, 4)]


@pytest.mark.skipif(not GPU, reason="launch configurations are only meaningful on a GPU")
@pytest.mark.parametrize("cfg", CANDIDATES, ids=[f"t{c.tile_n}-w{c.num_warps}-s{c.num_stages}"
                                                 for c in CANDIDATES])
def test_decode_config_candidates(benchmark, copy_gbps: float,
                                  cfg: configs.LaunchConfig) -> None:
    """The target decode shape under each candidate configuration (heuristic splits)."""
    batch, context, q_len = DECODE[0]
    p = _problem(batch, context, q_len)
    key = ("decode", HEADS["head_size"], 16, DTYPE)
    configs.set_override(*key, cfg)
    try:
        _record(benchmark, p, _runner(p), copy_gbps, config=str(cfg))
    except Exception as exc:  # a candidate may need more shared memory than the device has
        if type(exc).__name__ == "OutOfResources":
            pytest.skip(f"{cfg}: {exc}")
        raise
    finally:
        configs.set_override(*key, None)
