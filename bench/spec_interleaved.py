"""Speculative decoding against plain decoding, interleaved in one process so that a machine's
drift hits every setting alike: `python -m bench.spec_decode --interleave ROUNDS`.

Settings: "none" (plain decoding), "none again" (a second plain engine: its ratio to "none" is
the run's A/A noise) and "ngram k=K" for each `--ngram-k` (the speculation controller on). Each
setting has one engine for the whole run (its controller learns step costs across requests,
as a server's would). Workloads at concurrency 1 (one request at a time): `copy` and `fresh`
greedy (outputs compared with "none" token for token), and `fresh sampled` (temperature
`--temperature`, 1.0 when 0 is given; request seed = prompt index + 1000 * round, the same for
every setting).

A round runs every prompt of every workload under every setting; for each prompt the settings
run back to back in an order rotated by round and prompt (a Latin square over settings), so
none always runs first or last. Per request: TPOT, from the first output token to the last over
the tokens after the first. Per setting and workload: the median over rounds x prompts of
(TPOT of "none" / TPOT of the setting) for the same round and prompt (> 1: faster than plain),
a 95 % bootstrap interval of that median resampling whole rounds, and the smallest and largest
per-round median. From the engine's counters over that setting's requests of the workload: the
acceptance rate, the mean accepted length (1 + accepted / verification steps) and the
controller's chosen-k histogram (decisions per k, probes included).
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import time
from typing import Any, Optional

import torch

from engine import LLM, SamplingParams
from engine.model.loader import LoadedModel

BOOTSTRAP = 2000


def one_request(llm: LLM, prompt: list[int], params: SamplingParams) -> dict[str, Any]:
    """Runs `prompt` alone; its output ids and TPOT in seconds."""
    eng = llm.llm_engine
    rid = f"r{time.monotonic_ns()}"
    eng.add_request(rid, prompt, params)
    first = last = 0.0
    tokens: list[int] = []
    while eng.has_unfinished_requests():
        for out in eng.step():
            last = time.perf_counter()
            first = first or last
            tokens = list(out.outputs[0].token_ids)
    return {"tokens": tokens, "tpot_s": (last - first) / max(1, len(tokens) - 1)}


def _snapshot(llm: LLM) -> dict[str, Any]:
    spec = llm.llm_engine.speculator
    if spec is None:
        return {}
    c = spec.counters()
    return {"drafts": c.num_drafts, "draft_tokens": c.num_draft_tokens,
            "accepted": c.num_accepted_tokens, "chosen_k": list(c.chosen_k),
            "probes": c.num_probes}


def _add_delta(total: dict[str, Any], before: dict[str, Any], after: dict[str, Any]) -> None:
    for key, value in after.items():
        if isinstance(value, list):
            old = total.setdefault(key, [0] * len(value))
            for i, (a, b) in enumerate(zip(after[key], before[key])):
                old[i] += a - b
        else:
            total[key] = total.get(key, 0) + value - before[key]


def workload_params(args: argparse.Namespace) -> dict[str, tuple[str, float]]:
    """Workload name -> (prompt set, temperature)."""
    return {"copy": ("copy", 0.0), "fresh": ("fresh", 0.0),
            "fresh sampled": ("fresh", args.temperature or 1.0)}


def run_interleaved(loaded: LoadedModel, prompts: dict[str, list[list[int]]],
                    speculating: list[tuple[str, Optional[dict]]], args: argparse.Namespace,
                    commit: str) -> dict[str, Any]:
    """The interleaved comparison (module docstring) of plain decoding twice against each
    `(name, speculative_config)` of `speculating`, at git `commit`; returns the JSON report and
    prints its table."""
    settings: list[tuple[str, Optional[dict]]] = [("none", None), ("none again", None),
                                                  *speculating]
    blocks = -(-(max(len(p) for ps in prompts.values() for p in ps) + args.max_tokens) // 16)
    engines = {name: LLM(loaded, block_size=16, num_kv_blocks=2 * blocks,
                         speculative_config=spec) for name, spec in settings}
    warm = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for llm in engines.values():
        one_request(llm, prompts["copy"][0], warm)
    workloads = workload_params(args)
    tpot: dict[str, dict[str, list[list[float]]]] = {
        w: {s: [] for s, _ in settings} for w in workloads}
    same: dict[str, dict[str, bool]] = {w: {s: True for s, _ in settings} for w in workloads}
    counts: dict[str, dict[str, dict[str, Any]]] = {w: {s: {} for s, _ in settings}
                                                    for w in workloads}
    started = time.perf_counter()
    for rnd in range(args.interleave):
        for w, (source, temperature) in workloads.items():
            for s, _ in settings:
                tpot[w][s].append([])
            for i, prompt in enumerate(prompts[source]):
                params = SamplingParams(temperature=temperature, max_tokens=args.max_tokens,
                                        ignore_eos=True,
                                        seed=i + 1000 * rnd if temperature > 0 else None)
                shift = (rnd + i) % len(settings)
                order = settings[shift:] + settings[:shift]
                outputs = {}
                for s, _ in order:
                    before = _snapshot(engines[s])
                    run = one_request(engines[s], prompt, params)
                    _add_delta(counts[w][s], before, _snapshot(engines[s]))
                    tpot[w][s][-1].append(run["tpot_s"])
                    outputs[s] = run["tokens"]
                for s, _ in settings:
                    same[w][s] &= outputs[s] == outputs["none"]
        print(f"round {rnd + 1}/{args.interleave} done at "
              f"{time.perf_counter() - started:.0f} s", flush=True)
    rows = {w: {s: summarise(tpot[w]["none"], tpot[w][s], counts[w][s],
                             same[w][s] if workloads[w][1] == 0 else None)
                for s, _ in settings[1:]} for w in workloads}
    report = {
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "cpus": os.cpu_count(), "torch": torch.__version__,
                    "threads": args.threads, "load_before": os.getloadavg()},
        "commit": commit, "model": loaded.name, "quantization": loaded.quantization,
        "max_tokens": args.max_tokens, "rounds": args.interleave,
        "wall_s": time.perf_counter() - started,
        "prompt_lens": {w: [len(p) for p in ps] for w, ps in prompts.items()},
        "baseline_tpot_ms": {w: 1e3 * statistics.median(_flat(tpot[w]["none"]))
                             for w in workloads},
        "results": rows, "step_costs": {s: learnt_costs(llm) for s, llm in engines.items()
                                        if llm.llm_engine.speculator is not None},
        "tpot_s": tpot,
    }
    print_table(report)
    return report


def learnt_costs(llm: LLM) -> dict[str, Any]:
    """What the engine's controller learnt by the end of the run: T(R) in ms for R = 1..k+1
    (R query rows at concurrency 1), T(R) / T(1), the fitted relative cost per row and the
    proposer's ms per token."""
    spec = llm.llm_engine.speculator
    assert spec is not None
    costs = spec.controller.costs
    rows = range(1, spec.config.num_speculative_tokens + 2)
    ms = {r: 1e3 * costs.step_seconds(r) for r in rows}
    return {"step_ms": ms, "relative": {r: ms[r] / ms[1] for r in rows},
            "row_cost": costs.row_cost(), "propose_ms_per_token": 1e3 * costs.propose_seconds}


