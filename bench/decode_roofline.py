"""The engine's decode step against this machine's limits, measured in one run: each part of the
step (`bench.serve_profile`'s columns) with the work it did, the rate it reached and that rate as
a share of the machine's ceiling (`bench.ceilings`, measured first in the same process).

    python -m bench.decode_roofline --batch 1 16 --quantization auto gguf-int8 --out roofline.json

Work per decode step, counted while the step runs:
- matmuls (the model's `_linear`, the LM head included, and the projections of every layer of a
  step that the native layer loop runs): 2 * rows * out * in flops, and the bytes
  of the operand each call reads (`QuantizedWeight.operand`: int8 tiles, GGUF blocks or the dense
  weight; a plain tensor's own bytes);
- attention (`AttentionPlan.run`, or every layer of a step that the native layer loop runs,
  engine/model/layer_loop.py): the K and V bytes of every visible position of every sequence,
  per layer (`[num_blocks, num_kv_heads, block_size, head_size]` caches, a sliding
  window's positions only).

Ceilings: the read bandwidth of a `--read-mib` MiB buffer in huge pages (`bench.ceilings.
read_bandwidth`; larger than the last-level cache, so it is the memory's; measured before and
after the steps and the higher taken, as a VM's memory speed drifts), the copy bandwidth of a
`--copy-mib` MiB copy (read + written bytes, for reference), and the rate of a bfloat16 (or
`--dtype`) matmul of `--matmul-n` (oneDNN), of an int8 one (oneDNN's VNNI path), and the int8
block rate (`bench.ceilings.int8_block_rate`: the instructions an int8 product with a scale per
block of 32 inputs issues; the peak of `gguf-int8`, whose matmuls multiply int8 activations by
the file's blocks; the plain int8 rate where the CPU has no AVX-512 VNNI). The weights and the
K/V are only read,
so a part's floor is its bytes at the read bandwidth (and, for matmuls, its flops at the matmul
rate of its mode, whichever is longer); the step's floor adds the matmul and attention floors.
Counting adds about a microsecond per matmul and attention call to "other model ops".
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
from typing import Any, Callable, Optional

import torch

import bench.serve_profile as serve_profile
import engine.model.decoder as decoder
from bench.ceilings import (copy_bandwidth, int8_block_rate, int8_matmul_rate, matmul_rate,
                            read_bandwidth)
from engine.config import QUANTIZATION_MODES
from engine.model.layer_loop import LayerLoop
from engine.model.loader import load_model
from engine.model.quant import QuantizedWeight

#: serve_profile's accumulator: the counters below live next to its timers, so that they are
#: cleared with them (before the prefill and before the timed decode steps).
WORK = serve_profile.TIMES
PARTS = ("matmul", "attention", "write_kv", "other_model_ops", "sampling", "python_overhead")


def weight_bytes(weight: Any, rows: int) -> int:
    """Bytes that `_linear` reads from `weight` for `rows` activation rows."""
    operand = weight.operand(rows) if isinstance(weight, QuantizedWeight) else weight
    return operand.numel() * operand.element_size()


def context_tokens(plan: Any) -> int:
    """Positions each layer's attention reads under `plan`: every sequence's length, capped at
    the plan's sliding window."""
    seq_lens = plan.seq_lens
    if plan.sliding_window is not None:
        seq_lens = seq_lens.clamp(max=plan.sliding_window)
    return int(seq_lens.sum())


def count_matmul(weight: Any, rows: int) -> None:
    """Adds one matmul's work to WORK: `rows` activation rows times `weight`."""
    out_features, in_features = weight.shape
    WORK["matmul_flop"] += 2.0 * rows * out_features * in_features
    WORK["matmul_bytes"] += weight_bytes(weight, rows)


def kv_bytes_per_position(key_cache: torch.Tensor, value_cache: torch.Tensor) -> int:
    """The K and V bytes of one position in one layer's caches (all its KV heads)."""
    return sum(c.shape[1] * c.shape[3] * c.element_size() for c in (key_cache, value_cache))


