"""`python -m bench.tune_decode`: the launch choices of the GPU backends, timed side by side.

A lent GPU comes for minutes, so the choices that decide decode (and prefill) speed are timed in
one command: each *variant* is a backend plus settings, measured by CUDA-graph replay at the
headline decode shapes (head size 128, 32 query heads over 8 KV heads, bf16, block size 16) and,
with the prefill variants, at causal prefill shapes, next to torch SDPA on the same K/V stored
contiguously. A variant's settings are environment variables (`PAGED_KERNELS_*`, read by the
backends at call time; the CUDA planner's are checked before any timing) or, for triton, the
split heuristic's constants (`triton_impl.decode.PROGRAMS_PER_SM`, `MIN_SPLIT_TOKENS`); each is
set for that variant's runs only. Prints one table; `--out FILE` writes every row as JSON.

    python -m bench.tune_decode                       # the default variants and shapes below
    python -m bench.tune_decode --variants "triton" "triton:PROGRAMS_PER_SM=8" \\
        "cuda:PAGED_KERNELS_CUDA_PARTITION=512" --prefill-shapes   # decode only
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch

from bench import kernels
from bench.ceilings import copy_bandwidth
from cuda.paged_cuda import tune_verdict
from cuda.paged_cuda.settings import check_plan_env

SHAPES = [(1, 16384), (32, 1024), (32, 4096), (32, 16384), (128, 1024), (128, 4096)]
#: The CUDA decode kernel's choices (docs/cuda.md, "Tuning on a GPU"): the default (64-key tiles,
#: 4 warps, ring of 2: 3 blocks per SM at head size 128), 3 stages, and 32-key tiles with 2 warps
#: (6 blocks per SM at 2 stages, 4 at 3, 3 at 4: 1, 2, 3 tiles in flight per block), each warp
#: waiting for its own keys instead of the block for the tile (both tiles), the K/V rows
#: prefetched into L2 an iteration ahead (both tiles), and 32-key tiles with a fixed partition
#: instead of the wave model's.
VARIANTS = ["triton", "cuda", "cuda:PAGED_KERNELS_CUDA_DECODE_STAGES=3",
            "cuda:PAGED_KERNELS_CUDA_DECODE_TILE=32",
            "cuda:PAGED_KERNELS_CUDA_DECODE_TILE=32,PAGED_KERNELS_CUDA_DECODE_STAGES=3",
            "cuda:PAGED_KERNELS_CUDA_DECODE_TILE=32,PAGED_KERNELS_CUDA_DECODE_STAGES=4",
            "cuda:PAGED_KERNELS_CUDA_DECODE_SYNC=warp",
            "cuda:PAGED_KERNELS_CUDA_DECODE_TILE=32,PAGED_KERNELS_CUDA_DECODE_SYNC=warp",
            "cuda:PAGED_KERNELS_CUDA_DECODE_PREFETCH=1",
            "cuda:PAGED_KERNELS_CUDA_DECODE_TILE=32,PAGED_KERNELS_CUDA_DECODE_PREFETCH=1",
            "cuda:PAGED_KERNELS_CUDA_DECODE_TILE=32,PAGED_KERNELS_CUDA_PARTITION=1024"]
#: Causal prefill (batch, context, query tokens per sequence): one long prompt, and a batch of
#: chunks on a cached prefix.
PREFILL_SHAPES = [(1, 4096, 4096), (8, 8192, 512)]
#: The CUDA varlen kernel with its default 4 warps (64 query rows per block) and with 8 warps
#: (128 rows).
PREFILL_VARIANTS = ["triton", "cuda", "cuda:PAGED_KERNELS_CUDA_VARLEN_WARPS=8"]
TRITON_CONSTANTS = ("PROGRAMS_PER_SM", "MIN_SPLIT_TOKENS")


def parse_variant(text: str) -> tuple[str, dict[str, str]]:
    """`"backend[:NAME=VALUE,...]"` -> (backend, settings)."""
    backend, _, rest = text.partition(":")
    settings = {}
    for item in filter(None, rest.split(",")):
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise ValueError(f"variant: expected backend[:NAME=VALUE,...], got {text!r}")
        if not (name.startswith("PAGED_KERNELS_") or name in TRITON_CONSTANTS):
            raise ValueError(f"variant {text!r}: {name!r} is neither a PAGED_KERNELS_* "
                             f"environment variable nor one of {TRITON_CONSTANTS}")
        settings[name] = value
    check_plan_env(settings)
    return backend, settings


def parse_shape(text: str) -> kernels.Shape:
    """`"BATCHxCONTEXT"` -> a decode shape; `"BATCHxCONTEXTxQUERIES"` -> a causal prefill of
    QUERIES tokens per sequence (the last ones of its CONTEXT)."""
    try:
        sizes = [int(n) for n in text.lower().split("x")]
    except ValueError:
        sizes = []
    if len(sizes) not in (2, 3) or min(sizes) < 1 or (len(sizes) == 3 and sizes[2] > sizes[1]):
        raise ValueError(f"shape: expected BATCHxCONTEXT or BATCHxCONTEXTxQUERIES (QUERIES <= "
                         f"CONTEXT, all positive), got {text!r}")
    if len(sizes) == 2:
        return kernels.Shape("decode", sizes[0], sizes[1])
    return kernels.Shape("prefill", sizes[0], sizes[1], sizes[2])


@contextlib.contextmanager
def applied(settings: dict[str, str]) -> Iterator[None]:
    """Sets `settings` (environment variables and triton heuristic constants) and restores the
    previous values on exit."""
    from triton_impl import decode  # only needed, and importable, where triton is

    saved_env = {k: os.environ.get(k) for k in settings if k.startswith("PAGED_KERNELS_")}
    saved_const = {k: getattr(decode, k) for k in settings if k in TRITON_CONSTANTS}
    try:
        for k, v in settings.items():
            if k in TRITON_CONSTANTS:
                setattr(decode, k, int(v))
            else:
                os.environ[k] = v
        yield
    finally:
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        for k, v in saved_const.items():
            setattr(decode, k, v)


def measure_variant(text: str, shape: kernels.Shape, copy_gbps: float, repeat: int) -> dict:
    """One variant at one shape: graph-replay time, GB/s, fraction of the copy bandwidth and
    TFLOP/s."""
    backend, settings = parse_variant(text)
    row = {"variant": text, "kind": shape.kind, "batch": shape.batch, "context": shape.context,
           "q_len": shape.q_len}
    try:
        with applied(settings):
            prepared = kernels.prepare(backend, shape, torch.bfloat16, "cuda")
            seconds = kernels.graph_seconds(prepared, repeat)
            err = prepared.check() if prepared.check is not None else None
    except Exception as exc:  # noqa: BLE001 - a variant that fails is reported, not fatal
        torch.cuda.synchronize()
        return {**row, "error": f"{type(exc).__name__}: {exc}"[:300]}
    gbps = prepared.bytes_moved / seconds / 1e9
    return {**row, "us": seconds * 1e6, "GB/s": gbps, "frac_copy": gbps / copy_gbps,
            "TFLOP/s": prepared.flops / seconds / 1e12, "rel_err_vs_sdpa": err}


def run(variants: Sequence[str], shapes: Sequence[kernels.Shape], repeat: int,
        on_row: Callable[[dict], None] | None = None) -> list[dict]:
    """Every variant (and SDPA) at every shape; adds `x_sdpa`, the time over SDPA's. Each row is
    printed, and passed to `on_row` as soon as it is timed."""
    copy_gbps = copy_bandwidth("cuda")["copy_GBps"]
    rows = []
    for shape in shapes:
        base = measure_variant(kernels.SDPA, shape, copy_gbps, repeat)
        for text in [kernels.SDPA, *variants]:
            row = base if text == kernels.SDPA else measure_variant(text, shape, copy_gbps, repeat)
            if "us" in row and "us" in base:
                row["x_sdpa"] = row["us"] / base["us"]
            rows.append(row)
            print(format_row(row), flush=True)
            if on_row is not None:
                on_row(row)
    return rows


def format_row(r: dict) -> str:
    name = r["variant"].replace("PAGED_KERNELS_CUDA_", "")  # the JSON keeps the full name
    where = f"{name:<44} {r['batch']:>5} {r['context']:>6} {r['q_len']:>5}"
    if "error" in r:
        return f"{where}  error: {r['error'][:80]}"
    err = r.get("rel_err_vs_sdpa")
    return (f"{where} {r['us']:>9.1f} {r['frac_copy']:>6.1%} {r['TFLOP/s']:>7.1f} "
            f"{r.get('x_sdpa', 1.0):>6.2f} {'-' if err is None else format(err, '.1e'):>8}")


def cuda_summary(rows: Sequence[dict]) -> list[str]:
    """One line per shape: the fastest `cuda` variant and its time over the default's (`cuda`),
    so a run answers "which default?" at a glance."""
    lines = []
    shapes = dict.fromkeys((r["kind"], r["batch"], r["context"], r["q_len"]) for r in rows)
    for kind, batch, context, q_len in shapes:
        here = [r for r in rows if (r["kind"], r["batch"], r["context"], r["q_len"]) ==
                (kind, batch, context, q_len) and "us" in r]
        default = next((r for r in here if r["variant"] == "cuda"), None)
        timed = [r for r in here if r["variant"].startswith("cuda")]
        if default is None or not timed:
            continue
        best = min(timed, key=lambda r: r["us"])
        where = f"{kind} {batch}x{context}" + (f"x{q_len}" if kind != "decode" else "")
        lines.append(f"{where}: fastest {best['variant']} {best['us']:.1f} us = "
                     f"{best['us'] / default['us']:.3f} x cuda's {default['us']:.1f} us")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.tune_decode", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", nargs="+", default=VARIANTS,
                        help="variants timed at the decode shapes")
    parser.add_argument("--shapes", nargs="*", default=[f"{b}x{c}" for b, c in SHAPES],
                        help="decode shapes as BATCHxCONTEXT (default: %(default)s)")
    parser.add_argument("--prefill-variants", nargs="+", default=PREFILL_VARIANTS,
                        help="variants timed at the prefill shapes")
    parser.add_argument("--prefill-shapes", nargs="*",
                        default=[f"{b}x{c}x{q}" for b, c, q in PREFILL_SHAPES],
                        help="causal prefill shapes as BATCHxCONTEXTxQUERIES (default: "
                             "%(default)s; none: decode only)")
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--out", type=Path, default=None, help="JSON file for every row")
    args = parser.parse_args(argv)
    parsed = {}
    for flag, items, parse in [("--variants", args.variants, parse_variant),
                               ("--prefill-variants", args.prefill_variants, parse_variant),
                               ("--shapes", args.shapes, parse_shape),
                               ("--prefill-shapes", args.prefill_shapes, parse_shape)]:
        try:  # fail before any timing
            parsed[flag] = [parse(text) for text in items]
        except ValueError as exc:
            parser.error(f"{flag}: {exc}")
    decode, prefill = parsed["--shapes"], parsed["--prefill-shapes"]
    if any(s.kind != "decode" for s in decode):
        parser.error(f"--shapes: expected BATCHxCONTEXT items, got {args.shapes}")
    if any(s.kind != "prefill" for s in prefill):
        parser.error(f"--prefill-shapes: expected BATCHxCONTEXTxQUERIES items, got "
                     f"{args.prefill_shapes}")
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device (launch choices only matter on a GPU)")
    print(f"{'variant':<44} {'batch':>5} {'ctx':>6} {'q':>5} {'graph us':>9} {'%copy':>6} "
          f"{'TFLOP/s':>7} {'xSDPA':>6} {'err':>8}", flush=True)
    done: list[dict] = []

    def keep(row: dict) -> None:  # rewritten per row: a run cut short keeps what it timed
        done.append(row)
        if args.out is not None:
            args.out.write_text(json.dumps(done, indent=1))

    rows = run(args.variants, decode, args.repeat, keep) + run(args.prefill_variants, prefill,
                                                               args.repeat, keep)
    decided = tune_verdict.verdict(rows)
    print("\n".join(["", "fastest cuda variant per shape:", *cuda_summary(rows), "",
                     *decided["why"], *decided["alarms"],
                     *tune_verdict.summary_lines(decided)]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
