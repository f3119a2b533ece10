"""Offline engine throughput on this machine, next to Hugging Face transformers' `generate`.

For each batch size (default 16 and 64) the same random prompts (`--prompt-len` tokens each) are
continued by `--max-tokens` greedy tokens (EOS ignored, so both sides do the same work), first by
the engine (`engine.LLM.generate`), then by transformers' `generate` on one padded-free batch of
the same prompts, in the same dtype. Reported per batch: output tokens/s of each, their ratio, the
peak number of KV blocks in use, and the share of allocated KV slots that hold real tokens
(averaged over steps: the PagedAttention paper's measure of memory waste, internal
fragmentation included), and the steps' split: steps with a prompt chunk (prefill, possibly
mixed with decodes) and pure decode steps, with their time. `--profile` prints a cProfile of a
few engine decode steps.

    python -m bench.bench_engine --help
    python -m bench.bench_engine --batch-sizes 16 64 --dtype float32
    python -m bench.bench_engine --batch-sizes 16 --dtype bfloat16 --threads 2 --repeats 3

`--repeats N` runs N engine / transformers pairs on fresh prompts and reports each and the median
ratio (on a shared machine the load drifts during a run).

The report is written as JSON to `--out`, by default into the measurement's folder
bench/results/<date>-engine/ (bench/README.md: a folder's README gives the command, the machine,
the commit and the numbers).
"""

from __future__ import annotations

import argparse
import cProfile
import datetime as dt
import json
import os
import platform
import pstats
import random
import statistics
import time
from typing import Any

import torch

from engine.config import QUANTIZATION_MODES

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.bench_engine",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[16, 64],
                   help="numbers of concurrent prompts (default: 16 64)")
    p.add_argument("--prompt-len", type=int, default=256, help="tokens per prompt (256)")
    p.add_argument("--max-tokens", type=int, default=128, help="generated tokens (128)")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="float32")
    p.add_argument("--backend", default="auto", help="paged_kernels backend (auto)")
    p.add_argument("--quantization", default="auto", choices=QUANTIZATION_MODES,
                   help="engine weight/activation quantization (docs/quant.md; auto)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--model", default=None, help=".gguf path or HF dir (default model)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--skip-hf", action="store_true", help="do not run transformers")
    p.add_argument("--profile", action="store_true", help="profile engine decode steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1,
                   help="engine / transformers pairs on fresh prompts; the median ratio is "
                        "reported (steadier on a shared machine)")
    p.add_argument("--out", default=None,
                   help="JSON path (default: bench/results/<date>-engine/...)")
    return p.parse_args(argv)


def make_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(count)]


def kv_slot_use(engine: Any) -> tuple[int, int]:
    """(slots holding computed tokens, slots allocated) over the distinct device blocks in use."""
    bm = engine.kv_cache_manager
    filled: dict[int, int] = {}
    bs = bm.block_size
    for group in engine.scheduler.running:
        for seq in group.unfinished_seqs():
            if not bm.is_resident(seq.seq_id):
                continue
            for i, block in enumerate(bm.block_table(seq.seq_id)):
                n = min(bs, max(0, seq.num_computed_tokens - i * bs))
                filled[block] = max(filled.get(block, 0), n)
    return sum(filled.values()), bm.num_used_blocks * bs


def run_engine(llm: Any, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    from engine import SamplingParams

    engine = llm.llm_engine
    engine.kv_cache_manager.peak_used_blocks = engine.kv_cache_manager.num_used_blocks
    shares: list[float] = []
    phases = {"prefill": [0, 0.0], "decode": [0, 0.0]}  # steps, seconds
    step = engine.step
    schedule = engine.scheduler.schedule
    last: dict[str, Any] = {}

    def noted_schedule():
        out = schedule()
        last["prefill"] = any(n > 1 for _, n in out.scheduled)
        return out

    def measured_step():
        start = time.perf_counter()
        outputs = step()
        phase = phases["prefill" if last.get("prefill") else "decode"]
        phase[0] += 1
        phase[1] += time.perf_counter() - start
        used, allocated = kv_slot_use(engine)
        if allocated:
            shares.append(used / allocated)
        return outputs

    engine.step = measured_step
    engine.scheduler.schedule = noted_schedule
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    try:
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        elapsed = time.perf_counter() - start
    finally:
        del engine.step
        del engine.scheduler.schedule
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"seconds": elapsed, "output_tokens": generated,
            "output_tokens_per_s": generated / elapsed,
            "peak_kv_blocks_in_use": engine.kv_cache_manager.peak_used_blocks,
            "kv_blocks_total": engine.kv_cache_manager.num_blocks,
            "kv_slot_share_holding_tokens": sum(shares) / len(shares) if shares else None,
            "num_preemptions": engine.scheduler.num_preemptions,
            # steps with a prompt chunk (prefill, maybe mixed with decodes) vs pure decode steps
            "steps": {name: {"count": n, "seconds": sec,
                             "ms_per_step": sec / n * 1e3 if n else None}
                      for name, (n, sec) in phases.items()},
            "tokens": [o.outputs[0].token_ids for o in outs]}