def counting_linear(linear: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def wrapper(x: torch.Tensor, weight: Any, bias: Optional[torch.Tensor] = None
                ) -> torch.Tensor:
        count_matmul(weight, x.shape[0])
        return linear(x, weight, bias)
    return wrapper


def counting_run(run: Callable[..., Any]) -> Callable[..., Any]:
    tokens: dict[int, tuple[Any, int]] = {}  # id(plan) -> (plan, its context tokens)

    def wrapper(plan: Any, query: torch.Tensor, key_cache: torch.Tensor,
                value_cache: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        known = tokens.get(id(plan))
        if known is None or known[0] is not plan:
            if len(tokens) > 8:
                tokens.clear()
            known = tokens[id(plan)] = (plan, context_tokens(plan))
        WORK["kv_bytes"] += float(known[1] * kv_bytes_per_position(key_cache, value_cache))
        return run(plan, query, key_cache, value_cache, *args, **kwargs)
    return wrapper


def counting_loop(run: Callable[..., Any]) -> Callable[..., Any]:
    """`LayerLoop.run` counting what its layers did when it ran the step: the work that
    `counting_linear` and `counting_run` count for the same calls in the Python layers."""
    def wrapper(loop: LayerLoop, hidden: torch.Tensor, rotary: Any, kv_caches: list[Any],
                plans: Any, *args: Any) -> Optional[torch.Tensor]:
        out = run(loop, hidden, rotary, kv_caches, plans, *args)
        if out is not None:
            for weight in (w for layer in loop.weights for w in layer):
                count_matmul(weight, hidden.shape[0])
            per_layer = context_tokens(plans[None]) * kv_bytes_per_position(*kv_caches[0])
            WORK["kv_bytes"] += float(per_layer * len(kv_caches))
        return out
    return wrapper


def install_counters() -> None:
    """Counts every matmul's and attention call's work (after serve_profile's timers, whose
    wrappers these call), in the Python layers and in the native layer loop."""
    decoder._linear = counting_linear(decoder._linear)
    plan_class = decoder.AttentionPlan
    plan_class.run = counting_run(plan_class.run)
    LayerLoop.run = counting_loop(LayerLoop.run)


def roofline(row: dict[str, float], work: dict[str, float], ceilings: dict[str, Any],
             int8: bool = False) -> dict[str, float]:
    """Per decode step (`row`: serve_profile's breakdown; `work`: the counters over its steps):
    the work, rates, shares of the ceilings and floors; `int8`: the matmuls multiply int8
    activations (their peak is the int8 block rate where measured, else the int8 matmul rate)."""
    steps = row["steps"]
    bandwidth = ceilings["read_GBps"] * 1e9
    peak_name, peak_key = "matmul", "matmul_TFLOPs"
    if int8 and "int8_block_TOPs" in ceilings:
        peak_name, peak_key = "int8 block mix", "int8_block_TOPs"
    elif int8:
        peak_name, peak_key = "int8 matmul", "int8_matmul_TOPs"
    peak = ceilings[peak_key] * 1e12
    flop = work["matmul_flop"] / steps
    mm_bytes, kv_bytes = work["matmul_bytes"] / steps, work["kv_bytes"] / steps
    mm_s, at_s = row["matmul_ms"] / 1e3, row["attention_ms"] / 1e3
    mm_floor = max(flop / peak, mm_bytes / bandwidth)
    at_floor = kv_bytes / bandwidth
    return {
        "matmul_GFLOP": flop / 1e9, "matmul_MB": mm_bytes / 1e6,
        "matmul_GFLOPs": flop / mm_s / 1e9, "matmul_GBps": mm_bytes / mm_s / 1e9,
        "matmul_of_peak": flop / mm_s / peak, "matmul_peak": peak_name,
        "matmul_of_bandwidth": mm_bytes / mm_s / bandwidth,
        "matmul_floor_ms": mm_floor * 1e3,
        "attention_MB": kv_bytes / 1e6, "attention_GBps": kv_bytes / at_s / 1e9,
        "attention_of_bandwidth": kv_bytes / at_s / bandwidth,
        "attention_floor_ms": at_floor * 1e3,
        "step_floor_ms": (mm_floor + at_floor) * 1e3,
        "step_of_floor": (mm_floor + at_floor) * 1e3 / row["step_ms"],
    }


def table(rows: list[dict[str, Any]], ceilings: dict[str, Any]) -> str:
    """Markdown: one block of lines per (batch, quantization)."""
    block = (f" (with block scales {ceilings['int8_block_TOPs'] * 1e3:.0f})"
             if "int8_block_TOPs" in ceilings else "")
    lines = [f"Ceilings: read {ceilings['read_GBps']:.1f} GB/s ("
             f"{ceilings['read_bytes'] / 2**20:.0f} MiB in huge pages; "
             f"{ceilings['read_GBps_start']:.1f} before the steps, "
             f"{ceilings['read_GBps_end']:.1f} after), copy "
             f"{ceilings['copy_GBps']:.1f} GB/s (read + written, "
             f"{ceilings['copy_bytes'] / 2**21:.0f} MiB), int8 matmul "
             f"{ceilings['int8_matmul_TOPs'] * 1e3:.0f} GOP/s{block}, "
             f"{ceilings['matmul_dtype']} matmul "
             f"{ceilings['matmul_TFLOPs'] * 1e3:.0f} GFLOP/s (n = {ceilings['matmul_n']}).", "",
             "| batch | quantization | part | ms / step | share | work / step | rate | "
             "of ceiling | floor ms |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        head = f"| {r['batch']} | {r['quantization']} "
        lines.append(head + f"| matmul | {r['matmul_ms']:.1f} "
                     f"| {r['matmul_ms'] / r['step_ms']:.0%} "
                     f"| {r['matmul_GFLOP']:.2f} GFLOP, {r['matmul_MB']:.1f} MB "
                     f"| {r['matmul_GFLOPs']:.0f} GFLOP/s, {r['matmul_GBps']:.1f} GB/s "
                     f"| {r['matmul_of_peak']:.0%} of {r['matmul_peak']}, "
                     f"{r['matmul_of_bandwidth']:.0%} of read | {r['matmul_floor_ms']:.1f} |")
        lines.append(head + f"| attention | {r['attention_ms']:.1f} "
                     f"| {r['attention_ms'] / r['step_ms']:.0%} | {r['attention_MB']:.1f} MB K/V "
                     f"| {r['attention_GBps']:.1f} GB/s | {r['attention_of_bandwidth']:.0%} of "
                     f"read | {r['attention_floor_ms']:.1f} |")
        for part in PARTS[2:]:
            ms = r[f"{part}_ms"]
            lines.append(head + f"| {part.replace('_', ' ')} | {ms:.1f} | "
                         f"{ms / r['step_ms']:.0%} | | | | |")
        lines.append(head + f"| **step** | {r['step_ms']:.1f} | 100% | "
                     f"{r['matmul_MB'] + r['attention_MB']:.1f} MB | | floor is "
                     f"{r['step_of_floor']:.0%} of the step | {r['step_floor_ms']:.1f} |")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--backend", default="auto")
    p.add_argument("--quantization", nargs="+", default=["auto"], choices=QUANTIZATION_MODES)
    p.add_argument("--copy-mib", type=int, default=512)
    p.add_argument("--read-mib", type=int, default=256)
    p.add_argument("--matmul-n", type=int, default=2048)
    p.add_argument("--out", default=None, help="also write the rows as JSON to this path")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    ceilings = {**read_bandwidth(args.read_mib << 20),
                **copy_bandwidth("cpu", args.copy_mib << 20),
                **matmul_rate("cpu", dtype, args.matmul_n), **int8_matmul_rate(args.matmul_n),
                **int8_block_rate(args.threads)}
    models = {q: load_model(None, dtype=dtype, quantization=q) for q in args.quantization}
    for loaded in models.values():
        serve_profile.install_model_timers(loaded.model)
    install_counters()
    settings = argparse.Namespace(prompt_len=args.prompt_len, steps=args.steps,
                                  backend=args.backend)
    measured = []
    for batch in args.batch:
        for loaded in models.values():
            decode = serve_profile.profile(loaded, batch, settings)["decode"]
            measured.append((batch, loaded.quantization, decode, dict(WORK)))
    end = read_bandwidth(args.read_mib << 20)["read_GBps"]
    ceilings.update(read_GBps_start=ceilings["read_GBps"], read_GBps_end=end,
                    read_GBps=max(ceilings["read_GBps"], end))  # the faster phase: lower floors
    rows = [{"batch": batch, "quantization": mode, **decode,
             **roofline(decode, work, ceilings, int8=mode == "gguf-int8")}
            for batch, mode, decode, work in measured]
    print(table(rows, ceilings))
    if args.out:
        report = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                  "load_average": os.getloadavg(), "threads": args.threads,
                  "dtype": args.dtype, "prompt_len": args.prompt_len, "steps": args.steps,
                  "backend": args.backend, "ceilings": ceilings, "rows": rows}
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
