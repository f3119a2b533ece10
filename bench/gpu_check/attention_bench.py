"""Times paged attention per backend at given shapes, next to baselines, with the bytes and flops
each must move; checks each backend's output against SDPA at the same shape.

Small problems are rotated across several copies so that repeated runs measure device memory, not
the L2 cache; on a GPU the calls are also captured in a CUDA graph and replayed, so launch overhead
and the host-side checks are timed separately from the kernels."""

from __future__ import annotations

from typing import Callable, Optional

import torch

from bench.shapes import BenchProblem, make_mixed, make_problem, sdpa_dense
from bench.timing import median_seconds
from paged_kernels import paged_attention

ROTATE_BYTES = 256 << 20  # more than any GPU's L2 cache


def _call(p: BenchProblem, backend: str, out: torch.Tensor) -> Callable[[], None]:
    return lambda: paged_attention(p.query, p.key_cache, p.value_cache, p.block_tables,
                                   p.seq_lens, cu_seqlens_q=p.cu_seqlens_q, out=out,
                                   backend=backend)


def _graph_seconds(fns: list[Callable[[], object]]) -> Optional[float]:
    """Median seconds per call of `fns` replayed from one CUDA graph, or None if capture fails."""
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for fn in fns:  # warm up (compiles, allocates) outside the capture
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for fn in fns:
                fn()
    except Exception:  # noqa: BLE001 - a backend that cannot be captured is reported as such
        return None
    return median_seconds(graph.replay, "cuda", warmup=2, repeat=10) / len(fns)


def time_calls(fns: list[Callable[[], object]], device: str) -> dict:
    """Eager median seconds per call (rotating over `fns`) and, on a GPU, graph-replay seconds."""
    state = {"i": 0}

    def one() -> None:
        fns[state["i"] % len(fns)]()
        state["i"] += 1

    result = {"eager_s": median_seconds(one, device, warmup=len(fns) + 1, repeat=20)}
    if device == "cuda":
        result["graph_s"] = _graph_seconds(fns)
    return result


def rel_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.float(), ref.float()
    if not torch.isfinite(x).all():
        return float("inf")
    return float(torch.linalg.vector_norm(x - ref) / torch.linalg.vector_norm(ref))


def bench_shape(batch: int, context: int, q_len: int, backends: list[str], device: str,
                dtype: torch.dtype, heads: tuple[int, int], head_size: int,
                block_size: int) -> list[dict]:
    """One row per backend plus one for SDPA on contiguous K/V, at one uniform shape."""
    kw = dict(num_heads=heads[0], num_kv_heads=heads[1], head_size=head_size,
              block_size=block_size, dtype=dtype, device=device)
    first = make_problem(batch, context, q_len, seed=0, **kw)
    copies = max(1, min(16, ROTATE_BYTES // max(1, first.bytes_moved())))
    problems = [first] + [make_problem(batch, context, q_len, seed=i, **kw)
                          for i in range(1, copies)]
    base = {"batch": batch, "context": context, "q_len": q_len, "bytes": first.bytes_moved(),
            "flops": first.flops(), "rotated_copies": copies}
    sdpa_fns = [sdpa_dense(p) for p in problems]
    reference = sdpa_fns[0]().transpose(1, 2).reshape(first.query.shape)
    rows = [{**base, "backend": "sdpa-contiguous", **time_calls(sdpa_fns, device)}]
    for backend in backends:
        outs = [torch.empty_like(p.query) for p in problems]
        fns = [_call(p, backend, o) for p, o in zip(problems, outs)]
        try:
            fns[0]()
            err = rel_error(outs[0], reference)
            rows.append({**base, "backend": backend, "rel_err_vs_sdpa": err,
                         **time_calls(fns, device)})
        except (NotImplementedError, RuntimeError) as exc:
            rows.append({**base, "backend": backend, "error": f"{type(exc).__name__}: {exc}"})
    del problems, sdpa_fns
    return rows


def bench_mixed(backends: list[str], device: str, dtype: torch.dtype, heads: tuple[int, int],
                head_size: int, block_size: int, contexts: list[int],
                q_lens: list[int]) -> list[dict]:
    """A mixed batch (prefills, chunked prefills, decodes): one row per backend (no SDPA: it has
    no single call for a ragged batch), errors measured against the first backend's output."""
    p = make_mixed(contexts, q_lens, num_heads=heads[0], num_kv_heads=heads[1],
                   head_size=head_size, block_size=block_size, dtype=dtype, device=device)
    base = {"batch": len(contexts), "context": max(contexts), "q_len": sum(q_lens),
            "bytes": p.bytes_moved(), "flops": p.flops(), "mixed": True}
    rows, first_out = [], None
    for backend in backends:
        out = torch.empty_like(p.query)
        fn = _call(p, backend, out)
        try:
            fn()
        except (NotImplementedError, RuntimeError) as exc:
            rows.append({**base, "backend": backend, "error": f"{type(exc).__name__}: {exc}"})
            continue
        row = {**base, "backend": backend, **time_calls([fn], device)}
        if first_out is None:
            first_out = out.clone()
            row["reference_for_errors"] = True
        else:
            row["rel_err_vs_first"] = rel_error(out, first_out)
        rows.append(row)
    return rows


def add_rates(row: dict, copy_gbps: float, matmul_tflops: float) -> dict:
    """GB/s, TFLOP/s and their fractions of the measured ceilings, from the best time."""
    times = [t for t in (row.get("graph_s"), row.get("eager_s")) if t]
    if not times:
        return row
    seconds = min(times)
    row["seconds"] = seconds
    row["GB/s"] = row["bytes"] / seconds / 1e9
    row["TFLOP/s"] = row["flops"] / seconds / 1e12
    row["frac_copy_bw"] = row["GB/s"] / copy_gbps
    row["frac_matmul"] = row["TFLOP/s"] / matmul_tflops
    return row
