"""Kernel benchmarks from a plain command: decode, prefill, mixed batches and write_kv per backend,
with bytes moved, GB/s, TFLOP/s and their fractions of the copy bandwidth and matmul rate measured
in the same run (bench/ceilings.py). Prints a table; with `--out DIR` writes `kernels.json` and
`gbps_vs_context.png` (GB/s of decode against context length, one line per backend, one panel per
batch size).

    python -m bench.kernels [--device cuda|cpu] [--backends triton,cuda] [--quick] [--out DIR]

The functions are reusable (bench/test_bench_kernels.py uses them): `shapes()` lists the shapes,
`prepare()` builds one backend's callable with its bytes and flops, `measure()` times it and
returns one result dict, `run()` does a whole sweep.

On a GPU each point is timed twice: eager calls (host-side checks and launches included, what a
Python caller pays) and, unless `--no-cuda-graph`, replays of the same calls captured in one CUDA
graph (the kernels alone; `graph_seconds`, `graph_GB/s`); a backend that cannot be captured
records `graph_error`.

Default backends: on a GPU those that outrank the reference (priority > 0); on the CPU the
reference only, since the other CPU backends are interpreters or emulations (Triton's interpreter,
the CUDA host build) whose timings say nothing about the kernels; name them with `--backends`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from bench.ceilings import measure_ceilings
from bench.shapes import BenchProblem, make_mixed, make_problem, sdpa_dense
from bench.timing import median_seconds

SDPA = "torch-sdpa"  # pseudo-backend: torch SDPA on the same K/V stored contiguously
KINDS = ("decode", "prefill", "mixed", "write_kv")
ROTATE_BYTES = 256 << 20  # more than any GPU's last-level cache (H200: 50 MiB L2)
MAX_COPIES = 16


@dataclass(frozen=True)
class Shape:
    """One benchmark point. `q_len`: query tokens per sequence (1 for decode); for "mixed", the
    chunk of the prefilling sequences (one in eight, at least one; the rest decode); for
    "write_kv", tokens written per sequence."""

    kind: str
    batch: int
    context: int
    q_len: int = 1
    num_heads: int = 32
    num_kv_heads: int = 8
    head_size: int = 128
    block_size: int = 16

    @property
    def id(self) -> str:
        return (f"{self.kind}-b{self.batch}-ctx{self.context}-q{self.q_len}-"
                f"h{self.num_heads}kv{self.num_kv_heads}-d{self.head_size}")


@dataclass
class Prepared:
    """A ready-to-time call of one backend on one shape, and what it must move and compute."""

    run: Callable[[], object]
    bytes_moved: int  # per call
    flops: int        # per call
    copies: int = 1   # problem copies `run` rotates over
    #: relative error of the backend's output against torch SDPA (decode/prefill only)
    check: Optional[Callable[[], float]] = None


def shapes(device: str, quick: bool = False) -> list[Shape]:
    """The benchmark shapes: the headline GPU set (decode batch 1/32/128 x context 1k/4k/16k,
    head size 128, 32 query heads over 8 KV heads; prefill, chunked prefill, a mixed batch,
    write_kv); `quick` keeps a few of them; on the CPU, tiny shapes that finish in seconds."""
    if device != "cuda":
        small = dict(num_heads=8, num_kv_heads=2, head_size=64)
        contexts = (128, 512) if quick else (128, 512, 2048)
        return ([Shape("decode", b, c, **small) for b in (1, 8) for c in contexts]
                + [Shape("prefill", 1, 256, 256, **small), Shape("prefill", 2, 512, 64, **small),
                   Shape("mixed", 8, 512, 64, **small), Shape("write_kv", 8, 512, 1, **small),
                   Shape("write_kv", 1, 512, 256, **small)])
    batches, contexts = ((1, 32), (1024, 4096)) if quick else ((1, 32, 128), (1024, 4096, 16384))
    out = [Shape("decode", b, c) for b in batches for c in contexts]
    out += [Shape("prefill", 1, 4096, 4096), Shape("prefill", 8, 8192, 512),
            Shape("mixed", 32, 4096, 1024)]
    if not quick:
        out += [Shape("prefill", 4, 16384, 2048)]
    out += [Shape("write_kv", 128, 4096, 1), Shape("write_kv", 4, 4096, 2048)]
    return out


def _q_lens(shape: Shape) -> list[int]:
    if shape.kind == "decode":
        return [1] * shape.batch
    if shape.kind == "mixed":
        num_prefill = max(1, shape.batch // 8)
        return [shape.q_len] * num_prefill + [1] * (shape.batch - num_prefill)
    return [shape.q_len] * shape.batch


def _problem(shape: Shape, dtype: torch.dtype, device: str, seed: int) -> BenchProblem:
    kwargs = dict(num_heads=shape.num_heads, num_kv_heads=shape.num_kv_heads,
                  head_size=shape.head_size, block_size=shape.block_size, dtype=dtype,
                  device=device, seed=seed)
    if shape.kind == "mixed":
        return make_mixed([shape.context] * shape.batch, _q_lens(shape), **kwargs)
    return make_problem(shape.batch, shape.context, _q_lens(shape)[0], **kwargs)


def _copies(one_copy_bytes: int, device: str) -> int:
    """How many copies of a problem to rotate over so that repeated calls read device memory,
    not a cache that still holds the previous call's data (none on the CPU)."""
    if device != "cuda":
        return 1
    return max(1, min(MAX_COPIES, ROTATE_BYTES // max(1, one_copy_bytes)))


def _rotating(fns: list[Callable[[], object]]) -> Callable[[], object]:
    state = {"i": -1}

    def call() -> object:
        state["i"] = (state["i"] + 1) % len(fns)
        return fns[state["i"]]()

    return call


def _attention_call(p: BenchProblem, backend: str) -> Callable[[], object]:
    from paged_kernels import paged_attention
    out = torch.empty_like(p.query)
    return lambda: paged_attention(p.query, p.key_cache, p.value_cache, p.block_tables,
                                   p.seq_lens, cu_seqlens_q=p.cu_seqlens_q, out=out,
                                   backend=backend)


def _attention_prepared(shape: Shape, dtype: torch.dtype, device: str,
                        backend: str) -> Prepared:
    if backend == SDPA and shape.kind == "mixed":
        raise ValueError(f"backend: {SDPA} takes one q_len per batch, got shape {shape.id}")
    first = _problem(shape, dtype, device, seed=0)
    problems = [first] + [_problem(shape, dtype, device, seed=i)
                          for i in range(1, _copies(first.bytes_moved(), device))]
    fns = [sdpa_dense(p) if backend == SDPA else _attention_call(p, backend) for p in problems]
    check = None
    if backend != SDPA and first.dense_k is not None:
        check = lambda: _rel_error(fns[0](), first)  # noqa: E731
    return Prepared(_rotating(fns), first.bytes_moved(), first.flops(), len(fns), check)


def _rel_error(out: torch.Tensor, p: BenchProblem) -> float:
    """‖out − SDPA‖ / ‖SDPA‖ on the same problem (a sanity check of what was timed)."""
    ref = sdpa_dense(p)().transpose(1, 2).reshape(out.shape).float()
    return float(torch.linalg.vector_norm(out.float() - ref) / torch.linalg.vector_norm(ref))


def _write_kv_prepared(shape: Shape, dtype: torch.dtype, device: str, backend: str) -> Prepared:
    """`batch * q_len` tokens written to distinct random slots of a cache of `batch * context`
    slots; moves the rows read plus the rows written, and the slot ids."""
    if backend == SDPA:
        raise ValueError(f"backend: {SDPA} has no write_kv, got shape {shape.id}")
    from paged_kernels import write_kv
    tokens = shape.batch * shape.q_len
    num_blocks = -(-shape.batch * shape.context // shape.block_size)
    gen = torch.Generator(device=device).manual_seed(0)
    cache_shape = (num_blocks, shape.num_kv_heads, shape.block_size, shape.head_size)
    caches = [torch.zeros(cache_shape, dtype=dtype, device=device) for _ in range(2)]
    row_shape = (tokens, shape.num_kv_heads, shape.head_size)
    row_bytes = shape.num_kv_heads * shape.head_size * caches[0].element_size()
    moved = 2 * 2 * tokens * row_bytes + 8 * tokens
    fns = []
    for _ in range(_copies(moved, device)):
        k, v = (torch.randn(row_shape, generator=gen, device=device).to(dtype) for _ in range(2))
        slots = torch.randperm(num_blocks * shape.block_size, generator=gen,
                               device=device)[:tokens]
        fns.append(lambda k=k, v=v, slots=slots: write_kv(k, v, caches[0], caches[1], slots,
                                                          backend=backend))
    return Prepared(_rotating(fns), moved, 0, len(fns))


def prepare(backend: str, shape: Shape, dtype: torch.dtype, device: str) -> Prepared:
    """Builds the inputs of `shape` on `device` and the call of `backend` on them (`SDPA` for
    torch's scaled_dot_product_attention on contiguous K/V; decode and prefill only). On a GPU,
    small problems are built several times and the call rotates over the copies."""
    if shape.kind == "write_kv":
        return _write_kv_prepared(shape, dtype, device, backend)
    if shape.kind not in KINDS:
        raise ValueError(f"shape.kind: expected one of {KINDS}, got {shape.kind!r}")
    return _attention_prepared(shape, dtype, device, backend)


def metrics(prepared: Prepared, seconds: float, ceilings: Optional[dict] = None) -> dict:
    """Bytes, GB/s, TFLOP/s for a run of `seconds`, and their fractions of `ceilings`."""
    gbps = prepared.bytes_moved / seconds / 1e9
    tflops = prepared.flops / seconds / 1e12
    result = {"seconds": seconds, "bytes_moved": prepared.bytes_moved, "flops": prepared.flops,
              "GB/s": gbps, "TFLOP/s": tflops, "copies": prepared.copies}
    if ceilings:
        result["frac_copy_bw"] = gbps / ceilings["copy_GBps"]
        result["frac_matmul"] = tflops / ceilings["matmul_TFLOPs"]
    return result


def graph_seconds(prepared: Prepared, repeat: int = 10) -> float:
    """Median seconds per call of `prepared.run`, replayed from one CUDA graph that captures one
    call per problem copy (warm-up calls run first, outside the capture, on a side stream)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(prepared.copies):
            prepared.run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(prepared.copies):
            prepared.run()
    return median_seconds(graph.replay, "cuda", repeat=repeat) / prepared.copies


def graph_metrics(prepared: Prepared, repeat: int, ceilings: Optional[dict]) -> dict:
    """`metrics()` of CUDA-graph replays, keys prefixed `graph_`, or `graph_error`."""
    try:
        seconds = graph_seconds(prepared, repeat)
    except Exception as exc:  # noqa: BLE001 - e.g. a backend that synchronises cannot be captured
        torch.cuda.synchronize()
        return {"graph_error": f"{type(exc).__name__}: {exc}"[:300]}
    graph = metrics(prepared, seconds, ceilings)
    return {f"graph_{k}": graph[k] for k in ("seconds", "GB/s", "TFLOP/s", "frac_copy_bw",
                                             "frac_matmul") if k in graph}


def measure(backend: str, shape: Shape, dtype: torch.dtype, device: str,
            ceilings: Optional[dict] = None, repeat: int = 10, cuda_graph: bool = True) -> dict:
    """Times `backend` on `shape` (median of `repeat` after warm-up) and returns one result:
    the shape's fields, the backend, `metrics()`, on a GPU with `cuda_graph` the `graph_*`
    metrics of CUDA-graph replays, and for decode/prefill `rel_err_vs_sdpa`."""
    prepared = prepare(backend, shape, dtype, device)
    seconds = median_seconds(prepared.run, device, repeat=repeat)
    result = {"backend": backend, **asdict(shape), "dtype": str(dtype).replace("torch.", ""),
              **metrics(prepared, seconds, ceilings)}
    if device == "cuda" and cuda_graph:
        result.update(graph_metrics(prepared, repeat, ceilings))
    if prepared.check is not None:
        result["rel_err_vs_sdpa"] = prepared.check()
    return result


def default_backends(device: str) -> list[str]:
    """Available backends that run on `device`: on a GPU those above the reference (priority
    > 0); on the CPU those not below it (interpreters and emulations rank below)."""
    from paged_kernels import available_backends, get_backend
    floor = 1 if device == "cuda" else 0
    return [n for n in available_backends()
            if device in get_backend(n).support.device_types and get_backend(n).priority >= floor]


def run(backends: Sequence[str], device: str, dtype: torch.dtype, quick: bool = False,
        sdpa: bool = True, repeat: int = 10, cuda_graph: bool = True,
        on_result: Optional[Callable[[dict], None]] = None) -> dict:
    """Ceilings, then every shape for every backend (and torch SDPA on decode/prefill when
    `sdpa`). A point that raises (a backend that does not support the shape raises
    NotImplementedError) is recorded with `error` and the sweep goes on."""
    ceilings = measure_ceilings(device, dtype)
    results = []
    for shape in shapes(device, quick):
        names = list(backends)
        if sdpa and shape.kind in ("decode", "prefill"):
            names.append(SDPA)
        for name in names:
            try:
                result = measure(name, shape, dtype, device, ceilings, repeat, cuda_graph)
            except Exception as exc:  # noqa: BLE001 - one failing point must not end a sweep
                result = {"backend": name, **asdict(shape),
                          "error": f"{type(exc).__name__}: {exc}"}
            results.append(result)
            if on_result is not None:
                on_result(result)
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    return {"device": name, "torch": torch.__version__, "dtype": str(dtype), "ceilings": ceilings,
            "results": results}


# --- output -------------------------------------------------------------------------------------

def format_row(r: dict) -> str:
    """One table line for a result of `measure()` (or an error)."""
    head = (f"{r['backend']:<11} {r['kind']:<8} {r['batch']:>5} {r['context']:>7} "
            f"{r['q_len']:>5} ")
    if "error" in r:
        return head + f"  failed: {r['error'][:200]}"
    pct = lambda key: f"{100 * r[key]:6.1f}" if key in r else "     -"  # noqa: E731
    err = f"{r['rel_err_vs_sdpa']:9.1e}" if "rel_err_vs_sdpa" in r else "        -"
    line = head + (f"{r['seconds'] * 1e6:>10.1f} {r['GB/s']:>8.1f} {pct('frac_copy_bw')} "
                   f"{r['TFLOP/s']:>8.2f} {pct('frac_matmul')} {err}")
    if "graph_seconds" in r:
        line += (f" {r['graph_seconds'] * 1e6:>9.1f} {r['graph_GB/s']:>8.1f} "
                 f"{pct('graph_frac_copy_bw')} {pct('graph_frac_matmul')}")
    elif "graph_error" in r:
        line += f"  graph: {r['graph_error'][:60]}"
    return line


def table_header(cuda_graph: bool = False) -> str:
    """Column names of `format_row` (eager time; with `cuda_graph`, graph-replay columns)."""
    head = ("backend     kind     batch context q_len         us     GB/s  %copy  TFLOP/s "
            "%matmul  err/sdpa")
    return head + ("  graph us  graph GB/s %copy %matmul" if cuda_graph else "")


def plot(report: dict, path: Path) -> None:
    """GB/s of decode against context length: one line per backend, one panel per batch; on a
    GPU from CUDA-graph replays where the backend could be captured, else from eager calls."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    decode = [r for r in report["results"] if r["kind"] == "decode" and "error" not in r]
    batches = sorted({r["batch"] for r in decode})
    fig, axes = plt.subplots(1, max(1, len(batches)), figsize=(5 * max(1, len(batches)), 4),
                             squeeze=False)
    for ax, batch in zip(axes[0], batches):
        for backend in sorted({r["backend"] for r in decode}):
            rows = [r for r in decode if r["batch"] == batch and r["backend"] == backend]
            graphed = all("graph_GB/s" in r for r in rows)
            key = "graph_GB/s" if graphed else "GB/s"
            points = sorted((r["context"], r[key]) for r in rows)
            label = backend + (" (graph)" if graphed else " (eager)" if report["device"] != "cpu"
                               else "")
            ax.plot([c for c, _ in points], [g for _, g in points], marker="o", label=label)
        ax.axhline(report["ceilings"]["copy_GBps"], color="gray", linestyle="--",
                   label="copy bandwidth")
        contexts = sorted({r["context"] for r in decode if r["batch"] == batch})
        ax.set_xscale("log", base=2)
        ax.set_xticks(contexts, [str(c) for c in contexts])
        ax.set(xlabel="context length", ylabel="GB/s", title=f"decode, batch {batch}")
        ax.legend(fontsize="small")
    fig.suptitle(f"{report['device']}, {report['dtype']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_outputs(report: dict, out_dir: Path) -> list[Path]:
    """Writes kernels.json and gbps_vs_context.png (without matplotlib, no plot) into `out_dir`;
    returns the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, png_path = out_dir / "kernels.json", out_dir / "gbps_vs_context.png"
    json_path.write_text(json.dumps(report, indent=2))
    try:
        plot(report, png_path)
    except ImportError as exc:  # the JSON is the record; the plot is a convenience
        print(f"no plot: {exc}")
        return [json_path]
    return [json_path, png_path]


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description="Paged-attention kernel benchmarks.")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        choices=("cuda", "cpu"))
    parser.add_argument("--backends", default=None,
                        help="comma-separated backend names (default: see module docstring)")
    parser.add_argument("--dtype", default=None,
                        help="float32, float16 or bfloat16 (default: bfloat16 on cuda, "
                             "float32 on cpu)")
    parser.add_argument("--quick", action="store_true", help="fewer shapes")
    parser.add_argument("--no-sdpa", action="store_true",
                        help="skip torch SDPA on contiguous K/V")
    parser.add_argument("--repeat", type=int, default=10, help="timed runs per point")
    parser.add_argument("--no-cuda-graph", action="store_true",
                        help="on a GPU, time eager calls only (no CUDA-graph replays)")
    parser.add_argument("--out", type=Path, default=None, help="folder for JSON and the plot")
    args = parser.parse_args(argv)
    if args.device == "cpu" and not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported
    dtype = getattr(torch, args.dtype or ("bfloat16" if args.device == "cuda" else "float32"))
    names = args.backends.split(",") if args.backends else default_backends(args.device)
    print(f"backends: {', '.join(names)}; device {args.device}; {dtype}", flush=True)
    cuda_graph = args.device == "cuda" and not args.no_cuda_graph
    print(table_header(cuda_graph), flush=True)
    report = run(names, args.device, dtype, quick=args.quick, sdpa=not args.no_sdpa,
                 repeat=args.repeat, cuda_graph=cuda_graph,
                 on_result=lambda r: print(format_row(r), flush=True))
    c = report["ceilings"]
    print(f"ceilings: copy {c['copy_GBps']:.1f} GB/s, {c['matmul_dtype']} matmul "
          f"{c['matmul_TFLOPs']:.2f} TFLOP/s")
    if args.out is not None:
        for path in write_outputs(report, args.out):
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