def _flat(rounds: list[list[float]]) -> list[float]:
    return [x for r in rounds for x in r]


def summarise(base: list[list[float]], other: list[list[float]], counts: dict[str, Any],
              identical: Optional[bool]) -> dict[str, Any]:
    """One setting on one workload against "none": the median ratio, its bootstrap interval
    over rounds, the per-round medians' range, TPOT, the counters' rates."""
    ratios = [[b / o for b, o in zip(br, orr)] for br, orr in zip(base, other)]
    rng = random.Random(0)
    boot = sorted(statistics.median(_flat([rng.choice(ratios) for _ in ratios]))
                  for _ in range(BOOTSTRAP))
    per_round = [statistics.median(r) for r in ratios]
    out: dict[str, Any] = {
        "ratio": statistics.median(_flat(ratios)),
        "ci95": [boot[int(0.025 * BOOTSTRAP)], boot[int(0.975 * BOOTSTRAP) - 1]],
        "round_min": min(per_round), "round_max": max(per_round),
        "tpot_ms": 1e3 * statistics.median(_flat(other)), "identical": identical}
    if counts:
        out.update(counts)
        out["acceptance_rate"] = counts["accepted"] / max(1, counts["draft_tokens"])
        out["mean_accepted_length"] = 1 + counts["accepted"] / max(1, counts["drafts"])
    return out


def print_table(report: dict[str, Any]) -> None:
    print("| workload | setting | TPOT ms | speed-up (median) | 95 % CI | rounds min-max | "
          "identical | acceptance | mean accepted length | chosen k (0..k) | probes |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for w, rows in report["results"].items():
        for s, r in rows.items():
            same = {True: "yes", False: "NO", None: "-"}[r["identical"]]
            acc = f"{r['acceptance_rate']:.2f}" if "acceptance_rate" in r else "-"
            length = f"{r['mean_accepted_length']:.2f}" if "acceptance_rate" in r else "-"
            hist = "/".join(map(str, r.get("chosen_k", []))) or "-"
            print(f"| {w} | {s} | {r['tpot_ms']:.1f} | {r['ratio']:.3f}x | "
                  f"{r['ci95'][0]:.3f}-{r['ci95'][1]:.3f} | "
                  f"{r['round_min']:.3f}-{r['round_max']:.3f} | {same} | {acc} | {length} | "
                  f"{hist} | {r.get('probes', '-')} |")
    for s, c in report["step_costs"].items():
        rel = ", ".join(f"{r}: {v:.2f}" for r, v in c["relative"].items())
        print(f"{s}: T(R) / T(1) learnt: {rel}; T(1) = {c['step_ms'][1]:.1f} ms; proposing "
              f"{c['propose_ms_per_token']:.2f} ms per token")

