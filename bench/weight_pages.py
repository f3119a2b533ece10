"""A decode step's matmuls on the default model's packed weights in huge pages (as loaded, one
`WeightArena`) against the same bytes in buffers of their own (`torch.empty`, 4 KiB pages), timed
in alternating rounds in one process.

For each quantization mode, every quantized projection of every layer and the LM head run once
per sweep, in the order a decode step runs them, on `rows` token rows of random activations:

    python -m bench.weight_pages [--rows 1 16] [--modes gguf gguf-int8 float32] [--rounds 31]

Prints, per mode and row count, the median sweep time of each placement, its weight bytes per
second, and the median over rounds of the per-round time ratio (huge pages / own buffers).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace
from typing import Any, Callable, Optional

import torch

from engine.model.loader import load_model
from engine.model.quant import QuantizedWeight, quantized_linear
from engine.model.quant_int8 import int8_linear
from engine.model.quant_tiled import tiled_linear

#: name -> (dtype, quantization) of `load_model`.
MODES = {"gguf": (torch.bfloat16, "gguf"), "gguf-int8": (torch.bfloat16, "gguf-int8"),
         "float32": (torch.float32, "gguf")}


def step_weights(model: torch.nn.Module) -> list[QuantizedWeight]:
    """The model's quantized projections in module order (layer by layer, then the head)."""
    found = []
    for module in model.modules():
        found += [w for w in vars(module).values() if isinstance(w, QuantizedWeight)]
    return found


def own_buffers(weight: QuantizedWeight) -> QuantizedWeight:
    """`weight` with the bytes every matmul reads copied into a `torch.empty` buffer of their
    own (64-byte aligned by torch's CPU allocator)."""
    copy = QuantizedWeight(weight.blocks, weight.dense, weight.max_rows, weight.int8)
    if weight.int8 is not None:
        copy.int8 = replace(weight.int8, packed=weight.int8.packed.clone())
    elif weight.tiled:
        copy.blocks = replace(weight.blocks, packed=weight.blocks.packed.clone())
    else:
        copy.blocks = replace(weight.blocks, data=weight.blocks.data.clone())
    return copy


def read_bytes(weight: QuantizedWeight) -> int:
    """Bytes of the form the blocks' matmul reads."""
    if weight.int8 is not None:
        return weight.int8.packed.numel()
    return weight.blocks.packed.numel() if weight.tiled else weight.blocks.data.numel()


def blocks_linear(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """`x @ W.T` by the kernel that reads `weight`'s blocks (at any row count)."""
    if weight.int8 is not None:
        return int8_linear(x, weight.int8)
    return tiled_linear(x, weight.blocks) if weight.tiled else quantized_linear(x, weight.blocks)


def sweep(weights: list[QuantizedWeight], inputs: dict[int, torch.Tensor]) -> float:
    """Seconds to multiply the input rows by every weight once, in order."""
    start = time.perf_counter()
    for weight in weights:
        blocks_linear(inputs[weight.shape[1]], weight)
    return time.perf_counter() - start


def measure(mode: str, rows: int, rounds: int) -> dict[str, Any]:
    """One mode and row count: both placements, `rounds` alternating rounds."""
    dtype, quantization = MODES[mode]
    model = load_model(dtype=dtype, quantization=quantization).model
    arena = step_weights(model)
    placements: dict[str, list[QuantizedWeight]] = {
        "huge_pages": arena, "own_buffers": [own_buffers(w) for w in arena]}
    gen = torch.Generator().manual_seed(0)
    inputs = {cols: torch.randn(rows, cols, generator=gen).to(dtype)
              for cols in {w.shape[1] for w in arena}}
    times: dict[str, list[float]] = {name: [] for name in placements}
    for weights in placements.values():
        sweep(weights, inputs)  # warm-up: code, caches
    for r in range(rounds):
        for name in (list(placements) if r % 2 == 0 else list(placements)[::-1]):
            times[name].append(sweep(placements[name], inputs))
    nbytes = sum(read_bytes(w) for w in arena)
    row: dict[str, Any] = {"mode": mode, "rows": rows, "weight_bytes": nbytes}
    for name, seconds in times.items():
        median = statistics.median(seconds)
        row[name] = {"median_ms": median * 1e3, "min_ms": min(seconds) * 1e3,
                     "GBps": nbytes / median / 1e9}
    row["ratio_median"] = statistics.median(
        h / o for h, o in zip(times["huge_pages"], times["own_buffers"]))
    return row


def main(argv: Optional[list[str]] = None, out: Callable[[str], Any] = print) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--modes", nargs="+", choices=sorted(MODES), default=list(MODES))
    parser.add_argument("--rounds", type=int, default=31)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", help="also write the rows as JSON to this path")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    results = []
    out("| mode | rows | MB | huge pages ms (GB/s) | own buffers ms (GB/s) | huge / own |")
    out("|---|---|---|---|---|---|")
    for mode in args.modes:
        for rows in args.rows:
            r = measure(mode, rows, args.rounds)
            results.append(r)
            h, o = r["huge_pages"], r["own_buffers"]
            out(f"| {mode} | {rows} | {r['weight_bytes'] / 1e6:.1f} | {h['median_ms']:.2f} "
                f"({h['GBps']:.1f}) | {o['median_ms']:.2f} ({o['GBps']:.1f}) | "
                f"{r['ratio_median']:.3f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": args.threads, "rounds": args.rounds, "rows": results}, f,
                      indent=1)


if __name__ == "__main__":
    main()
