"""The soak with faults (`python -m bench.soak`): a short run against real servers in both
preemption modes must pass its verdict; the fault injector of the debug endpoints and the
soak's judge are checked on hand-made inputs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from bench.soak import judge
from engine.server.debug import FaultInjector, FaultRequest, InjectedFault, InjectedThreadDeath

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ------------------------------------------------------------------------ fault injector
def _engine(calls: list) -> SimpleNamespace:
    runner = SimpleNamespace(execute=lambda out, tables: calls.append(out) or "ran")
    return SimpleNamespace(runner=runner)


def _step(*prompts: list[int]) -> SimpleNamespace:
    seqs = [SimpleNamespace(group=SimpleNamespace(request_id=f"r{i}", prompt_token_ids=p))
            for i, p in enumerate(prompts)]
    return SimpleNamespace(scheduled=[(s, 1) for s in seqs])


def test_fault_fires_only_on_its_victims_prompt_and_count_times() -> None:
    calls: list = []
    engine = _engine(calls)
    injector = FaultInjector()
    injector.install(engine)
    injector.install(engine)  # idempotent: one wrapper, not two
    injector.arm(FaultRequest(kind="step_raises", count=2, prompt_prefix=[7, 8]))
    assert engine.runner.execute(_step([7, 9, 8]), None) == "ran"
    for _ in range(2):
        with pytest.raises(InjectedFault):
            engine.runner.execute(_step([1, 2], [7, 8, 3]), None)
    assert engine.runner.execute(_step([7, 8, 3]), None) == "ran"
    state = injector.state()
    assert state["armed"] == [] and len(state["fired"]) == 2
    assert state["fired"][0]["request_ids"] == ["r0", "r1"]
    assert len(calls) == 2  # the failing steps never reached the model


def test_thread_death_is_not_an_exception_and_disarm_drops_faults() -> None:
    engine = _engine([])
    injector = FaultInjector()
    injector.install(engine)
    injector.arm(FaultRequest(kind="engine_thread_dies"))
    with pytest.raises(InjectedThreadDeath) as info:
        engine.runner.execute(_step([5]), None)
    assert not isinstance(info.value, Exception)
    injector.arm(FaultRequest(kind="step_raises"))
    injector.disarm()
    assert engine.runner.execute(_step([5]), None) == "ran"


# -------------------------------------------------------------------------------- judge
def _item(kind: str, outcome: str, start: float = 10.0, end: float = 12.0, text: str = "a",
          reference: int | None = None, stop: list[str] | None = None) -> dict:
    body = {"stream": False, **({"stop": stop} if stop else {})}
    return {"spec": {"kind": kind, "client": "httpx", "body": body, "reference": reference},
            "result": {"outcome": outcome, "start": start, "end": end, "status": 200,
                       "detail": "", "texts": {0: text}, "completion_tokens": 1}}


def test_final_outcome_flags_what_a_soak_must_not_see() -> None:
    out = judge.final_outcome
    clean = ["same"]
    assert out(**_args(_item("greedy", "ok", text="same", reference=0)), clean=clean,
               fire_times=[]) == "ok"
    assert out(**_args(_item("greedy", "ok", text="other", reference=0)), clean=clean,
               fire_times=[]) == "mismatch"
    assert out(**_args(_item("stop", "ok", text="a. b", stop=["."])), clean=clean,
               fire_times=[]) == "stop_leaked"
    assert out(**_args(_item("sampled", "error")), clean=clean, fire_times=[11.0]) \
        == "fault_error"
    assert out(**_args(_item("sampled", "error")), clean=clean, fire_times=[30.0]) \
        == "unexplained_error"
    assert out(**_args(_item("victim", "ok")), clean=clean, fire_times=[]) == "victim_unharmed"
    assert out(**_args(_item("stream", "truncated")), clean=clean, fire_times=[]) == "truncated"


def _args(item: dict) -> dict:
    return {"spec": item["spec"], "result": item["result"]}


def _record(**final: object) -> dict:
    fired = [{"kind": k, "prompt_prefix": [i], "time": 5.0 + i}
             for i, k in enumerate(("step_raises", "engine_thread_dies"))]
    base_final = {"fault_state": {"armed": [], "fired": fired},
                  "idle_stats": {"num_running": 0, "num_waiting": 0, "num_swapped": 0,
                                 "num_free_blocks": 12, "num_total_blocks": 12,
                                 "num_preemptions": 3},
                  "idle_after_s": 0.1, "integrity": {"ok": True, "error": "", "status": 200},
                  "health": 200, "rss_end": 110 << 20, "alive": True}
    base_final.update(final)
    return {"mode": "recompute", "command": "serve", "clean": ["same"], "start": 0.0,
            "final": base_final,
            "load_end": 20.0, "stats_start": {"num_preemptions": 0},
            "faults": [{"kind": f["kind"], "prompt_prefix": f["prompt_prefix"], "armed_at": 4.0,
                        "arm_status": 200} for f in fired],
            "integrity": [{"ok": True}], "rss": [(0.0, 100 << 20), (3.0, 100 << 20)],
            "results": [_item("greedy", "ok", 8.0, 9.0, "same", 0),
                        _item("final", "ok", 21.0, 22.0, "same", 0)]}


def test_judge_passes_a_clean_record_and_fails_each_broken_check() -> None:
    assert judge.judge(_record(), rss_growth_mib=64, warmup=2.0)["passed"]
    broken = {
        "every block free once idle": _record(idle_after_s=None),
        "integrity at the end": _record(integrity={"ok": False, "error": "leak", "status": 500}),
        "still serving: /health 200": _record(health=503),
        "RSS growth after warm-up <= 64 MiB": _record(rss_end=300 << 20),
        "faults of every kind armed and fired": _record(fault_state={"armed": [], "fired": []}),
    }
    for name, record in broken.items():
        verdict = judge.judge(record, rss_growth_mib=64, warmup=2.0)
        failed = [c["name"] for c in verdict["checks"] if not c["passed"]]
        assert not verdict["passed"] and name in failed, (name, failed)


# ---------------------------------------------------------------------------- the soak
def test_soak_passes_against_real_servers(tmp_path) -> None:
    """The CI version of `python -m bench.soak` (both preemption modes side by side, 24 s of
    load with a fault every ~6 s: 2-4 faults, both kinds). Its RSS bound only catches a gross
    leak: in its first minutes a server's RSS grows by tens of MiB, faults or not, more slowly
    as the run goes on; the long run holds the real bound."""
    out = tmp_path / "soak"
    cmd = [sys.executable, "-m", "bench.soak", "--duration", "24", "--fault-interval", "6",
           "--num-references", "4", "--request-timeout", "40", "--rss-growth-mib", "128",
           "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    summary_path = out / "soak.json"
    assert summary_path.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads(summary_path.read_text())
    failed = {s["mode"]: [c for c in s["checks"] if not c["passed"]] + s.get("failures", [])
              for s in summary["servers"]}
    assert proc.returncode == 0 and summary["passed"], failed
    assert [s["mode"] for s in summary["servers"]] == ["recompute", "swap"]
