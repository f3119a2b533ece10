"""`python -m bench.soak --duration S --out DIR`: exit status 0 when every server passes."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from dataclasses import asdict
from typing import Any, Optional, Sequence

from bench.soak import report
from bench.soak.judge import judge
from bench.soak.run import SoakConfig, soak_server
from bench.soak.server import SoakServer, log_tail
from bench.soak.workload import MAX_MODEL_LEN, MIN_KV_BLOCKS

MODES = ("recompute", "swap")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__)
    p.add_argument("--duration", type=float, required=True,
                   help="seconds of load with faults (after start-up and the clean run)")
    p.add_argument("--out", required=True, help="folder for report.md, soak.json, logs")
    p.add_argument("--modes", default=",".join(MODES),
                   help="preemption modes, one server each, run side by side (default: both)")
    p.add_argument("--concurrency", type=int, default=4, help="clients per server")
    p.add_argument("--num-kv-blocks", type=int, default=MIN_KV_BLOCKS,
                   help=f"KV pool of each server, blocks of 16 tokens (at least {MIN_KV_BLOCKS}, "
                        f"the largest soak request; default {MIN_KV_BLOCKS})")
    p.add_argument("--fault-interval", type=float, default=10.0,
                   help="mean seconds between injected faults, per server")
    p.add_argument("--request-timeout", type=float, default=60.0,
                   help="seconds a request may take before it counts as hung")
    p.add_argument("--num-references", type=int, default=8,
                   help="greedy prompts of the clean run")
    p.add_argument("--warmup", type=float, default=None,
                   help="seconds of load before the RSS baseline (default: 20%% of the "
                        "duration: a fresh server's RSS grows for minutes, faults or not, "
                        "more slowly as the run goes on)")
    p.add_argument("--rss-growth-mib", type=float, default=64.0,
                   help="most RSS growth after the warm-up, MiB")
    p.add_argument("--integrity-interval", type=float, default=5.0,
                   help="seconds between /debug/check_integrity calls")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--startup-timeout", type=float, default=300.0)
    return p


def parse(argv: Optional[Sequence[str]]) -> tuple[argparse.Namespace, SoakConfig, list[str]]:
    parser = build_parser()
    args = parser.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    if not modes or any(m not in MODES for m in modes):
        parser.error(f"--modes: expected a comma-separated subset of {','.join(MODES)}, got "
                     f"{args.modes!r}")
    warmup = args.warmup if args.warmup is not None else 0.2 * args.duration
    try:
        cfg = SoakConfig(args.duration, args.concurrency, args.num_kv_blocks,
                         args.fault_interval, args.request_timeout, args.num_references, warmup,
                         args.rss_growth_mib, args.integrity_interval, args.seed)
    except ValueError as exc:
        parser.error("--" + str(exc).replace("_", "-"))
    return args, cfg, modes


async def _soak_all(servers: list[SoakServer], cfg: SoakConfig,
                    startup_timeout: float) -> list[dict[str, Any]]:
    return list(await asyncio.gather(*(_soak_one(s, cfg, cfg.seed + i, startup_timeout)
                                       for i, s in enumerate(servers))))


async def _soak_one(server: SoakServer, cfg: SoakConfig, seed: int,
                    startup_timeout: float) -> dict[str, Any]:
    """One server's record; a soak that could not run to its end is recorded as aborted."""
    try:
        startup = await server.start(startup_timeout)
        record = await soak_server(server, cfg, seed)
    except Exception as exc:  # noqa: BLE001 - the report says what stopped it
        return {"mode": server.mode, "aborted": f"{type(exc).__name__}: {exc}"}
    record["startup_s"] = round(startup, 1)
    return record


def main(argv: Optional[Sequence[str]] = None) -> int:
    args, cfg, modes = parse(argv)
    os.makedirs(args.out, exist_ok=True)
    servers = [SoakServer(mode, cfg.num_kv_blocks, MAX_MODEL_LEN,
                          os.path.join(args.out, f"server-{mode}.log")) for mode in modes]
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    where = report.machine()  # the commit the servers start from, not the one at the end
    t0 = time.monotonic()
    try:
        records = asyncio.run(_soak_all(servers, cfg, args.startup_timeout))
    finally:
        exit_codes = [s.stop() for s in servers]
    summaries = [judge(r, cfg.rss_growth_mib, cfg.warmup) for r in records]
    for summary, code, server in zip(summaries, exit_codes, servers):
        summary["exit_code"] = code
        summary["log_tail"] = log_tail(server.log_path)
    summary = {"passed": all(s["passed"] for s in summaries),
               "command": "python -m bench.soak " + " ".join(sys.argv[1:] if argv is None
                                                              else argv),
               "date": started, "wall_s": round(time.monotonic() - t0, 1),
               "config": asdict(cfg), "machine": where, "servers": summaries}
    report.write(args.out, summary, records)
    print(report.render(summary))
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
