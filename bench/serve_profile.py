"""Where a step of the engine goes, prefill and decode: matmuls, attention, KV writes, other
model ops, sampling and Python overhead (everything else in `LLMEngine.step`). The columns add up
to the step: matmuls include the LM head (`compute_logits`), "other model ops" are the rest of the
forward and of `compute_logits` (norms, rotary, activations, residual adds, the float cast).

    python -m bench.serve_profile --batch 1 16 --threads 1 2 --dtype bfloat16

Loads the model once, fills `batch` sequences with `--prompt-len` random prompt tokens (the
"prefill" row: those steps, per step, and prompt tokens/s), then times `--steps` decode steps (the
"decode" row) with wall-clock wrappers around the model's matmuls (its `_linear` helper if it has
one, else `F.linear`; the LM head included), the attention plan's `run` and `write_kv` (as every
layer calls them) and the sampler; steps that the native layer loop runs
(engine/model/layer_loop.py) time the same parts with its own clock. The KV pool is made resident
before the prefill, as the server does by default (`--prefault-kv-cache`), so that the prefill row
does not count its pages' first-touch faults. Prints one markdown row per (threads, batch,
quantization, phase). `--quantization none gguf` loads the model once per setting and alternates
them row by row (same machine load; docs/quant.md). `--clock cpu` times with the CPU time of the
calling thread instead of the wall clock, for one thread only: on a machine shared with other busy
processes it leaves out the time the thread waited for a core.
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

import engine.model.decoder as decoder
from engine.model import layer_loop
from engine.config import QUANTIZATION_MODES, EngineConfig
from engine.llm_engine import LLMEngine
from engine.model.loader import load_model
from engine.sampling_params import SamplingParams

TIMES: dict[str, float] = defaultdict(float)
#: The native layer loop's parts, in the order of its timers (engine/csrc/layer_loop.cpp);
#: its "other" (norms, rotary, SiLU) is left in "other model ops".
LOOP_PARTS = ("matmul", "attention", "write_kv", "other")
CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}
clock = time.perf_counter


def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t = clock()
        try:
            return fn(*args, **kwargs)
        finally:
            TIMES[name] += clock() - t
    return wrapper


def install_model_timers(model: Any) -> None:
    """The model's forward and LM head, and, on the first call of the process, the model code's
    matmuls, attention and KV writes: in the Python layers by wrappers, in the native layer loop
    (engine/model/layer_loop.py) by its own clock (`layer_loop.timers`)."""
    if layer_loop.timers is None:
        layer_loop.timers = torch.zeros(len(LOOP_PARTS), dtype=torch.float64)
    model.forward = timed("forward", model.forward)
    model.compute_logits = timed("logits", model.compute_logits)
    if getattr(decoder, "_profiled", False):
        return
    decoder._profiled = True
    if hasattr(decoder, "_linear"):  # the model's own matmul helper (packed weights on CPU)
        decoder._linear = timed("matmul", decoder._linear)
    else:
        decoder.F = _FProxy()  # the model's F.linear goes through the timer
    plan_class = decoder.AttentionPlan
    plan_class.run = timed("attention", plan_class.run)
    plan_class.write_kv = timed("write_kv", plan_class.write_kv)


class _FProxy:
    """torch.nn.functional with `linear` timed."""

    linear = staticmethod(timed("matmul", F.linear))

    def __getattr__(self, name: str) -> Any:
        return getattr(F, name)


def add_prompts(engine: LLMEngine, batch: int, prompt_len: int, max_tokens: int) -> None:
    """`batch` greedy requests of `prompt_len` random token ids (seeded), each generating
    `max_tokens` tokens whatever it samples."""
    rng = random.Random(0)
    for i in range(batch):
        engine.add_request(str(i), [rng.randrange(256, 32000) for _ in range(prompt_len)],
                           SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                          temperature=0.0))


def prefill(engine: LLMEngine) -> int:
    """Steps `engine` until every request is decoding (one token left to compute each);
    returns the steps taken."""
    steps = 0
    while engine.scheduler.waiting or any(s.num_uncomputed_tokens > 1
                                          for g in engine.scheduler.running for s in g.seqs):
        engine.step()
        steps += 1
    return steps


def decoding_engine(loaded: Any, batch: int, prompt_len: int = 256, max_tokens: int = 900,
                    max_model_len: int = 1024, kv_cache_dtype: str = "auto",
                    prefault_kv_cache: bool = False) -> LLMEngine:
    """An engine on `loaded` (KV cache of `kv_cache_dtype`, made resident first with
    `prefault_kv_cache`, as the server does) whose `batch` requests (`add_prompts`) are
    prefilled and decoding: what the decode-step experiments under bench/results start from.
    Without the prefault, a step whose sequences enter new blocks pays their pages'
    first-touch faults (every `block_size` steps when the prompts have one length)."""
    engine = LLMEngine(loaded, config=EngineConfig(max_model_len=max_model_len,
                                                   kv_cache_dtype=kv_cache_dtype,
                                                   prefault_kv_cache=prefault_kv_cache))
    add_prompts(engine, batch, prompt_len, max_tokens)
    prefill(engine)
    return engine


def profile(loaded: Any, batch: int, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """{"prefill": ..., "decode": ...}: each phase's breakdown per step and its tokens/s."""
    engine = LLMEngine(loaded, config=EngineConfig(max_model_len=args.prompt_len + 64 +
                                                   args.steps + 8, backend=args.backend,
                                                   prefault_kv_cache=True))
    engine.sampler.sample = timed("sampling", engine.sampler.sample)
    add_prompts(engine, batch, args.prompt_len, args.steps + 16)
    clear_times()
    t = clock()
    steps = prefill(engine)
    prefill_row = _breakdown(clock() - t, steps, batch * args.prompt_len)
    for _ in range(3):
        engine.step()  # warm up the decode path
    clear_times()
    t = clock()
    for _ in range(args.steps):
        engine.step()
    return {"prefill": prefill_row,
            "decode": _breakdown(clock() - t, args.steps, batch * args.steps)}


