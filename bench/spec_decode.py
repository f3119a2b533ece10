"""Speculative decoding on the engine: time per output token at concurrency 1, throughput at 16.

Two workloads of chat prompts on the default model (or `--model`), greedy, EOS ignored so that
every setting decodes the same number of tokens:

- `copy`: the answer repeats the prompt (rewrite this code with one change, repeat a paragraph
  and add a sentence), where n-gram lookup has something to copy;
- `fresh`: open-ended answers (a poem, a story, a list) with little to copy.

Settings: no speculation; "ngram" with k = 3, 4, 5; "draft_model" with `draft_layers` L (the
target's first L layers, k = 3); "draft_model" with `--draft-model` (default: the target's own
file, an upper bound on acceptance: every proposal is the target's own greedy token; k = 3).
At concurrency 1 each prompt runs alone: time per output token (TPOT, from the first output
token to the last, over the tokens after the first), the speed-up against no speculation, and
whether the greedy output equals it token for token. Per setting the engine's counters give the
acceptance rate (accepted / proposed tokens) and the mean accepted length per verification step
(accepted + 1: the target's own token). At concurrency `--batch` (16) all prompts of both
workloads run at once: output tokens per second with and without speculation.

The baseline runs first and last (its two runs show the machine's drift during the run); with
`--paired` it also runs right before each setting, which is then compared with that run.

`--interleave ROUNDS` runs the interleaved comparison instead (bench/spec_interleaved.py):
plain twice (the A/A noise) and ngram for each `--ngram-k`, every setting on the same prompts
in one process, on the copy, fresh and fresh-sampled workloads, with bootstrap intervals.

    python -m bench.spec_decode --out bench/results/$(date +%F)-spec-decode/result.json
    python -m bench.spec_decode --interleave 5 --ngram-k 3 5 --max-tokens 64
    python -m bench.spec_decode --quick   # two prompts, 32 tokens: a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time
from typing import Any, Optional

import torch

from engine import LLM, SamplingParams
from engine.model.loader import LoadedModel, load_model

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

CODE = '''def mean_and_spread(values):
    total = 0.0
    count = 0
    for value in values:
        total += value
        count += 1
    if count == 0:
        return 0.0, 0.0
    mean = total / count
    spread = 0.0
    for value in values:
        spread += (value - mean) ** 2
    return mean, (spread / count) ** 0.5
'''

PARAGRAPH = ("The paged KV cache stores the keys and values of every token in fixed-size "
             "blocks. A block table maps each sequence's logical blocks to physical ones, so "
             "memory is allocated as tokens arrive and sequences that share a prefix share "
             "its blocks. When memory runs out, the scheduler preempts the latest request and "
             "either recomputes it later or swaps its blocks to the host.")

COPY_PROMPTS = [
    "Rewrite this Python function with one change: rename the variable `total` to "
    f"`running_sum`. Output only the code.\n\n```python\n{CODE}```",
    f"Repeat the following paragraph word for word, then add one sentence:\n\n{PARAGRAPH}",
    "Add a docstring to this Python function and output the whole function.\n\n"
    f"```python\n{CODE}```",
    f"Quote this paragraph exactly and then summarise it in one line:\n\n{PARAGRAPH}",
]

FRESH_PROMPTS = [
    "Write a short poem about the sea at night.",
    "Tell me a story about a robot who learns to paint.",
    "List five ideas for a child's birthday party, with one sentence each.",
    "Explain why the sky is blue to a ten-year-old.",
]


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.spec_decode",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help=".gguf path or HF dir (default model)")
    p.add_argument("--draft-model", default=None,
                   help="draft model path for 'draft_model' (default: the target's own file)")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="float32")
    p.add_argument("--max-tokens", type=int, default=128, help="output tokens per prompt (128)")
    p.add_argument("--ngram-k", type=int, nargs="*", default=[3, 4, 5])
    p.add_argument("--draft-layers", type=int, nargs="*", default=[2, 4, 8, 15])
    p.add_argument("--draft-k", type=int, default=3, help="k of the draft-model settings (3)")
    p.add_argument("--batch", type=int, default=16, help="concurrency of the throughput run")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1)")
    p.add_argument("--no-draft-model", action="store_true", help="skip the draft_model setting")
    p.add_argument("--paired", action="store_true",
                   help="run the baseline again right before each setting and compare with "
                        "that run (steadier on a shared machine; twice the time)")
    p.add_argument("--quick", action="store_true", help="two prompts per workload, 32 tokens")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 (default): greedy, outputs compared; > 0: seeded sampling, whose "
                        "text repeats itself far less (the back-off's workload)")
    p.add_argument("--interleave", type=int, default=0, metavar="ROUNDS",
                   help="the interleaved comparison instead (bench/spec_interleaved.py): "
                        "ROUNDS rounds of every setting on every prompt in one process")
    p.add_argument("--out", default=None, help="write the report as JSON here")
    return p.parse_args(argv)


def ngram_settings(args: argparse.Namespace) -> list[tuple[str, Optional[dict]]]:
    """(name, speculative_config) of ngram speculation for each `--ngram-k`."""
    return [(f"ngram k={k}", {"method": "ngram", "num_speculative_tokens": k,
                              "prompt_lookup_max": 4, "prompt_lookup_min": 2})
            for k in args.ngram_k]


def settings(args: argparse.Namespace, path: str) -> list[tuple[str, Optional[dict]]]:
    """(name, speculative_config) of every setting, the baseline first."""
    out: list[tuple[str, Optional[dict]]] = [("none", None), *ngram_settings(args)]
    out += [(f"draft_layers L={n} k={args.draft_k}",
             {"method": "draft_model", "draft_layers": n, "num_speculative_tokens": args.draft_k})
            for n in args.draft_layers]
    if args.no_draft_model:
        return out
    draft = args.draft_model or path
    name = "same file" if args.draft_model is None else os.path.basename(draft)
    out.append((f"draft_model ({name}) k={args.draft_k}",
                {"method": "draft_model", "model": draft,
                 "num_speculative_tokens": args.draft_k}))
    return out


def chat_ids(llm: LLM, text: str) -> list[int]:
    tok = llm.get_tokenizer()
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}],
                                              add_generation_prompt=True),
                      add_special_tokens=False)


def run_batch(llm: LLM, prompts: list[list[int]], max_tokens: int,
              temperature: float = 0.0) -> dict[str, Any]:
    """Runs `prompts` together through `llm`'s engine; per request its output ids and the times
    of its first and last output token, plus the whole run's wall time. With `temperature` > 0
    request i samples with seed i (outputs with and without speculation then differ: the
    proposals change how the random stream is drawn)."""
    eng = llm.llm_engine
    ids = [f"p{i}-{time.monotonic_ns()}" for i in range(len(prompts))]
    for i, (rid, p) in enumerate(zip(ids, prompts)):
        eng.add_request(rid, p, SamplingParams(temperature=temperature, max_tokens=max_tokens,
                                               ignore_eos=True,
                                               seed=i if temperature > 0 else None))
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    tokens: dict[str, list[int]] = {}
    start = time.perf_counter()
    while eng.has_unfinished_requests():
        for out in eng.step():
            now = time.perf_counter()
            first.setdefault(out.request_id, now)
            last[out.request_id] = now
            tokens[out.request_id] = list(out.outputs[0].token_ids)
    wall = time.perf_counter() - start
    eng.check_integrity()
    assert eng.kv_cache_manager.num_used_blocks == 0, "blocks left in use after the run"
    return {"wall_s": wall, "tokens": [tokens[r] for r in ids],
            "tpot_s": [(last[r] - first[r]) / max(1, len(tokens[r]) - 1) for r in ids]}


def counters(llm: LLM) -> Optional[dict[str, Any]]:
    spec = llm.llm_engine.speculator
    if spec is None:
        return None
    c = spec.counters()
    return {"num_drafts": c.num_drafts, "num_draft_tokens": c.num_draft_tokens,
            "num_accepted_tokens": c.num_accepted_tokens,
            "accepted_per_pos": list(c.accepted_per_pos),
            "acceptance_rate": c.num_accepted_tokens / max(1, c.num_draft_tokens),
            "mean_accepted_length": 1 + c.num_accepted_tokens / max(1, c.num_drafts)}


def measure(loaded: LoadedModel, spec: Optional[dict], workloads: dict[str, list[list[int]]],
            args: argparse.Namespace) -> dict[str, Any]:
    """One setting: each workload at concurrency 1 (one prompt at a time), with the counters of
    each, then all prompts at concurrency `args.batch`."""
    blocks = -(-(max(len(p) for w in workloads.values() for p in w) + args.max_tokens) // 16)
    result: dict[str, Any] = {}
    for name, prompts in workloads.items():
        llm = LLM(loaded, block_size=16, num_kv_blocks=4 * blocks, speculative_config=spec)
        runs = [run_batch(llm, [p], args.max_tokens, args.temperature) for p in prompts]
        result[name] = {"tpot_s": [r["tpot_s"][0] for r in runs],
                        "tokens": [r["tokens"][0] for r in runs], "counters": counters(llm)}
        del llm
    everything = [p for w in workloads.values() for p in w]
    batch = (everything * -(-args.batch // len(everything)))[:args.batch]
    llm = LLM(loaded, block_size=16, num_kv_blocks=(args.batch + 2) * blocks,
              speculative_config=spec)
    run = run_batch(llm, batch, args.max_tokens, args.temperature)
    result["batch"] = {"size": len(batch), "wall_s": run["wall_s"],
                       "output_tok_s": sum(map(len, run["tokens"])) / run["wall_s"],
                       "tokens": run["tokens"], "counters": counters(llm)}
    return result


def compare(base: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    """Speed-ups against the baseline and whether the greedy outputs are equal."""
    out: dict[str, Any] = {}
    for name in ("copy", "fresh"):
        b, o = base[name], other[name]
        out[name] = {"tpot_ms": 1e3 * statistics.median(o["tpot_s"]),
                     "speedup": statistics.median(bt / ot for bt, ot in zip(b["tpot_s"],
                                                                            o["tpot_s"])),
                     "identical": o["tokens"] == b["tokens"], "counters": o["counters"]}
    out["batch"] = {"output_tok_s": other["batch"]["output_tok_s"],
                    "speedup": other["batch"]["output_tok_s"] / base["batch"]["output_tok_s"],
                    "identical": other["batch"]["tokens"] == base["batch"]["tokens"],
                    "counters": other["batch"]["counters"]}
    return out


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True, cwd=os.path.dirname(__file__)).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _row(name: str, r: dict[str, Any]) -> str:
    cells = [name]
    for w in ("copy", "fresh"):
        c = r[w]["counters"] or {}
        cells += [f"{r[w]['tpot_ms']:.1f}", f"{r[w]['speedup']:.2f}x",
                  "yes" if r[w]["identical"] else "NO",
                  f"{c.get('acceptance_rate', 0):.2f}", f"{c.get('mean_accepted_length', 1):.2f}"]
    cells += [f"{r['batch']['output_tok_s']:.1f}", f"{r['batch']['speedup']:.2f}x",
              "yes" if r["batch"]["identical"] else "NO"]
    return "| " + " | ".join(cells) + " |"


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.quick:
        args.max_tokens = 32
    loaded = load_model(args.model, _DTYPES[args.dtype])
    probe = LLM(loaded, block_size=16, num_kv_blocks=8)
    take = 2 if args.quick else None
    workloads = {"copy": [chat_ids(probe, t) for t in COPY_PROMPTS[:take]],
                 "fresh": [chat_ids(probe, t) for t in FRESH_PROMPTS[:take]]}
    del probe
    if args.interleave:
        from bench.spec_interleaved import run_interleaved
        report = run_interleaved(loaded, workloads, ngram_settings(args), args, _commit())
        _write(args.out, report)
        return report
    results: dict[str, Any] = {}
    report = {
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "cpus": os.cpu_count(), "torch": torch.__version__,
                    "threads": args.threads},
        "commit": _commit(), "model": loaded.name, "dtype": args.dtype,
        "quantization": loaded.quantization, "max_tokens": args.max_tokens,
        "batch": args.batch, "paired": args.paired, "temperature": args.temperature,
        "prompt_lens": {w: [len(p) for p in ps] for w, ps in workloads.items()},
        "settings": results,
    }
    base = measure(loaded, None, workloads, args)
    report["baseline_tpot_ms"] = {w: 1e3 * statistics.median(base[w]["tpot_s"])
                                  for w in ("copy", "fresh")}
    report["baseline_batch_tok_s"] = base["batch"]["output_tok_s"]
    for name, spec in [*settings(args, loaded.path)[1:], ("none (run again last)", None)]:
        if args.paired and spec is not None:
            base = measure(loaded, None, workloads, args)
        results[name] = compare(base, measure(loaded, spec, workloads, args))
        print(_row(name, results[name]), flush=True)
        _write(args.out, report)  # what has run so far survives an interrupted run
    print("| setting | copy TPOT ms | copy speed-up | copy identical | copy acceptance | copy "
          "mean accepted length | fresh TPOT ms | fresh speed-up | fresh identical | fresh "
          "acceptance | fresh mean accepted length | batch tok/s | batch speed-up | batch "
          "identical |")
    for name, r in results.items():
        print(_row(name, r))
    return report


def _write(path: Optional[str], report: dict[str, Any]) -> None:
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
