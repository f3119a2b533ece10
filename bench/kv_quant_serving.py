"""Serving at a fixed KV budget that binds: the running batch and throughput of an 8-bit KV cache
against the bfloat16 one.

The real engine (bfloat16 weights, the default model) serves one ShareGPT-like trace (the vLLM
paper's lengths / 4, Poisson arrivals fast enough that requests queue: the engine is saturated)
through `bench.paper.engine_run.run_trace` (the engine's own clock: each step's wall time), once
per cache dtype, every run with the same KV budget in bytes: `--slots` tokens of a bfloat16
cache, so an 8-bit cache holds twice the tokens. Prefix caching is off (the prompts are random
ids). Per run: KV slots, mean running requests over steps, output tokens per second, mean
normalized latency (seconds per output token of a request, arrival to finish), preemptions.

    python -m bench.kv_quant_serving --out bench/results/$(date +%F)-kv-quant-engine

Scales: each engine calibrates on its warm-up request (engine/kv_scales.py); the speed does not
depend on them. Runs on `--threads` threads.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
from typing import Any

import torch

from engine.kv_cache import bytes_per_block

from bench.paper import engine_run
from bench.paper.traces import make_trace, trace_summary

CACHE_DTYPES = ("auto", "fp8_e4m3", "int8")


def budget_bytes(loaded: Any, slots: int, block_size: int) -> int:
    """The bytes of `slots` tokens of a bfloat16 cache of `loaded`'s shape."""
    c = loaded.config
    per_block = bytes_per_block(c.num_hidden_layers, c.num_key_value_heads, c.head_dim,
                                block_size, torch.bfloat16)
    return slots // block_size * per_block


def serve(loaded: Any, name: str, budget: int, trace: list, args: argparse.Namespace
          ) -> dict[str, Any]:
    """One run of `trace` on an engine with cache dtype `name` and `budget` bytes of KV."""
    llm = engine_run.make_engine(loaded, kv_cache_dtype=name, kv_cache_memory_bytes=budget,
                                 block_size=args.block_size, max_model_len=args.max_model_len,
                                 enable_prefix_caching=False, backend=args.backend)
    eng = llm.llm_engine
    before = eng.scheduler.num_preemptions
    record, _ = engine_run.run_trace(llm, trace)
    summary = record.summary(args.block_size)
    tokens = sum(r.output_len for r in trace)
    return {"kv_cache_dtype": name, "cache_dtype": str(eng.kv_cache.dtype),
            "kv_slots": eng.kv_cache_manager.num_blocks * args.block_size,
            "mean_running": summary["mean_running"],
            "max_running": max(s.num_running for s in record.steps),
            "output_tokens_per_s": tokens / summary["duration_s"],
            "duration_s": summary["duration_s"],
            "normalized_latency_mean_s": summary["normalized_latency_mean"],
            "preemptions": eng.scheduler.num_preemptions - before,
            "unfinished": summary["unfinished"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cache-dtypes", nargs="+", default=list(CACHE_DTYPES))
    p.add_argument("--slots", type=int, default=1024, help="the KV budget, in bfloat16 tokens")
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--rate", type=float, default=20.0, help="requests per second")
    p.add_argument("--scale", type=float, default=4.0, help="trace lengths divided by this")
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--backend", default="auto")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="a folder for kv_quant_serving.json")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    loaded = engine_run.load("bfloat16")
    trace = make_trace("sharegpt", args.rate, args.requests, args.seed, args.scale,
                       args.max_model_len, loaded.config.vocab_size)
    budget = budget_bytes(loaded, args.slots, args.block_size)
    rows = []
    print(f"KV budget {budget} bytes ({args.slots} bfloat16 tokens); trace "
          f"{trace_summary(trace)}")
    print("| cache | KV slots | mean running | max running | output tok/s | "
          "mean s / output token | preemptions |")
    print("|---|---|---|---|---|---|---|")
    for name in args.cache_dtypes:
        row = serve(loaded, name, budget, trace, args)
        rows.append(row)
        print(f"| {row['cache_dtype']} | {row['kv_slots']} | {row['mean_running']:.2f} | "
              f"{row['max_running']} | {row['output_tokens_per_s']:.1f} | "
              f"{row['normalized_latency_mean_s']:.3f} | {row['preemptions']} |", flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "kv_quant_serving.json"), "w") as f:
            json.dump({"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                       "args": vars(args), "budget_bytes": budget,
                       "trace": trace_summary(trace), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
