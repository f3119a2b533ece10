"""gpu_check's 8-bit KV cache rows: decode over a float8_e4m3fn cache at the bench step's decode
shapes (on a GPU the headline ones: batch 1/32/128 x context 1k/4k/16k, head size 128, 32 query
heads over 8 KV heads, bf16 queries), on every backend the bench step ran.

The K/V of each problem are bench.shapes' random caches quantised with one scale per KV head
(amax / 448, what `calculate_kv_scales`-style calibration gives). Bytes are counted as read: one
byte per K/V element plus the query and output rows, so the fraction of the copy bandwidth is
comparable with the same backend's row over a 16-bit cache in the bench step (`frac_copy_16bit`);
the issue's target is the same fraction. Each row also has the output's relative error against
torch's SDPA on the dequantised K/V (`rel_err_vs_sdpa`: what was timed computed the right thing).
"""

from __future__ import annotations

import time
from dataclasses import asdict, replace

import torch

from bench import kernels
from bench.shapes import BenchProblem, gather_dense
from bench.timing import median_seconds

CACHE_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0


def _quantized(p: BenchProblem) -> tuple[BenchProblem, torch.Tensor, torch.Tensor]:
    """`p` with 8-bit caches (its 16-bit caches freed) and their per-KV-head scales; its dense
    K/V (the SDPA baseline's), when kept, become the dequantised values in the query's dtype."""
    caches, scales = [], []
    for cache in (p.key_cache, p.value_cache):
        scale = (cache.abs().amax(dim=(0, 2, 3)).float() / FP8_MAX).clamp_min(1e-12)
        caches.append((cache.float() / scale[None, :, None, None]).clamp(-FP8_MAX, FP8_MAX)
                      .to(CACHE_DTYPE))
        scales.append(scale)
    q = replace(p, key_cache=caches[0], value_cache=caches[1], dense_k=None, dense_v=None)
    if p.dense_k is not None:
        context = int(p.seq_lens[0])
        q.dense_k, q.dense_v = (
            (gather_dense(c.view(torch.uint8), p.block_tables, context).view(CACHE_DTYPE).float()
             * s[None, :, None, None]).to(p.query.dtype) for c, s in zip(caches, scales))
    return q, scales[0], scales[1]


def bytes_read(p: BenchProblem) -> int:
    """Each K/V row of every sequence read once at one byte per element, the query read and the
    output written once."""
    kv_row = p.key_cache.shape[1] * p.key_cache.shape[3] * p.key_cache.element_size()
    return 2 * int(p.seq_lens.sum()) * kv_row + 2 * p.query.numel() * p.query.element_size()


def _call(p: BenchProblem, k_scale: torch.Tensor, v_scale: torch.Tensor, backend: str):
    from paged_kernels import paged_attention
    out = torch.empty_like(p.query)
    return lambda: paged_attention(p.query, p.key_cache, p.value_cache, p.block_tables,
                                   p.seq_lens, out=out, backend=backend, k_scale=k_scale,
                                   v_scale=v_scale)


def prepare(shape: kernels.Shape, dtype: torch.dtype, device: str,
            backend: str) -> kernels.Prepared:
    """The decode call of `backend` over 8-bit copies of `shape`'s problems (rotated over as
    bench.kernels does, so repeated calls read device memory)."""
    first, k_scale, v_scale = _quantized(kernels._problem(shape, dtype, device, seed=0))
    moved = bytes_read(first)
    fns = [_call(first, k_scale, v_scale, backend)]
    for seed in range(1, kernels._copies(moved, device)):
        p, ks, vs = _quantized(kernels._problem(shape, dtype, device, seed=seed))
        fns.append(_call(p, ks, vs, backend))
    check = lambda: kernels._rel_error(fns[0](), first)  # noqa: E731
    return kernels.Prepared(kernels._rotating(fns), moved, first.flops(), len(fns), check)


def _frac_16bit(bench: dict, backend: str, shape: kernels.Shape) -> float | None:
    """The best fraction of copy bandwidth of `backend`'s row at `shape` in the bench step."""
    for r in bench["results"]:
        if (r["backend"], r["kind"], r["batch"], r["context"]) == \
                (backend, shape.kind, shape.batch, shape.context) and "seconds" in r:
            return r.get("graph_frac_copy_bw", r.get("frac_copy_bw"))
    return None


def rows(cfg: dict, device: str, bench: dict, deadline: float) -> list[dict]:
    """One row per (decode shape, backend) of the bench step, timed eagerly and (on a GPU) as a
    CUDA-graph replay; shapes left when `deadline` (time.time()) has passed are skipped. A
    quick run (the CPU smoke) takes the first two shapes only."""
    results = []
    shapes = [s for s in kernels.shapes(device, cfg["quick"]) if s.kind == "decode"]
    for shape in shapes[:2] if cfg["quick"] else shapes:
        for backend in bench["backends"]:
            row = {"backend": backend, **asdict(shape), "cache_dtype": "float8_e4m3fn",
                   "frac_copy_16bit": _frac_16bit(bench, backend, shape)}
            if time.time() > deadline:
                results.append({**row, "error": "skipped: out of time"})
                continue
            try:
                prepared = prepare(shape, cfg["dtype"], device, backend)
                seconds = median_seconds(prepared.run, device, repeat=cfg["repeat"])
                row.update(kernels.metrics(prepared, seconds, bench["ceilings"]))
                if device == "cuda":
                    row.update(kernels.graph_metrics(prepared, cfg["repeat"], bench["ceilings"]))
                row["rel_err_vs_sdpa"] = prepared.check()
            except Exception as exc:  # noqa: BLE001 - a failing point is reported, not fatal
                row["error"] = f"{type(exc).__name__}: {exc}"[:300]
            results.append(row)
            if device == "cuda":
                torch.cuda.empty_cache()
    return results


def table(rows_: list[dict]) -> list[str]:
    """The report's markdown table of these rows."""
    lines = ["| backend | batch | context | eager us | graph us | GB/s read (best) | of copy BW "
             "| 16-bit cache: of copy BW | rel err vs SDPA |", "|" + " --- |" * 9]
    for r in rows_:
        head = f"| {r['backend']} | {r['batch']} | {r['context']} |"
        if "seconds" not in r:
            lines.append(f"{head} {r.get('error', '?')[:160]} |")
            continue
        seconds = r.get("graph_seconds", r["seconds"])
        frac = r.get("graph_frac_copy_bw", r.get("frac_copy_bw"))
        graph = r.get("graph_seconds")
        lines.append(
            f"{head} {r['seconds'] * 1e6:.1f} | {'-' if graph is None else f'{graph * 1e6:.1f}'}"
            f" | {r['bytes_moved'] / seconds / 1e9:.1f} | "
            f"{'-' if frac is None else f'{frac:.1%}'} | "
            f"{'-' if r['frac_copy_16bit'] is None else format(r['frac_copy_16bit'], '.1%')} | "
            f"{r['rel_err_vs_sdpa']:.1e} |")
    return lines
