"""Turns a gpu_check result into markdown whose last lines are a short table that fits in a
terminal, and parses the logs it keeps (pytest's verbose lines, ptxas' resource report)."""

from __future__ import annotations

import re
from collections import Counter, defaultdict

from bench.gpu_check import kv8_decode, tensor_parallel
from cuda.paged_cuda import tune_verdict

BACKEND_ID = re.compile(r"[\[-](cuda-host|cuda|triton|reference)(?=[-\]])")
OUTCOME = re.compile(r"(\S+::\S+)\s+(PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)"
                     r"|(PASSED|FAILED|SKIPPED|ERROR) (\S+::\S+)")


def count_outcomes(log: str) -> dict[str, dict[str, int]]:
    """Outcome counts per backend from `pytest -v` output (with or without xdist)."""
    counts: dict[str, Counter] = defaultdict(Counter)
    for match in OUTCOME.finditer(log):
        test = match.group(1) or match.group(4)
        outcome = match.group(2) or match.group(3)
        found = BACKEND_ID.search(test)
        counts[found.group(1) if found else "backend-independent"][outcome.lower()] += 1
    return {name: dict(c) for name, c in sorted(counts.items())}


def ptxas_summary(log: str) -> dict:
    """Kernels compiled, the most registers used, and every kernel that spilled, from either
    ptxas' own `-v` lines or the table `python -m cuda.paged_cuda.build` prints
    (`arch regs stack spill-stores/spill-loads kernel`)."""
    registers = [int(r) for r in re.findall(r"Used (\d+) registers", log)]
    spills = [(int(s), int(l)) for s, l in
              re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)]
    for regs, stores, loads in re.findall(r"^sm_\d+\s+(\d+)\s+\d+\s+(\d+)/(\d+)\s", log, re.M):
        registers.append(int(regs))
        spills.append((int(stores), int(loads)))
    return {"kernels": len(registers), "max_registers": max(registers, default=0),
            "kernels_spilling": sum(1 for s, l in spills if s or l)}


def healthy(result: dict) -> bool:
    """The suite finished with no failure, the benchmarks produced timed rows, and no planner
    setting's conformance run failed."""
    conf = result["conformance"]
    failed = any(c.get("failed") or c.get("error") for c in conf["by_backend"].values())
    timed = [r for r in result["bench"]["results"] if "seconds" in r]
    settings_failed = any(r.get("failed") or r.get("error") for r in result.get("settings", []))
    return conf["rc"] == 0 and not failed and bool(timed) and not settings_failed


def _fmt(x, spec: str = ".3g") -> str:
    return "-" if x is None else format(x, spec)


def _best(r: dict) -> tuple[float, float]:
    """(seconds, fraction of copy bandwidth): graph replay where captured, else eager."""
    if "graph_seconds" in r:
        return r["graph_seconds"], r["graph_frac_copy_bw"]
    return r["seconds"], r.get("frac_copy_bw", 0.0)


def _sdpa_times(rows: list[dict]) -> dict[tuple, float]:
    return {(r["kind"], r["batch"], r["context"], r["q_len"]): _best(r)[0] for r in rows
            if r["backend"] == "torch-sdpa" and "seconds" in r}


def _bench_table(rows: list[dict]) -> list[str]:
    sdpa = _sdpa_times(rows)
    lines = ["| backend | kind | batch | context | q_len | eager us | graph us | GB/s (best) "
             "| of copy BW | TFLOP/s | of matmul | time / SDPA | rel err vs SDPA |",
             "|" + " --- |" * 13]
    for r in rows:
        head = f"| {r['backend']} | {r['kind']} | {r['batch']} | {r['context']} | {r['q_len']} |"
        if "seconds" not in r:
            lines.append(f"{head} {r.get('error', '?')[:160]} |")
            continue
        seconds, frac = _best(r)
        base = sdpa.get((r["kind"], r["batch"], r["context"], r["q_len"]))
        ratio = seconds / base if base and r["backend"] != "torch-sdpa" else None
        graph = r.get("graph_seconds")
        lines.append(
            f"{head} {r['seconds'] * 1e6:.1f} | {_fmt(graph and graph * 1e6, '.1f')} | "
            f"{r['bytes_moved'] / seconds / 1e9:.1f} | {frac:.1%} | "
            f"{r['flops'] / seconds / 1e12:.2f} | {r.get('frac_matmul', 0) :.1%} | "
            f"{_fmt(ratio, '.2f')} | {_fmt(r.get('rel_err_vs_sdpa'), '.1e')} |")
    return lines


def _short_table(rows: list[dict]) -> list[str]:
    """The last lines: decode per backend and shape, GB/s, share of copy bandwidth, vs SDPA."""
    sdpa = _sdpa_times(rows)
    lines = [f"{'decode':<12}{'batch':>6}{'ctx':>7}{'GB/s':>8}{'%copy':>7}{'xSDPA':>9}"]
    for r in rows:
        if "seconds" not in r or r["kind"] != "decode":
            continue
        seconds, frac = _best(r)
        base = sdpa.get((r["kind"], r["batch"], r["context"], r["q_len"]))
        ratio = seconds / base if base else None
        lines.append(f"{r['backend'][:12]:<12}{r['batch']:>6}{r['context']:>7}"
                     f"{r['bytes_moved'] / seconds / 1e9:>8.0f}{frac * 100:>6.0f}%"
                     f"{_fmt(ratio, '.2f'):>9}")
    return lines


