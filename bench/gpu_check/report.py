"""Turns a gpu_check result into markdown whose last lines are a short table that fits in a
terminal, and parses the logs it keeps (pytest's verbose lines, ptxas' resource report)."""

from __future__ import annotations

import re
from collections import Counter, defaultdict

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
    """Kernels compiled, the most registers used, and every kernel that spilled."""
    registers = [int(r) for r in re.findall(r"Used (\d+) registers", log)]
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    spilled = sum(1 for s, l in spills if int(s) or int(l))
    return {"kernels": len(registers), "max_registers": max(registers, default=0),
            "kernels_spilling": spilled}


def healthy(result: dict) -> bool:
    """No conformance failure, the suite finished, and benchmarks produced rows."""
    conf = result["conformance"]
    failed = any(c.get("failed") or c.get("error") for c in conf["by_backend"].values())
    return conf["rc"] == 0 and not failed and bool(result["bench"]["rows"])


def _fmt(x, spec: str = ".3g") -> str:
    return "-" if x is None else format(x, spec)


def _sdpa_times(rows: list[dict]) -> dict[tuple, float]:
    return {(r["batch"], r["context"], r["q_len"]): r["seconds"] for r in rows
            if r.get("backend") == "sdpa-contiguous" and "seconds" in r}


def _bench_table(rows: list[dict]) -> list[str]:
    sdpa = _sdpa_times(rows)
    lines = ["| backend | batch | context | q tokens | eager us | graph us | GB/s | of copy BW "
             "| TFLOP/s | time / SDPA | rel err |", "|" + " --- |" * 11]
    for r in rows:
        if "skipped" in r or "error" in r:
            lines.append(f"| {r.get('backend', '-')} | {r['batch']} | {r['context']} | "
                         f"{r.get('q_len', '-')} | {r.get('skipped') or r.get('error')} |")
            continue
        base = sdpa.get((r["batch"], r["context"], r["q_len"]))
        ratio = r["seconds"] / base if base and r["backend"] != "sdpa-contiguous" else None
        err = r.get("rel_err_vs_sdpa", r.get("rel_err_vs_first"))
        graph = r.get("graph_s")
        lines.append(
            f"| {r['backend']} | {r['batch']} | {r['context']} | {r['q_len']} | "
            f"{r['eager_s'] * 1e6:.1f} | {_fmt(graph and graph * 1e6, '.1f')} | "
            f"{r['GB/s']:.1f} | {r['frac_copy_bw']:.1%} | {r['TFLOP/s']:.2f} | "
            f"{_fmt(ratio, '.2f')} | {_fmt(err, '.1e')} |")
    return lines


def _short_table(rows: list[dict]) -> list[str]:
    """The last lines: decode at the headline shapes, GB/s and fraction of copy bandwidth."""
    sdpa = _sdpa_times(rows)
    lines = [f"{'backend':<16}{'batch':>6}{'ctx':>7}{'GB/s':>9}{'%copy':>7}{'xSDPA':>7}"]
    for r in rows:
        if "seconds" not in r or r.get("mixed"):
            continue
        base = sdpa.get((r["batch"], r["context"], r["q_len"]))
        ratio = r["seconds"] / base if base else None
        lines.append(f"{r['backend']:<16}{r['batch']:>6}{r['context']:>7}{r['GB/s']:>9.0f}"
                     f"{r['frac_copy_bw'] * 100:>6.0f}%{_fmt(ratio, '.2f'):>7}")
    return lines


def markdown(result: dict) -> str:
    env, bench = result["env"], result["bench"]
    out = [f"# gpu_check report ({result['mode']})", "",
           f"- device: {env.get('device')}; date (UTC): {env['date_utc']}",
           "- versions: " + ", ".join(f"{k} {env[k]}" for k in
                                      ("python", "torch", "triton", "cupy", "numpy")),
           f"- total time: {result['seconds']} s", "", "## Build", "",
           f"`{result['build']}`", "", "## Conformance (native)", "",
           "| backend | passed | failed | skipped | error |", "| --- | --- | --- | --- | --- |"]
    for name, c in result["conformance"]["by_backend"].items():
        out.append(f"| {name} | {c.get('passed', 0)} | {c.get('failed', 0)} | "
                   f"{c.get('skipped', 0)} | {c.get('error', 0)} |")
    conf = result["conformance"]
    out += ["", f"pytest rc {conf['rc']} in {conf['seconds']} s; failures: "
            f"{conf['failures'] or 'none'}", "", "## Ceilings (measured in this run)", ""]
    cp, mm = bench["ceilings"]["copy"], bench["ceilings"]["matmul"]
    out += [f"- device-to-device copy: {cp['GB/s']:.1f} GB/s (read + write, "
            f"{cp['bytes'] / 2**30:.2f} GiB moved per copy)",
            f"- matmul {mm['n']}^3 {mm['dtype']}: {mm['TFLOP/s']:.4g} TFLOP/s", "",
            "## Attention", "", *_bench_table(bench["rows"]), ""]
    if bench.get("flex"):
        out += ["## FlexAttention over the paged cache", "", *_bench_table(bench["flex"]), ""]
    out += ["## Summary: decode", "", "```", *_short_table(bench["rows"]), "```"]
    return "\n".join(out) + "\n"
