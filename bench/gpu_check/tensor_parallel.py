"""gpu_check's tensor-parallel step: `bench.tp_step --device cuda` (N = 2 over NCCL against
N = 1: greedy outputs' equality and step times) when the machine has two GPUs or more; with
fewer, or in the CPU smoke run, the reason it did not run."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch

from bench.gpu_check.logged import run_logged


def run(out: Path, device: str, timeout: int, env: dict) -> dict:
    """The step's result: `skipped` with the reason, or `rc`, `seconds`, `greedy_equal` and
    the step times of each case (log appended to settings.log, so no file is added)."""
    if device != "cuda":
        return {"skipped": "no GPU (tests/test_tp_engine.py runs N = 2, 3 and 4 with gloo)"}
    count = torch.cuda.device_count()
    if count < 2:
        return {"skipped": f"{count} GPU visible: N = 2 over NCCL needs two"}
    with tempfile.TemporaryDirectory(prefix="pk_tp_") as folder:
        run_ = run_logged([sys.executable, "-m", "bench.tp_step", "--device", "cuda",
                           "--steps", "5", "--out", folder], out / "settings.log", timeout,
                          env, title="tensor parallelism: bench.tp_step --device cuda")
        path = Path(folder) / "tp_step.json"
        data = json.loads(path.read_text()) if path.exists() else {}
    result = {"rc": run_["rc"], "seconds": run_["seconds"],
              "greedy_equal": data.get("greedy_equal")}
    for name in ("N=1 (2 threads)", "N=2 (1 thread each)"):
        if name in data:
            result[name.split(" ")[0]] = {case: round(r["step_ms"], 3)
                                          for case, r in data[name].items()
                                          if isinstance(r, dict) and "step_ms" in r}
    return result


def section(tp: dict) -> list[str]:
    """The report's lines for the step."""
    out = ["## Tensor parallelism (NCCL, N = 2 against N = 1)", ""]
    if "skipped" in tp:
        return out + [f"skipped: {tp['skipped']}", ""]
    out += [f"rc {tp['rc']} in {tp['seconds']} s; greedy outputs equal: {tp['greedy_equal']}",
            "", "| case | N=1 step ms | N=2 step ms |", "| --- | --- | --- |"]
    one, two = tp.get("N=1", {}), tp.get("N=2", {})
    for case in one:
        out.append(f"| {case} | {one[case]} | {two.get(case, '-')} |")
    return out + [""]
