"""The verdict of one server's soak (`judge`): each request's final outcome, the counts, the
load held, the faults and how the server came back from each, memory, and the end checks.

A request's final outcome refines the client's (`bench.soak.clients`): a greedy answer that
differs from the clean run's is a `mismatch`; a stop string found in an answer is
`stop_leaked`; a victim whose fault did not harm it is `victim_unharmed`; a clear error is a
`fault_error` when a fault fired while the request ran or in the `RECOVERY_WINDOW_S` before it
began, else an `unexplained_error`. Only `ok`, `fault_error`, `refused` and `disconnected` pass.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any, Optional

from bench.soak.run import FAULT_KINDS

#: Final outcomes that are not failures.
PASSING = ("ok", "fault_error", "refused", "disconnected")
#: Seconds after a fault during which a new request's clear error is put down to it (the
#: engine loop restarting).
RECOVERY_WINDOW_S = 5.0
#: Failures listed in the report.
MAX_LISTED_FAILURES = 20


def final_outcome(spec: dict[str, Any], result: dict[str, Any], clean: list[Optional[str]],
                  fire_times: list[float]) -> str:
    """The outcome of one request once the clean run and the faults' times are known."""
    outcome = result["outcome"]
    kind = spec["kind"]
    if outcome == "error" and kind != "bad":
        start, end = result["start"], result["end"]
        explained = any(start - RECOVERY_WINDOW_S <= t <= end for t in fire_times)
        return "fault_error" if explained else "unexplained_error"
    if outcome != "ok":
        return outcome
    if kind == "victim":
        return "victim_unharmed"
    if spec.get("reference") is not None and result["texts"].get(0, result["texts"].get("0")) \
            != clean[spec["reference"]]:
        return "mismatch"
    stops = spec["body"].get("stop") if kind == "stop" else None
    if stops and any(s in text for s in stops for text in result["texts"].values()):
        return "stop_leaked"
    return outcome


def judge(record: dict[str, Any], rss_growth_mib: float, warmup: float) -> dict[str, Any]:
    """The summary and verdict of one server's soak record (`bench.soak.run.soak_server`)."""
    if "aborted" in record:
        return {"mode": record["mode"], "passed": False,
                "checks": [{"name": "the soak ran to its end", "passed": False,
                            "detail": record["aborted"]}]}
    final = record["final"]
    fired = (final.get("fault_state") or {}).get("fired") or []
    fire_times = [f["time"] for f in fired]
    counts: dict[str, Counter] = defaultdict(Counter)
    failures = []
    for item in record["results"]:
        spec, result = item["spec"], item["result"]
        outcome = final_outcome(spec, result, record["clean"], fire_times)
        item["final_outcome"] = outcome
        counts[spec["kind"]][outcome] += 1
        if outcome not in PASSING:
            failures.append({"kind": spec["kind"], "client": spec["client"],
                             "stream": bool(spec["body"].get("stream")), "outcome": outcome,
                             "status": result["status"], "detail": result["detail"],
                             "t": round(result["start"] - record["start"], 2)})
    faults = _faults(record, fired)
    load = _load(record)
    memory = _memory(record, warmup)
    checks = _checks(record, failures, faults, memory, rss_growth_mib)
    phases = {k: record.get(k) for k in ("startup_s", "clean_s", "final_s")}
    return {"mode": record["mode"], "command": record["command"], "phases_s": phases,
            "passed": all(c["passed"] for c in checks), "checks": checks,
            "counts": {k: dict(v) for k, v in sorted(counts.items())}, "load": load,
            "faults": faults, "memory": memory, "final": final,
            "num_failures": len(failures), "failures": failures[:MAX_LISTED_FAILURES]}


