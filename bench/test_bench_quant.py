"""The GGUF quantized matmuls against the dense oneDNN path, per projection of the default model
(SmolLM2-135M-Instruct, Q4_1 projections and a Q8_0 output head), at a few token-row counts M:
the tiled bf16 path (engine/model/quant_tiled.py, bfloat16 only), the file-layout block path
(engine/model/quant.py) and oneDNN. The blocks are the file's own (30 layers, fused as the model
fuses them); the dense weights are packed bf16 (or float32) of the same shapes. Every call reads
its weights from memory, as in a decode step: each timed sweep runs the 30 layers' weights in
turn (the head, ~30 MB quantized, is swept twice per measurement). The paths' sweeps alternate,
so all see the same machine load. No speed assertion (docs/quant.md).

    python -m bench.test_bench_quant --threads 2 --out quant_linear.json
    python -m bench.test_bench_quant --threads 1 --clock cpu   # a shared machine: CPU time
    python -m pytest bench/test_bench_quant.py --benchmark-only   # M in 1 2 4 8 16, one group per
                                                                  # projection and M
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from typing import Any, Callable

import pytest
import torch

from engine.model.checkpoint_names import fused_parts
from engine.model.gguf_reader import gguf_blocks, gguf_config, gguf_metadata, open_gguf
from engine.model.loader import default_model_path
from engine.model.quant import GGUFBlocks, quantized_linear
from engine.model.quant_tiled import TiledWeight, pack_tiled, tiled_linear

#: projection -> how many distinct weights a sweep cycles through (head: one, swept twice).
SHAPES = ["qkv_proj", "gate_up_proj", "down_proj", "o_proj", "lm_head"]


def model_blocks() -> tuple[dict[str, list[GGUFBlocks]], Any]:
    """The default GGUF's blocks per projection: one GGUFBlocks per layer (the head: one)."""
    reader = open_gguf(default_model_path())
    config = gguf_config(gguf_metadata(reader), {t.name for t in reader.tensors})
    by_name = dict(gguf_blocks(reader, config))
    out: dict[str, list[GGUFBlocks]] = {}
    for fused, parts in fused_parts().items():
        out[fused] = [GGUFBlocks.concat([by_name[f"model.layers.{i}.{p}.weight"] for p in parts])
                      for i in range(config.num_hidden_layers)]
    out["lm_head"] = [by_name["model.embed_tokens.weight"]]
    return out, config