def _tune_table(rows: list[dict]) -> list[str]:
    lines = ["| variant | kind | batch | context | q_len | graph us | of copy BW | time / SDPA "
             "| rel err vs SDPA |", "|" + " --- |" * 9]
    for r in rows:
        head = f"| {r['variant']} | {r['kind']} | {r['batch']} | {r['context']} | {r['q_len']} |"
        if "us" not in r:
            lines.append(f"{head} {r.get('error', '?')[:160]} | | | |")
            continue
        lines.append(f"{head} {r['us']:.1f} | {r['frac_copy']:.1%} | "
                     f"{_fmt(r.get('x_sdpa'), '.3f')} | {_fmt(r.get('rel_err_vs_sdpa'), '.1e')} |")
    return lines


def _tuning_sections(result: dict) -> list[str]:
    out = []
    tune = result.get("tune")
    if tune is not None:
        out += ["## Tuning (bench.tune_decode, CUDA-graph replay)", ""]
        if "skipped" in tune:
            out += [f"skipped: {tune['skipped']}", ""]
        else:
            v = tune["verdict"]
            out += [f"rc {tune['rc']} in {tune['seconds']} s, {len(tune['rows'])} rows (log: "
                    "tune.log)", "", *_tune_table(tune["rows"]), "",
                    "The rule (cuda/paged_cuda/tune_verdict.py):", "",
                    *[f"- {line}" for line in v["why"] + v["alarms"]], ""]
    settings = result.get("settings")
    if settings is not None:
        out += ["## Planner settings: native conformance (log: settings.log)", "",
                "| setting | passed | failed | skipped | error | rc | seconds |",
                "|" + " --- |" * 7]
        graph = result.get("graph_test")
        for r in settings + ([{"setting": "custom ops: CUDA graph", **graph}] if graph else []):
            if "skipped" in r and isinstance(r["skipped"], str):
                out.append(f"| {r['setting']} | skipped: {r['skipped']} | | | | | |")
                continue
            out.append(f"| {r['setting']} | {r.get('passed', 0)} | {r.get('failed', 0)} | "
                       f"{r.get('skipped', 0)} | {r.get('error', 0)} | {r['rc']} | "
                       f"{r['seconds']} |")
        out.append("")
    return out


def markdown(result: dict) -> str:
    """The report of the steps run so far (a run cut short still renders)."""
    env, bench = result["env"], result.get("bench")
    out = [f"# gpu_check report ({result['mode']})", "",
           f"- device: {env.get('device')}; date (UTC): {env['date_utc']}",
           "- versions: " + ", ".join(f"{k} {env[k]}" for k in
                                      ("python", "torch", "triton", "cupy", "numpy")),
           f"- backends benchmarked: {', '.join(bench['backends']) if bench else '-'}",
           f"- total time: {result.get('seconds')} s", ""]
    if "build" in result:
        out += ["## Build", "", f"`{result['build']}`", ""]
    conf = result.get("conformance")
    if conf is not None:
        out += ["## Conformance (native)", "",
                "| backend | passed | failed | skipped | error |",
                "| --- | --- | --- | --- | --- |"]
        for name, c in conf["by_backend"].items():
            out.append(f"| {name} | {c.get('passed', 0)} | {c.get('failed', 0)} | "
                       f"{c.get('skipped', 0)} | {c.get('error', 0)} |")
        out += ["", f"pytest rc {conf['rc']} in {conf['seconds']} s; failures: "
                f"{conf['failures'] or 'none'}", ""]
    if bench is not None:
        c = bench["ceilings"]
        out += ["## Ceilings (measured in this run)", "",
                f"- device-to-device copy: {c['copy_GBps']:.1f} GB/s (bytes read + written)",
                f"- matmul {c['matmul_n']}^3 {c['matmul_dtype']}: {c['matmul_TFLOPs']:.4g} "
                "TFLOP/s", "", "## Kernels (best of eager and CUDA-graph replay)", "",
                *_bench_table(bench["results"]), ""]
        if bench.get("flex"):
            out += ["## FlexAttention over the paged cache", "", *_bench_table(bench["flex"]),
                    ""]
    if result.get("kv8") is not None:
        out += ["## Decode over a float8_e4m3fn KV cache (bytes counted as read: 1 per K/V "
                "element)", "", *kv8_decode.table(result["kv8"]), ""]
    if result.get("tensor_parallel") is not None:
        out += tensor_parallel.section(result["tensor_parallel"])
    out += _tuning_sections(result)
    summary = _short_table(bench["results"]) if bench is not None else []
    tune = result.get("tune") or {}
    if "verdict" in tune:
        summary += [""] + tune_verdict.summary_lines(tune["verdict"])
    out += ["## Summary", "", "```", *summary, "```"]
    return "\n".join(out) + "\n"