def _faults(record: dict[str, Any], fired: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per armed fault: fired or not, its victim's outcome, and the recovery time (from the
    fault to the end of the first request begun after it that got a complete answer)."""
    oks = sorted((r["result"]["start"], r["result"]["end"]) for r in record["results"]
                 if r.get("final_outcome") == "ok")
    out = []
    for fault in record["faults"]:
        entry = {"kind": fault["kind"], "armed_s": round(fault["armed_at"] - record["start"], 2),
                 "arm_status": fault.get("arm_status"), "fired": False, "victim": None,
                 "recovery_s": None}
        hit = next((f for f in fired if f["prompt_prefix"] == fault["prompt_prefix"]), None)
        if hit is not None:
            entry["fired"] = True
            later = [end for start, end in oks if start >= hit["time"]]
            if later:
                entry["recovery_s"] = round(min(later) - hit["time"], 2)
        if fault.get("victim") is not None:
            entry["victim"] = record["results"][fault["victim"]]["final_outcome"]
        out.append(entry)
    return out


def _load(record: dict[str, Any]) -> dict[str, Any]:
    seconds = max(1e-9, record["load_end"] - record["start"])
    during = [r for r in record["results"] if r["spec"]["kind"] != "final"]
    answered = [r for r in during if r.get("final_outcome") in ("ok", "fault_error", "refused")]
    ok = [r for r in during if r.get("final_outcome") == "ok"]
    tokens = sum(r["result"]["completion_tokens"] for r in ok)
    return {"seconds": round(seconds, 1), "requests": len(during), "answered": len(answered),
            "complete": len(ok), "requests_per_s": round(len(during) / seconds, 3),
            "complete_per_s": round(len(ok) / seconds, 3), "output_tokens": tokens,
            "output_tokens_per_s": round(tokens / seconds, 2)}


def _memory(record: dict[str, Any], warmup: float) -> dict[str, Any]:
    """RSS at the end of the warm-up, at the end (engine idle) and its peak, in MiB, and about
    100 of the samples as `(seconds since the load began, MiB)`."""
    samples = [(t, rss) for t, rss in record["rss"] if rss is not None]
    after = [rss for t, rss in samples if t >= record["start"] + warmup]
    mib = 1 << 20
    base = after[0] if after else None
    end = record["final"].get("rss_end")
    return {"start_mib": round(samples[0][1] / mib, 1) if samples else None,
            "after_warmup_mib": round(base / mib, 1) if base else None,
            "end_mib": round(end / mib, 1) if end else None,
            "peak_mib": round(max(r for _, r in samples) / mib, 1) if samples else None,
            "growth_mib": round((end - base) / mib, 1) if base and end else None,
            "samples_mib": [(round(t - record["start"], 1), round(rss / mib, 1))
                            for t, rss in samples[::max(1, len(samples) // 100)]]}


def _checks(record: dict[str, Any], failures: list[dict[str, Any]],
            faults: list[dict[str, Any]], memory: dict[str, Any],
            rss_growth_mib: float) -> list[dict[str, Any]]:
    final = record["final"]
    bad_checks = [c for c in record["integrity"] if c["ok"] is False]
    final_result = next(r for r in record["results"] if r["spec"]["kind"] == "final")
    idle = final["idle_stats"]
    unfired = [f for f in faults if f["arm_status"] == 200 and not f["fired"]]
    unsurvived = [f for f in faults if f["fired"] and f["recovery_s"] is None]
    kinds = {f["kind"] for f in faults if f["fired"]}
    growth = memory["growth_mib"]
    before = record.get("stats_start") or {}
    preempted = (idle.get("num_preemptions") or 0) - (before.get("num_preemptions") or 0)

    def check(name: str, passed: bool, detail: str) -> dict[str, Any]:
        return {"name": name, "passed": bool(passed), "detail": detail}

    return [
        check("every request answered or clearly refused", not failures,
              f"{len(failures)} failures" if failures else "no failure"),
        check("faults of every kind armed and fired", not unfired and kinds == set(FAULT_KINDS)
              and all(f["arm_status"] == 200 for f in faults),
              f"{sum(f['fired'] for f in faults)} of {len(faults)} fired; kinds fired: "
              f"{', '.join(sorted(kinds)) or 'none'}"),
        check("every fault survived", faults and not unsurvived,
              f"{len(unsurvived)} fault(s) with no complete answer after them"
              if unsurvived else "a complete answer after each"),
        check("KV pool preempted under the load", preempted > 0,
              f"preemptions: {preempted}"),
        check("integrity during the run", not bad_checks,
              f"{len(record['integrity'])} checks, {len(bad_checks)} failed"
              + (f": {bad_checks[0]['error']}" if bad_checks else "")),
        check("integrity at the end", final["integrity"]["ok"] is True,
              final["integrity"]["error"] or f"status {final['integrity']['status']}"),
        check("every block free once idle", final["idle_after_s"] is not None,
              f"{idle.get('num_free_blocks')} of {idle.get('num_total_blocks')} free, "
              f"{idle.get('num_running')} running, {idle.get('num_waiting')} waiting, "
              f"{idle.get('num_swapped')} swapped"),
        check(f"RSS growth after warm-up <= {rss_growth_mib:g} MiB",
              growth is not None and growth <= rss_growth_mib, f"{growth} MiB"),
        check("still serving: /health 200", final["health"] == 200, f"{final['health']}"),
        check("still serving: a greedy request equals the clean run's",
              final_result.get("final_outcome") == "ok",
              f"{final_result.get('final_outcome')} {final_result['result']['detail']}".strip()),
        check("server process alive", final["alive"], "alive" if final["alive"] else "exited"),
    ]