def clear_times() -> None:
    """Zeroes TIMES and the layer loop's timers (the start of a phase)."""
    TIMES.clear()
    if layer_loop.timers is not None:
        layer_loop.timers.zero_()


def _breakdown(seconds: float, steps: int, tokens: int) -> dict[str, float]:
    """Per-step milliseconds of each part from TIMES and the layer loop's timers, and
    tokens/s over `seconds`."""
    total = seconds / steps * 1000
    times = defaultdict(float, TIMES)
    if layer_loop.timers is not None:
        for part, s in zip(LOOP_PARTS[:3], layer_loop.timers.tolist()):
            times[part] += s
    ms = defaultdict(float, {k: v / steps * 1000 for k, v in times.items()})
    model_ms = ms["forward"] + ms["logits"]  # the LM head's matmul is in "matmul" too
    other_model = model_ms - ms["matmul"] - ms["attention"] - ms["write_kv"]
    return {"steps": steps, "step_ms": total, "matmul_ms": ms["matmul"],
            "attention_ms": ms["attention"], "write_kv_ms": ms["write_kv"],
            "other_model_ops_ms": other_model, "sampling_ms": ms["sampling"],
            "python_overhead_ms": total - model_ms - ms["sampling"],
            "tok_s": tokens / seconds}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    p.add_argument("--threads", type=int, nargs="+", default=[torch.get_num_threads()])
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32", "float16"))
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--backend", default="auto")
    p.add_argument("--quantization", nargs="+", default=["auto"], choices=QUANTIZATION_MODES)
    p.add_argument("--clock", default="wall", choices=sorted(CLOCKS),
                   help="cpu: the calling thread's CPU time (one thread only)")
    p.add_argument("--out", default=None, help="also write the rows as JSON to this path")
    args = p.parse_args()
    if args.clock == "cpu" and args.threads != [1]:
        p.error(f"--clock cpu: expected --threads 1 (other threads' time is not counted), "
                f"got --threads {' '.join(map(str, args.threads))}")
    global clock
    clock = CLOCKS[args.clock]
    models = {}
    for q in args.quantization:
        models[q] = load_model(None, dtype=getattr(torch, args.dtype), quantization=q)
        install_model_timers(models[q].model)
    cols = ["step_ms", "matmul_ms", "attention_ms", "write_kv_ms", "other_model_ops_ms",
            "sampling_ms", "python_overhead_ms", "tok_s"]
    print("| threads | batch | quantization | phase | steps | " + " | ".join(cols) + " |")
    print("|" + "---|" * (len(cols) + 5))
    rows = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        for batch in args.batch:
            for loaded in models.values():
                for phase, row in profile(loaded, batch, args).items():
                    rows.append({"threads": threads, "batch": batch,
                                 "quantization": loaded.quantization, "phase": phase, **row})
                    print(f"| {threads} | {batch} | {loaded.quantization} | {phase} | "
                          f"{row['steps']} | " + " | ".join(f"{row[c]:.1f}" for c in cols)
                          + " |", flush=True)
    if args.out:
        report = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                  "load_average": os.getloadavg(), "dtype": args.dtype,
                  "prompt_len": args.prompt_len, "steps": args.steps, "backend": args.backend,
                  "clock": args.clock,
                  "rows": rows}
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
