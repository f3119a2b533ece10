"""gpu_check's tuning steps: the CUDA planner's opt-in settings checked and timed on the device,
so one call both measures the defaults and says which settings should replace them.

- `settings_conformance`: the native conformance tests of the kernels each setting changes,
  once per setting that `bench.tune_decode` times (decode settings: the decode tests; varlen
  settings: the others). Forced partitions are left out: they change no kernel.
- `graph_test`: tests/test_custom_ops.py's CUDA-graph capture and replay.
- `tune`: `python -m bench.tune_decode`, cut at its deadline with the rows timed so far kept,
  then the rule of cuda/paged_cuda/tune_verdict.py over them.

All three append to logs in OUT (`settings.log`, `tune.log`) and return JSON-ready dicts. In the
CPU smoke run the conformance steps run the `cuda-host` backend (the kernels' own source on the
CPU) and `tune` and `graph_test` are skipped: they need CUDA graphs.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.gpu_check.logged import run_logged
from cuda.paged_cuda import tune_verdict
from cuda.paged_cuda.settings import PARTITION_ENV

SUMMARY = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed)")
#: What a step needs at least; with less time left before the deadline it is skipped.
MIN_STEP_SECONDS = 15


def planner_settings() -> list[dict[str, str]]:
    """The distinct CUDA planner settings of tune_decode's variants, partitions left out."""
    from bench.tune_decode import PREFILL_VARIANTS, VARIANTS, parse_variant

    found: list[dict[str, str]] = []
    for text in [*VARIANTS, *PREFILL_VARIANTS]:
        backend, settings = parse_variant(text)
        settings = {k: v for k, v in settings.items() if k != PARTITION_ENV}
        if backend == "cuda" and settings and settings not in found:
            found.append(settings)
    return found


def selection(settings: dict[str, str], smoke: bool) -> str:
    """The `-k` expression of the conformance tests a setting's kernels run. The settings change
    the 16-bit tensor-core kernels only (cuda/paged_cuda/planner.py), so the CPU smoke run,
    which interprets every kernel on the CPU, keeps just the float16 and bfloat16 queries over a
    cache of their own dtype."""
    backend = "cuda-host" if smoke else "cuda and not host"
    only_16bit = " and (bfloat16 or float16) and not kv_" if smoke else ""
    if any("DECODE" in name for name in settings):
        return f"{backend} and (decode or long_context){only_16bit}"
    return f"{backend} and not decode and not long_context{only_16bit}"


def outcome_counts(text: str) -> dict[str, int]:
    """Counts from pytest's last summary line ("3 passed, 1 skipped in 2.0s")."""
    lines = [line for line in text.splitlines() if SUMMARY.search(line)]
    if not lines:
        return {}
    return {kind.rstrip("s") if kind.startswith("error") else kind: int(n)
            for n, kind in SUMMARY.findall(lines[-1])}


def _remaining(deadline: float) -> float:
    return deadline - time.time()


def _pytest(args: list[str], extra_env: dict[str, str], log: Path, title: str,
            timeout: float, env: dict) -> dict:
    """Runs pytest with `extra_env`, appending its output under a title line to `log`."""
    run = run_logged([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
                     log, timeout, {**env, **extra_env}, title=title)
    text = run.pop("text")
    run.pop("log")
    return {**run, **outcome_counts(text)}


def settings_conformance(out: Path, deadline: float, smoke: bool, env: dict) -> list[dict]:
    """One conformance run per planner setting (see the module docstring). On the GPU the runs
    go one after another, each spread over the device by xdist; in the CPU smoke run, whose
    runs are mostly start-up on one core, two at a time, each into its own log, the logs then
    appended to settings.log in the settings' order."""
    parallel = ["-n", "8"] if not smoke and _has_xdist() else []
    settings_list = planner_settings()
    scratch = Path(tempfile.mkdtemp(prefix="pk_settings_")) if smoke else None

    def one(i: int) -> dict:
        settings = settings_list[i]
        name = ",".join(f"{k.removeprefix('PAGED_KERNELS_CUDA_')}={v}"
                        for k, v in settings.items())
        left = _remaining(deadline)
        if left < MIN_STEP_SECONDS:
            return {"setting": name, "skipped": "out of time"}
        log = out / "settings.log" if scratch is None else scratch / f"{i}.log"
        run = _pytest(["tests/test_conformance.py", "-k", selection(settings, smoke), *parallel],
                      settings, log, name, min(left, 120), env)
        return {"setting": name, **run}

    with ThreadPoolExecutor(max_workers=2 if smoke else 1) as pool:
        results = list(pool.map(one, range(len(settings_list))))
    if scratch is not None:
        with open(out / "settings.log", "a") as f:
            for i in range(len(settings_list)):
                part = scratch / f"{i}.log"
                if part.exists():
                    f.write(part.read_text(errors="replace"))
        shutil.rmtree(scratch, ignore_errors=True)
    return results


def graph_test(out: Path, deadline: float, smoke: bool, env: dict) -> dict:
    """The CUDA-graph capture-and-replay test of the custom ops (GPU only: skipped in the CPU
    smoke run, where pytest would skip every case)."""
    if smoke:
        return {"skipped": "CUDA graphs: GPU only"}
    left = _remaining(deadline)
    if left < MIN_STEP_SECONDS:
        return {"skipped": "out of time"}
    return _pytest(["tests/test_custom_ops.py", "-k", "cuda_graph", "-rfEs"], {},
                   out / "settings.log", "custom ops: CUDA graph", min(left, 90), env)


def tune(out: Path, deadline: float, smoke: bool, env: dict) -> dict:
    """bench.tune_decode until the deadline; its rows (all, or those timed before the cut) and
    the rule's verdict over them."""
    if smoke:
        return {"skipped": "times CUDA graphs: GPU only"}
    left = _remaining(deadline)
    if left < MIN_STEP_SECONDS:
        return {"skipped": "out of time"}
    rows_file = Path(tempfile.mkdtemp(prefix="pk_tune_")) / "tune.json"
    run = run_logged([sys.executable, "-m", "bench.tune_decode", "--out", str(rows_file)],
                     out / "tune.log", left, env)
    rows = json.loads(rows_file.read_text()) if rows_file.exists() else []
    return {"rc": run["rc"], "seconds": run["seconds"], "rows": rows,
            "verdict": tune_verdict.verdict(rows)}


def _has_xdist() -> bool:
    import importlib.util

    return importlib.util.find_spec("xdist") is not None
