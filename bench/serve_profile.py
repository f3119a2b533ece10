"""Where a decode step of the engine goes: matmuls, attention, KV writes, other model ops,
sampling and Python overhead (everything else in `LLMEngine.step`). The columns add up to the
step: matmuls include the LM head (`compute_logits`), "other model ops" are the rest of the
forward and of `compute_logits` (norms, rotary, activations, residual adds, the float cast).

    python -m bench.serve_profile --batch 1 16 --threads 1 2 --dtype bfloat16

Loads the model once, fills `batch` sequences with `--prompt-len` random prompt tokens (prefill
not timed), then times `--steps` decode steps with wall-clock wrappers around the model's matmuls
(its `_linear` helper if it has one, else `F.linear`; the LM head included), the attention
plan's `run` and `write_kv` (as every layer calls them) and the sampler. Prints one markdown row per
(threads, batch, quantization). `--quantization none gguf` loads the model once per setting and
alternates them row by row (same machine load; docs/quant.md).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import random
import time
from collections import defaultdict
from typing import Any, Callable

import torch
import torch.nn.functional as F

import engine.model.llama as llama
from engine.config import QUANTIZATION_MODES, EngineConfig
from engine.llm_engine import LLMEngine
from engine.model.loader import load_model
from engine.sampling_params import SamplingParams

TIMES: dict[str, float] = defaultdict(float)


def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            TIMES[name] += time.perf_counter() - t
    return wrapper


def install_model_timers(model: Any) -> None:
    """The model's forward and LM head, and, on the first call of the process, the model code's
    matmuls, attention and KV writes."""
    model.forward = timed("forward", model.forward)
    model.compute_logits = timed("logits", model.compute_logits)
    if getattr(llama, "_profiled", False):
        return
    llama._profiled = True
    if hasattr(llama, "_linear"):  # the model's own matmul helper (packed weights on CPU)
        llama._linear = timed("matmul", llama._linear)
    else:
        llama.F = _FProxy()  # the model's F.linear goes through the timer
    plan_class = llama.AttentionPlan
    plan_class.run = timed("attention", plan_class.run)
    plan_class.write_kv = timed("write_kv", plan_class.write_kv)


class _FProxy:
    """torch.nn.functional with `linear` timed."""

    linear = staticmethod(timed("matmul", F.linear))

    def __getattr__(self, name: str) -> Any:
        return getattr(F, name)


def profile(loaded: Any, batch: int, args: argparse.Namespace) -> dict[str, float]:
    engine = LLMEngine(loaded, config=EngineConfig(max_model_len=args.prompt_len + 64 +
                                                   args.steps + 8, backend=args.backend))
    rng = random.Random(0)
    for i in range(batch):
        engine.add_request(str(i), [rng.randrange(256, 32000) for _ in range(args.prompt_len)],
                           SamplingParams(max_tokens=args.steps + 16, ignore_eos=True,
                                          temperature=0.0))
    while engine.scheduler.waiting or any(s.num_uncomputed_tokens > 1
                                          for g in engine.scheduler.running for s in g.seqs):
        engine.step()
    for _ in range(3):
        engine.step()  # warm up the decode path
    engine.sampler.sample = timed("sampling", engine.sampler.sample)
    TIMES.clear()
    t = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    total = (time.perf_counter() - t) / args.steps * 1000
    ms = defaultdict(float, {k: v / args.steps * 1000 for k, v in TIMES.items()})
    model_ms = ms["forward"] + ms["logits"]  # the LM head's matmul is in "matmul" too
    other_model = model_ms - ms["matmul"] - ms["attention"] - ms["write_kv"]
    return {"step_ms": total, "matmul_ms": ms["matmul"], "attention_ms": ms["attention"],
            "write_kv_ms": ms["write_kv"], "other_model_ops_ms": other_model,
            "sampling_ms": ms["sampling"],
            "python_overhead_ms": total - model_ms - ms["sampling"],
            "tok_s": batch / total * 1000}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    p.add_argument("--threads", type=int, nargs="+", default=[torch.get_num_threads()])
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32", "float16"))
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--backend", default="auto")
    p.add_argument("--quantization", nargs="+", default=["auto"], choices=QUANTIZATION_MODES)
    p.add_argument("--out", default=None, help="also write the rows as JSON to this path")
    args = p.parse_args()
    models = {}
    for q in args.quantization:
        models[q] = load_model(None, dtype=getattr(torch, args.dtype), quantization=q)
        install_model_timers(models[q].model)
    cols = ["step_ms", "matmul_ms", "attention_ms", "write_kv_ms", "other_model_ops_ms",
            "sampling_ms", "python_overhead_ms", "tok_s"]
    print("| threads | batch | quantization | " + " | ".join(cols) + " |")
    print("|" + "---|" * (len(cols) + 3))
    rows = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        for batch in args.batch:
            for q, loaded in models.items():
                row = profile(loaded, batch, args)
                rows.append({"threads": threads, "batch": batch,
                             "quantization": loaded.quantization, **row})
                print(f"| {threads} | {batch} | {loaded.quantization} | "
                      + " | ".join(f"{row[c]:.1f}" for c in cols) + " |", flush=True)
    if args.out:
        report = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                  "load_average": os.getloadavg(), "dtype": args.dtype,
                  "prompt_len": args.prompt_len, "steps": args.steps, "backend": args.backend,
                  "rows": rows}
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
