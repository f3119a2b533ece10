"""`python -m bench.gpu_check OUT_DIR [--cpu-smoke] [--budget-s S]`: see the package docstring.

Steps, each bounded in time so the whole run ends inside the budget (9 minutes by default, one
device command on one H200; the report is rewritten after every step, so a run cut short still
leaves one): 1. environment; 2. build the CUDA extension (else the backend compiles at run time
through CuPy); 3. the conformance suite natively, every backend; 4. bench.kernels: the device's
copy bandwidth and matmul rate, then decode at the headline shapes (batch 1/32/128 x context
1k/4k/16k, head size 128, 32 query heads over 8 KV heads, bf16), prefill, a mixed batch and
write_kv per fast backend, next to SDPA on contiguous K/V; 5. FlexAttention over the paged cache,
and decode over a float8_e4m3fn KV cache at the same decode shapes per backend, GB/s counted in
the bytes actually read (kv8_decode.py); 6. bench.tune_decode: the CUDA planner's opt-in settings
timed next to the defaults, and the rule of cuda/paged_cuda/tune_verdict.py applied (tuning.py);
7. each of those settings' native conformance and the CUDA-graph custom-op test; 8. report.md,
report.json, kernels.json and the GB/s plot, the report ending in a short table.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import re
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench import kernels
from bench.gpu_check import kv8_decode, report, tensor_parallel, tuning
from bench.gpu_check.logged import run_logged
from bench.timing import median_seconds


FULL = {"dtype": torch.bfloat16, "quick": False, "repeat": 10,
        "flex": [(32, 1024), (32, 4096), (32, 16384)],
        "conformance_timeout": 150, "build_timeout": 150, "budget_s": 540}
SMOKE = {"dtype": torch.float32, "quick": True, "repeat": 3, "flex": [],
         "conformance_timeout": 300, "build_timeout": 0, "budget_s": 1200}


def environment() -> dict:
    env = {"python": platform.python_version(), "torch": torch.__version__,
           "cuda_available": torch.cuda.is_available(),
           "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())}
    for name in ("triton", "cupy", "numpy", "pybind11", "ninja"):
        try:
            env[name] = getattr(importlib.import_module(name), "__version__", "?")
        except Exception as exc:  # noqa: BLE001 - reported, not fatal
            env[name] = f"missing ({type(exc).__name__})"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(device=props.name, sm_count=props.multi_processor_count,
                   capability=f"{props.major}.{props.minor}",
                   memory_gib=round(props.total_memory / 2**30, 1))
    else:
        env["device"] = f"cpu ({platform.processor() or platform.machine()}, "\
                        f"{os.cpu_count()} cores)"
    return env


def build_cuda(out: Path, timeout: int, env: dict) -> dict:
    """Builds the CUDA extension into a temporary folder and points the loader at it."""
    if timeout <= 0 or not torch.cuda.is_available():
        return {"skipped": "no GPU (the host-execution build is exercised by the test suite)"}
    ext_dir = Path(tempfile.mkdtemp(prefix="pk_cuda_ext_"))  # build products stay out of OUT
    major, minor = torch.cuda.get_device_capability(0)
    cmd = [sys.executable, "-m", "cuda.paged_cuda.build", "--out", str(ext_dir),
           "--archs", f"{major}{minor}", "-j", str(os.cpu_count() or 8)]
    result = run_logged(cmd, out / "build.log", timeout, env)
    text = result.pop("text")
    if result["rc"] == 0:
        env["PAGED_KERNELS_CUDA_EXT_DIR"] = str(ext_dir)
        os.environ["PAGED_KERNELS_CUDA_EXT_DIR"] = str(ext_dir)
    result["ptxas"] = report.ptxas_summary(text)
    return result


def conformance(out: Path, timeout: int, smoke: bool, env: dict) -> dict:
    """The conformance and cache-op suites, verbose, streamed to a log that survives a timeout."""
    cmd = [sys.executable, "-m", "pytest", "tests/test_conformance.py",
           "tests/test_cache_ops.py", "-v", "-p", "no:cacheprovider", "-k", "not cuda-host"]
    if smoke:
        cmd[-1] = "reference and (decode or mixed or write_kv)"
    elif importlib.util.find_spec("xdist") is not None:
        cmd += ["-n", "8"]
    result = run_logged(cmd, out / "conformance.log", timeout, env)
    text = result.pop("text")
    result["by_backend"] = report.count_outcomes(text)
    result["failures"] = re.findall(r"^(?:\[gw\d+\] )?(?:FAILED|ERROR) (\S+)", text, re.M)[:20] \
        or re.findall(r"(\S+) (?:FAILED|ERROR)", text)[:20]
    return result


def measure(cfg: dict, device: str, out: Path) -> dict:
    """Ceilings and the kernel benchmarks (bench.kernels) for every fast backend, then the
    FlexAttention baseline; writes kernels.json and the GB/s plot next to the report."""
    # the CPU smoke run exercises the script's code paths; interpreters time nothing useful
    backends = kernels.default_backends(device) if device == "cuda" else ["reference"]
    print(kernels.table_header(device == "cuda"), flush=True)
    report = kernels.run(backends, device, cfg["dtype"], quick=cfg["quick"], repeat=cfg["repeat"],
                         cuda_graph=device == "cuda",
                         on_result=lambda r: print(kernels.format_row(r), flush=True))
    report["backends"] = backends
    report["flex"] = flex_rows(cfg, device, report["ceilings"])
    kernels.write_outputs(report, out)
    return report


def flex_rows(cfg: dict, device: str, ceilings: dict) -> list[dict]:
    """FlexAttention over the paged cache at the decode shapes of `cfg["flex"]`."""
    from bench.gpu_check import flex_paged

    if not flex_paged.flex_available():
        return [{"backend": "flex-paged", "error": "torch has no flex_attention"}]
    rows = []
    for batch, context in cfg["flex"]:
        shape = kernels.Shape("decode", batch, context)
        p = kernels._problem(shape, cfg["dtype"], device, seed=0)
        row: dict = {"backend": "flex-paged", "kind": "decode", "batch": batch,
                     "context": context, "q_len": 1}
        errors = []
        for options in (None, {"BLOCK_N": shape.block_size}):
            try:
                fn = flex_paged.flex_decode(p, options)
                fn()
                prepared = kernels.Prepared(fn, p.bytes_moved(), p.flops())
                seconds = median_seconds(fn, device, repeat=cfg["repeat"])
                row.update(kernels.metrics(prepared, seconds, ceilings), kernel_options=options)
                if device == "cuda":
                    row.update(kernels.graph_metrics(prepared, cfg["repeat"], ceilings))
                break
            except Exception as exc:  # noqa: BLE001 - a baseline that fails is reported
                errors.append(f"{options}: {type(exc).__name__}: {str(exc)[:200]}")
        else:
            row["error"] = "; ".join(errors)
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__)
    parser.add_argument("out", type=Path, help="folder for report.md, report.json and logs")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="the same steps on the CPU at tiny sizes (CI runs this)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="seconds the whole run may take (default: 540 on a GPU); later "
                             "steps are cut or skipped to stay inside it")
    args = parser.parse_args(argv)
    start = time.time()
    cfg = SMOKE if args.cpu_smoke else FULL
    deadline = start + (args.budget_s if args.budget_s is not None else cfg["budget_s"])
    device = "cuda" if torch.cuda.is_available() and not args.cpu_smoke else "cpu"
    if device == "cpu" and not args.cpu_smoke:
        parser.error("no CUDA device here: use --cpu-smoke")
    args.out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    result: dict = {"mode": "cpu-smoke" if args.cpu_smoke else "gpu", "env": environment()}
    print(f"[gpu_check] {result['env'].get('device')}", flush=True)

    def within(cap: float) -> int:
        return int(max(1, min(cap, deadline - time.time())))

    steps = [
        ("build", lambda: build_cuda(args.out, within(cfg["build_timeout"])
                                     if cfg["build_timeout"] else 0, env)),
        ("conformance", lambda: conformance(args.out, within(cfg["conformance_timeout"]),
                                            args.cpu_smoke, env)),
        ("bench", lambda: measure(cfg, device, args.out)),
        ("kv8", lambda: kv8_decode.rows(cfg, device, result["bench"], deadline - 150)),
        ("tensor_parallel", lambda: tensor_parallel.run(args.out, device, within(150), env)),
        ("tune", lambda: tuning.tune(args.out, deadline - 75, args.cpu_smoke, env)),
        ("settings", lambda: tuning.settings_conformance(args.out, deadline - 15,
                                                         args.cpu_smoke, env)),
        ("graph_test", lambda: tuning.graph_test(args.out, deadline, args.cpu_smoke, env)),
    ]
    for name, step in steps:
        result[name] = step()
        result["seconds"] = round(time.time() - start, 1)
        print(f"[gpu_check] {name} done at {result['seconds']} s: {brief(result[name])}",
              flush=True)
        write_report(result, args.out)
    print(report.markdown(result))
    return 0 if report.healthy(result) else 1


def brief(step_result) -> str:
    """A line about a step's result for the console (the report has the whole of it)."""
    if isinstance(step_result, dict):
        keep = {k: v for k, v in step_result.items() if k in
                ("rc", "seconds", "skipped", "by_backend", "ptxas", "passed", "failed")}
        if "verdict" in step_result:
            keep["rows"] = len(step_result["rows"])
        return str(keep)[:400] if keep else "done"
    return str([brief(x) for x in step_result])[:600]


def write_report(result: dict, out: Path) -> None:
    """report.json and report.md from the steps run so far."""
    (out / "report.json").write_text(json.dumps(result, indent=1, default=str))
    (out / "report.md").write_text(report.markdown(result))


if __name__ == "__main__":
    sys.exit(main())
