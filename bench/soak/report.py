"""The soak's report: `soak.json` (settings, machine, commit and each server's verdict and
numbers), `report.md` (the same as tables) and `requests.jsonl.gz` (every request's spec and
result) in the output folder."""

from __future__ import annotations

import gzip
import json
import os
import platform
import subprocess
from typing import Any

from bench.soak.judge import RECOVERY_WINDOW_S
from bench.soak.server import REPO


_LEGEND = (
    "Outcomes: `ok`, a complete answer; `fault_error`, a clear error (OpenAI's shape) for a "
    "request in flight when a fault fired or begun up to "
    f"{RECOVERY_WINDOW_S:g} s after it; `refused`, a bad request answered with its 4xx naming "
    "the field; `disconnected`, a client that left on purpose. Any other outcome is a failure: "
    "`timeout`, `truncated`, `malformed`, `transport`, `wrong_status`, `mismatch` (a greedy "
    "answer unlike the clean run's), `stop_leaked`, `victim_unharmed`, `unexplained_error`. A "
    "fault's victim is the request on whose path it was armed.")


def machine() -> dict[str, Any]:
    """Where the soak ran: CPU, cores, Python, and the commit (with a dirty flag)."""
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True,
                                  timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    return {"platform": platform.platform(), "processor": platform.processor(),
            "cpu_count": os.cpu_count(), "python": platform.python_version(),
            "commit": git("rev-parse", "--short", "HEAD"),
            "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}


def write(out_dir: str, summary: dict[str, Any], records: list[dict[str, Any]]) -> None:
    """Writes the three files into `out_dir` (created if needed)."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "soak.json"), "w") as f:
        json.dump(summary, f, indent=1, default=str)
    with gzip.open(os.path.join(out_dir, "requests.jsonl.gz"), "wt") as f:
        for record in records:
            for item in record.get("results", []):
                f.write(json.dumps({"mode": record["mode"], **item}, default=str) + "\n")
    with open(os.path.join(out_dir, "report.md"), "w") as f:
        f.write(render(summary))


def render(summary: dict[str, Any]) -> str:
    """report.md."""
    m = summary["machine"]
    lines = [f"# Soak with faults: {'PASS' if summary['passed'] else 'FAIL'}", "",
             f"`{summary['command']}`", "",
             f"{summary['date']}; commit {m['commit']}{' (dirty tree)' if m['dirty'] else ''}; "
             f"{m['cpu_count']} cores, {m['processor'] or m['platform']}, Python {m['python']}.",
             "", _LEGEND, ""]
    for server in summary["servers"]:
        lines += _render_server(server)
    return "\n".join(lines) + "\n"


def _render_server(s: dict[str, Any]) -> list[str]:
    lines = [f"## preemption {s['mode']}: {'PASS' if s['passed'] else 'FAIL'}", ""]
    if s.get("command"):
        lines += [f"Server: `{s['command']}`", ""]
    lines += ["| check | | |", "|---|---|---|"]
    lines += [f"| {c['name']} | {'pass' if c['passed'] else '**FAIL**'} | {c['detail']} |"
              for c in s["checks"]]
    if "load" not in s:
        return lines + [""]
    load, mem = s["load"], s["memory"]
    lines += ["", "Load held: "
              f"{load['requests']} requests in {load['seconds']} s ({load['requests_per_s']}/s), "
              f"{load['complete']} complete answers ({load['complete_per_s']}/s), "
              f"{load['output_tokens']} output tokens ({load['output_tokens_per_s']}/s).", "",
              "Phases (s): " + ", ".join(f"{k[:-2]} {v}" for k, v in s["phases_s"].items())
              + f", load {load['seconds']}.", "",
              f"Resident memory (MiB): start {mem['start_mib']}, after warm-up "
              f"{mem['after_warmup_mib']}, end {mem['end_mib']}, peak {mem['peak_mib']}; growth "
              f"{mem['growth_mib']}.", ""]
    outcomes = sorted({o for c in s["counts"].values() for o in c})
    lines += ["| kind | " + " | ".join(outcomes) + " |",
              "|---|" + "---|" * len(outcomes)]
    lines += [f"| {kind} | " + " | ".join(str(c.get(o, "")) for o in outcomes) + " |"
              for kind, c in s["counts"].items()]
    lines += ["", "| fault | armed at (s) | fired | victim | first complete answer after (s) |",
              "|---|---|---|---|---|"]
    lines += [f"| {f['kind']} | {f['armed_s']} | {f['fired']} | {f['victim']} | "
              f"{f['recovery_s']} |" for f in s["faults"]]
    if s["failures"]:
        lines += ["", f"Failures ({s['num_failures']}; the first {len(s['failures'])}):", "",
                  "| t (s) | kind | client | stream | outcome | status | detail |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {f['t']} | {f['kind']} | {f['client']} | {f['stream']} | {f['outcome']} "
                  f"| {f['status']} | {_cell(f['detail'])} |" for f in s["failures"]]
    return lines + [""]


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")[:160]