def dense_weight(shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """A random weight of `shape`, packed for oneDNN as the model packs its weights."""
    w = torch.randn(shape).to(dtype)
    try:
        return torch.ops.mkldnn._reorder_linear_weight(w, 16)
    except (RuntimeError, AttributeError, NotImplementedError):
        return w


@functools.lru_cache(maxsize=None)
def dense_weights(shape: tuple[int, int], count: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """`count` packed random weights of `shape`, made once per process and reused for every M."""
    return [dense_weight(shape, dtype) for _ in range(count)]


_tiled: dict[int, list[TiledWeight]] = {}


def tiled_weights(blocks: list[GGUFBlocks]) -> list[TiledWeight]:
    """The tiled form of each of `blocks`, made once per process (per list)."""
    if id(blocks) not in _tiled:
        _tiled[id(blocks)] = [pack_tiled(b) for b in blocks]
    return _tiled[id(blocks)]


def dense_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    if w.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
    return torch.nn.functional.linear(x, w)


#: `--clock`: wall time, or the calling thread's CPU time (one thread only: it leaves out the time
#: the thread waited for a core on a machine shared with other busy processes).
CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}
_clock = CLOCKS["wall"]


def sweep_seconds(fn: Callable[[int], Any], count: int) -> float:
    """Seconds per call of `fn(i)` for i in 0..count-1 (one sweep)."""
    start = _clock()
    for i in range(count):
        fn(i)
    return (_clock() - start) / count


def sweep_count(blocks: list[GGUFBlocks]) -> int:
    """Calls in one sweep: one per layer's weight; the head's single weight twice."""
    return len(blocks) * (2 if len(blocks) == 1 else 1)


def projection_call(path: str, blocks: list[GGUFBlocks], m: int,
                    dtype: torch.dtype) -> tuple[Callable[[int], Any], int]:
    """(fn, weight bytes): `fn(i)` multiplies `m` random rows by weight i (cycling over the
    layers) on `path` ("tiled": the tiled blocks, bfloat16 only; "quant": the GGUF blocks in the
    file's layout; "dense": packed weights of the same shape)."""
    rows, cols = blocks[0].shape
    x = torch.randn(m, cols).to(dtype)
    if path == "tiled":
        tiles = tiled_weights(blocks)
        return (lambda i: tiled_linear(x, tiles[i % len(tiles)])), tiles[0].packed.numel()
    if path == "quant":
        return (lambda i: quantized_linear(x, blocks[i % len(blocks)])), blocks[0].data.numel()
    dense = dense_weights((rows, cols), len(blocks), dtype)
    return (lambda i: dense_linear(x, dense[i % len(dense)])), rows * cols * dtype.itemsize


def measure(name: str, blocks: list[GGUFBlocks], m: int, dtype: torch.dtype,
            repeat: int) -> dict[str, Any]:
    """One row of the table: every path at `m` rows for projection `name`: per path the median
    and the fastest sweep (us per call), and at the median the weights' GB/s and GFLOP/s."""
    rows, cols = blocks[0].shape
    count = sweep_count(blocks)
    paths = [p for p in PATHS if p != "tiled" or dtype == torch.bfloat16]
    calls = {p: projection_call(p, blocks, m, dtype) for p in paths}
    runs: dict[str, list[float]] = {p: [] for p in paths}
    for fn, _ in calls.values():
        sweep_seconds(fn, count)  # warm-up
    for _ in range(repeat):
        for p, (fn, _) in calls.items():
            runs[p].append(sweep_seconds(fn, count))
    row: dict[str, Any] = {"projection": name, "qtype": blocks[0].qtype, "rows": rows,
                           "cols": cols, "M": m}
    for p, (_, nbytes) in calls.items():
        t = statistics.median(runs[p])
        row.update({f"{p}_us": t * 1e6, f"{p}_us_min": min(runs[p]) * 1e6,
                    f"{p}_GBps": nbytes / t / 1e9, f"{p}_GFLOPps": 2 * m * rows * cols / t / 1e9})
    row["dense_over_quant"] = row["dense_us"] / row["quant_us"]
    if "tiled" in calls:
        row["dense_over_tiled"] = row["dense_us"] / row["tiled_us"]
    return row


#: The paths measured, in the order their sweeps alternate.
PATHS = ("tiled", "quant", "dense")


def run(ms: list[int], threads: int, dtype: torch.dtype, repeat: int) -> list[dict[str, Any]]:
    """Every (projection, M) row, printed as a markdown table while measured."""
    blocks, _ = model_blocks()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    print(f"\nthreads {threads}, activations {str(dtype).replace('torch.', '')}, median of "
          f"{repeat} sweeps (us per call; GB/s of each path's weight bytes)")
    print("| projection | N x K | M | tiled us | tiled GFLOP/s | tiled GB/s | blocks us | "
          "dense us | dense GFLOP/s | dense GB/s | dense/tiled | dense/blocks |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    try:
        for name in SHAPES:
            for m in ms:
                r = measure(name, blocks[name], m, dtype, repeat)
                rows.append(r)
                print(f"| {name} ({r['qtype']}) | {r['rows']} x {r['cols']} | {m} | "
                      f"{r.get('tiled_us', 0):.1f} | {r.get('tiled_GFLOPps', 0):.0f} | "
                      f"{r.get('tiled_GBps', 0):.1f} | {r['quant_us']:.1f} | "
                      f"{r['dense_us']:.1f} | {r['dense_GFLOPps']:.0f} | {r['dense_GBps']:.1f} | "
                      f"{r.get('dense_over_tiled', 0):.2f} | {r['dense_over_quant']:.2f} |",
                      flush=True)
    finally:
        torch.set_num_threads(before)
    return rows


def per_token_ms(rows: list[dict[str, Any]], layers: int = 30) -> dict[int, dict[str, float]]:
    """Per M: the matmul time of one decode step (30 layers' projections + the head), each
    path, in ms."""
    out: dict[int, dict[str, float]] = {}
    for r in rows:
        k = 1 if r["projection"] == "lm_head" else layers
        t = out.setdefault(r["M"], {})
        for p in PATHS:
            if f"{p}_us" in r:
                t[f"{p}_ms"] = t.get(f"{p}_ms", 0.0) + k * r[f"{p}_us"] / 1e3
    return out


@pytest.fixture(scope="module")
def blocks() -> dict[str, list[GGUFBlocks]]:
    return model_blocks()[0]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("m", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("name", SHAPES)
def test_projection(benchmark, blocks: dict[str, list[GGUFBlocks]], name: str, m: int,
                    path: str) -> None:
    """One sweep of projection `name` over its weights (the 30 layers'; the head's twice) at `m`
    bf16 rows on `path`; `extra_info` holds the microseconds per call and the weights' GB/s."""
    fn, nbytes = projection_call(path, blocks[name], m, torch.bfloat16)
    count = sweep_count(blocks[name])
    benchmark.group = f"{name} M={m}"
    benchmark.pedantic(sweep_seconds, args=(fn, count), rounds=5, warmup_rounds=1, iterations=1)
    benchmark.extra_info.update({"projection": name, "qtype": blocks[name][0].qtype, "M": m,
                                 "path": path, "calls_per_sweep": count})
    if benchmark.enabled:
        per_call = benchmark.stats.stats.median / count
        benchmark.extra_info.update({"us_per_call": per_call * 1e6,
                                     "GBps": nbytes / per_call / 1e9})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--m", type=int, nargs="+", default=[1, 2, 4, 6, 8, 12, 16, 24, 32])
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--clock", default="wall", choices=sorted(CLOCKS))
    p.add_argument("--out", default=None, help="write the rows and per-step totals as JSON")
    args = p.parse_args()
    if args.clock == "cpu" and args.threads != 1:
        p.error(f"--clock cpu: expected --threads 1 (the calling thread's CPU time), got "
                f"--threads {args.threads}")
    global _clock
    _clock = CLOCKS[args.clock]
    dtype = getattr(torch, args.dtype)
    rows = run(args.m, args.threads, dtype, args.repeat)
    steps = per_token_ms(rows)
    print("\n| M | step matmuls tiled ms | blocks ms | dense ms |\n|---|---|---|---|")
    for m, t in steps.items():
        print(f"| {m} | {t.get('tiled_ms', 0):.2f} | {t['quant_ms']:.2f} | {t['dense_ms']:.2f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"threads": args.threads, "dtype": args.dtype, "repeat": args.repeat,
                       "clock": args.clock,
                       "rows": rows, "per_step": {str(m): t for m, t in steps.items()},
                       "time": time.strftime("%Y-%m-%d %H:%M:%S %Z")}, f, indent=1)


if __name__ == "__main__":
    main()
