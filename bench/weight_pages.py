"""The default model's packed weights in huge pages (as loaded, one `WeightArena`) against the
same bytes in buffers of their own (`torch.empty`, 4 KiB pages), timed in alternating rounds in
one process, two ways:

- matmuls (default): every quantized projection of every layer and the LM head once per sweep,
  called from Python in module order, on `rows` token rows of random activations;
- `--steps`: whole engine decode steps (the native layer loop where it applies, sampling, the
  engine's Python) of `rows` sequences after 256-token prompts, two engines on two loads of
  the model (KV pools resident from the start, as in the server), `--steps` steps per engine
  and round.

    python -m bench.weight_pages [--rows 1 16] [--modes gguf gguf-int8 float32] [--rounds 31]
    python -m bench.weight_pages --steps 4 --rows 1 16 --modes gguf gguf-int8

Prints, per mode and row count, the median time (a sweep, or a step) of each placement, the
weight bytes per second, and the median over rounds of the per-round ratio (huge pages / own
buffers).
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
    """The model's quantized projections in module order: the LM head (an attribute of the
    model itself), then each layer's."""
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


def move_to_own_buffers(model: torch.nn.Module) -> None:
    """Replaces every QuantizedWeight of `model` by `own_buffers` of it (before an engine is
    built on the model, so that its layer loop reads those)."""
    for module in model.modules():
        for name, weight in list(vars(module).items()):
            if isinstance(weight, QuantizedWeight):
                setattr(module, name, own_buffers(weight))
    model.weights_changed()


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


def matmul_runs(mode: str, rows: int) -> tuple[dict[str, Callable[[], float]], int]:
    """Per placement, a function that runs one sweep and returns its seconds; the bytes read."""
    dtype, quantization = MODES[mode]
    arena = step_weights(load_model(dtype=dtype, quantization=quantization).model)
    gen = torch.Generator().manual_seed(0)
    inputs = {cols: torch.randn(rows, cols, generator=gen).to(dtype)
              for cols in {w.shape[1] for w in arena}}
    own = [own_buffers(w) for w in arena]
    return ({"huge_pages": lambda: sweep(arena, inputs), "own_buffers": lambda: sweep(own, inputs)},
            sum(w.operand(1).numel() for w in arena))  # the blocks, as blocks_linear reads


def step_runs(mode: str, rows: int, steps: int) -> tuple[dict[str, Callable[[], float]], int]:
    """Per placement, a function that runs `steps` decode steps of an engine of `rows`
    sequences and returns the seconds per step; the bytes of weights a step reads."""
    from bench.serve_profile import decoding_engine

    dtype, quantization = MODES[mode]
    runs, nbytes = {}, 0
    for name in ("huge_pages", "own_buffers"):
        loaded = load_model(dtype=dtype, quantization=quantization)
        if name == "own_buffers":
            move_to_own_buffers(loaded.model)
        nbytes = sum(w.operand(1).numel() for w in step_weights(loaded.model))
        engine = decoding_engine(loaded, rows, max_tokens=2000, max_model_len=2304,
                                 prefault_kv_cache=True)

        def run(engine: Any = engine) -> float:
            start = time.perf_counter()
            for _ in range(steps):
                engine.step()
            return (time.perf_counter() - start) / steps
        runs[name] = run
    return runs, nbytes


def measure(mode: str, rows: int, rounds: int, steps: int = 0) -> dict[str, Any]:
    """One mode and row count: both placements, `rounds` alternating rounds of one matmul sweep
    (`steps` 0) or of `steps` decode steps."""
    runs, nbytes = step_runs(mode, rows, steps) if steps else matmul_runs(mode, rows)
    times: dict[str, list[float]] = {name: [] for name in runs}
    for run in runs.values():
        run()  # warm-up: code, caches
    for r in range(rounds):
        for name in (list(runs) if r % 2 == 0 else list(runs)[::-1]):
            times[name].append(runs[name]())
    row: dict[str, Any] = {"mode": mode, "rows": rows, "steps": steps, "weight_bytes": nbytes}
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
    parser.add_argument("--steps", type=int, default=0,
                        help="time decode steps, this many per engine and round (0: matmuls)")
    parser.add_argument("--json", help="also write the rows as JSON to this path")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    results = []
    unit = "step" if args.steps else "sweep"
    out(f"| mode | rows | MB | huge pages ms / {unit} (GB/s) | own buffers ms / {unit} (GB/s) "
        "| huge / own |")
    out("|---|---|---|---|---|---|")
    for mode in args.modes:
        for rows in args.rows:
            r = measure(mode, rows, args.rounds, args.steps)
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