def load_hf(model_path: str, dtype: torch.dtype) -> Any:
    import transformers

    if os.path.isdir(model_path):
        return transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).eval()
    return transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(model_path), gguf_file=os.path.basename(model_path), dtype=dtype).eval()


def run_hf(hf: Any, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    ids = torch.tensor(prompts)
    with torch.no_grad():
        start = time.perf_counter()
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                          min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
        elapsed = time.perf_counter() - start
    generated = (out.shape[1] - ids.shape[1]) * ids.shape[0]
    return {"seconds": elapsed, "output_tokens": generated,
            "output_tokens_per_s": generated / elapsed,
            "tokens": out[:, ids.shape[1]:].tolist()}


def profile_decode(llm: Any, prompts: list[list[int]], steps: int = 5) -> None:
    from engine import SamplingParams

    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"profile-{i}", p, params)
    while any(s.num_uncomputed_tokens > 1 for g in engine.scheduler.groups()
              for s in g.unfinished_seqs()) or engine.scheduler.waiting:
        engine.step()
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.runcall(lambda: [engine.step() for _ in range(steps)])
    per_step = (time.perf_counter() - start) / steps
    print(f"\nprofile: {per_step * 1e3:.1f} ms per decode step of {len(prompts)} sequences")
    pstats.Stats(profiler).sort_stats("tottime").print_stats(18)
    for i in range(len(prompts)):
        engine.abort_request(f"profile-{i}")


def compare(llm: Any, hf: Any, n: int, args: argparse.Namespace, vocab: int,
            repeat: int) -> dict[str, Any]:
    """One engine run and (unless skipped) one transformers run on the same fresh prompts (a new
    set per repeat, so the engine never hits its prefix cache)."""
    prompts = make_prompts(n, args.prompt_len, vocab, args.seed + n + 1000 * repeat)
    ours = run_engine(llm, prompts, args.max_tokens)
    result: dict[str, Any] = {"engine": ours}
    if hf is not None:
        theirs = run_hf(hf, prompts, args.max_tokens)
        result["transformers"] = theirs
        result["speedup"] = ours["output_tokens_per_s"] / theirs["output_tokens_per_s"]
        same = sum(a == b for a, b in zip(ours["tokens"], theirs["tokens"]))
        result["identical_continuations"] = f"{same}/{n}"
        theirs.pop("tokens")
    ours.pop("tokens")
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from engine import LLM
    from engine.model.loader import default_model_path, load_model

    dtype = _DTYPES[args.dtype]
    loaded = load_model(args.model, dtype=dtype, quantization=args.quantization)
    hf = None if args.skip_hf else load_hf(args.model or default_model_path(), dtype)
    report: dict[str, Any] = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(), "load_average": os.getloadavg(),
        "model": loaded.name, "dtype": args.dtype, "backend": args.backend,
        "quantization": loaded.quantization,
        "prompt_len": args.prompt_len, "max_tokens": args.max_tokens, "runs": []}
    for n in args.batch_sizes:
        per_seq = -(-(args.prompt_len + args.max_tokens) // args.block_size)
        llm = LLM(model=loaded, dtype=dtype, block_size=args.block_size,
                  num_kv_blocks=n * per_seq + 8, max_num_seqs=n,
                  max_num_batched_tokens=args.max_num_batched_tokens, backend=args.backend)
        # Warm-up on other prompts (so the timed run gets no prefix-cache hits): the first call
        # loads the attention backend, which may compile its kernels once per machine.
        warm = make_prompts(2, 8, loaded.config.vocab_size, args.seed + 20_000 + n)
        run_engine(llm, warm, 2)
        if hf is not None:
            run_hf(hf, warm, 2)
        if args.profile:  # on other prompts, so that the timed run gets no prefix-cache hits
            profile_decode(llm, make_prompts(n, args.prompt_len, loaded.config.vocab_size,
                                             args.seed + 10_000 + n))
        pairs = [compare(llm, hf, n, args, loaded.config.vocab_size, r)
                 for r in range(args.repeats)]
        run: dict[str, Any] = {"batch_size": n, **pairs[0]}
        if args.repeats > 1:
            run["repeats"] = pairs
            if hf is not None:
                run["speedup_median"] = statistics.median(p["speedup"] for p in pairs)
        report["runs"].append(run)
        print(json.dumps(run, indent=1), flush=True)
    now = dt.datetime.now()
    out = args.out or os.path.join(
        RESULTS_DIR, f"{now:%Y-%m-%d}-engine", f"engine_{args.dtype}_{now:%Y%m%d_%H%M%S}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {out}")
    return report


if __name__ == "__main__":
    main()
