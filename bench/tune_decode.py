"""`python -m bench.tune_decode`: the decode launch choices of the GPU backends, timed side by side.

A lent GPU comes for minutes, so the choices that decide decode speed are timed in one command:
each *variant* is a backend plus settings, measured at the headline decode shapes (head size 128,
32 query heads over 8 KV heads, bf16, block size 16) by CUDA-graph replay, next to torch SDPA on
the same K/V stored contiguously. A variant's settings are environment variables
(`PAGED_KERNELS_*`, read by the backends at call time) or, for triton, the split heuristic's
constants (`triton_impl.decode.PROGRAMS_PER_SM`, `MIN_SPLIT_TOKENS`); each is set for that
variant's runs only. Prints one table; `--out FILE` writes every row as JSON.

    python -m bench.tune_decode                       # the default variants below
    python -m bench.tune_decode --variants "triton" "triton:PROGRAMS_PER_SM=8" \\
        "cuda:PAGED_KERNELS_CUDA_PARTITION=512"
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Iterator, Optional, Sequence

import torch

from bench import kernels
from bench.ceilings import copy_bandwidth

SHAPES = [(1, 16384), (32, 1024), (32, 4096), (32, 16384), (128, 4096)]
VARIANTS = ["triton", "triton:PROGRAMS_PER_SM=8", "triton:PROGRAMS_PER_SM=4",
            "triton:PAGED_KERNELS_TRITON_SPLIT_SIZE=1024",
            "cuda", "cuda:PAGED_KERNELS_CUDA_DECODE_STAGES=3"]
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
    return backend, settings


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
    """One variant at one shape: graph-replay time, GB/s and fraction of the copy bandwidth."""
    backend, settings = parse_variant(text)
    row = {"variant": text, "batch": shape.batch, "context": shape.context}
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
            "rel_err_vs_sdpa": err}


def run(variants: Sequence[str], shapes: Sequence[tuple[int, int]], repeat: int) -> list[dict]:
    """Every variant (and SDPA) at every shape; adds `x_sdpa`, the time over SDPA's."""
    copy_gbps = copy_bandwidth("cuda")["copy_GBps"]
    rows = []
    for batch, context in shapes:
        shape = kernels.Shape("decode", batch, context)
        base = measure_variant(kernels.SDPA, shape, copy_gbps, repeat)
        for text in [kernels.SDPA, *variants]:
            row = base if text == kernels.SDPA else measure_variant(text, shape, copy_gbps, repeat)
            if "us" in row and "us" in base:
                row["x_sdpa"] = row["us"] / base["us"]
            rows.append(row)
            print(format_row(row), flush=True)
    return rows


def format_row(r: dict) -> str:
    if "error" in r:
        return f"{r['variant']:<44} {r['batch']:>5} {r['context']:>6}  error: {r['error'][:80]}"
    err = r.get("rel_err_vs_sdpa")
    return (f"{r['variant']:<44} {r['batch']:>5} {r['context']:>6} {r['us']:>9.1f} "
            f"{r['frac_copy']:>6.1%} {r.get('x_sdpa', 1.0):>6.2f} "
            f"{'-' if err is None else format(err, '.1e'):>8}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.tune_decode", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", nargs="+", default=VARIANTS)
    parser.add_argument("--shapes", nargs="+", default=[f"{b}x{c}" for b, c in SHAPES],
                        help="decode shapes as BATCHxCONTEXT (default: %(default)s)")
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--out", type=Path, default=None, help="JSON file for every row")
    args = parser.parse_args(argv)
    for text in args.variants:
        parse_variant(text)  # fail before any timing
    try:
        shapes = [tuple(int(n) for n in text.lower().split("x")) for text in args.shapes]
    except ValueError:
        parser.error(f"--shapes: expected BATCHxCONTEXT items, got {args.shapes}")
    if any(len(s) != 2 or min(s) < 1 for s in shapes):
        parser.error(f"--shapes: expected BATCHxCONTEXT with positive sizes, got {args.shapes}")
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device (decode launch choices only matter on a GPU)")
    print(f"{'variant':<44} {'batch':>5} {'ctx':>6} {'graph us':>9} {'%copy':>6} "
          f"{'xSDPA':>6} {'err':>8}", flush=True)
    rows = run(args.variants, shapes, args.repeat)
    if args.out is not None:
        args.out.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
