"""CI runs the one-shot GPU check end to end on the CPU at tiny sizes, so the script is never found
broken on the day a GPU is there."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench.gpu_check import report, tuning
from cuda.paged_cuda import tune_verdict

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_cpu_smoke(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "bench.gpu_check", str(tmp_path), "--cpu-smoke"],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "report.json").read_text())
    assert result["conformance"]["by_backend"]["reference"]["passed"] > 0
    rows = result["bench"]["results"]
    backends = {r["backend"] for r in rows if "seconds" in r}
    assert {"reference", "torch-sdpa"} <= backends
    assert all(r.get("rel_err_vs_sdpa", 0) < 1e-5 for r in rows if r["backend"] == "reference")
    assert (tmp_path / "kernels.json").exists()
    kv8 = result["kv8"]  # decode over a float8_e4m3fn cache, checked against SDPA
    assert kv8 and all(r["backend"] == "reference" and r["rel_err_vs_sdpa"] < 1e-5 for r in kv8)
    assert "## Decode over a float8_e4m3fn KV cache" in (tmp_path / "report.md").read_text()
    last = (tmp_path / "report.md").read_text().rstrip().splitlines()[-3:]
    assert last[-1] == "```" and all(len(line) <= 80 for line in last)
    # every planner setting tune_decode times had its kernels' conformance run (cuda-host here)
    settings = result["settings"]
    assert len(settings) == len(tuning.planner_settings()) >= 5
    assert all(r["rc"] == 0 and r["passed"] > 0 and not r.get("failed") for r in settings)
    assert result["tune"] == {"skipped": "times CUDA graphs: GPU only"}
    assert result["tensor_parallel"]["skipped"].startswith("no GPU")
    assert "## Tensor parallelism (NCCL" in (tmp_path / "report.md").read_text()
    # at most 8 files come back from a device call
    assert len([f for f in tmp_path.iterdir()]) <= 8 - 2  # + build.log and tune.log on a GPU


def test_report_of_a_cut_run_renders_and_ends_with_the_rule():
    """A run stopped after any step still renders; with tune rows, the rule's lines close the
    report's summary (the part a device call's reply shows)."""
    result = {"mode": "gpu", "env": {"device": "H200", "date_utc": "now", "python": "3",
                                     "torch": "2", "triton": "3", "cupy": "-", "numpy": "2"},
              "seconds": 1.0}
    assert report.markdown(result).rstrip().endswith("```")
    row = {"kind": "decode", "batch": 32, "context": 4096, "q_len": 1, "us": 150.0,
           "frac_copy": 0.9, "rel_err_vs_sdpa": 3e-3}
    rows = [{**row, "variant": "cuda", "us": 160.0, "frac_copy": 0.84},
            {**row, "variant": "cuda:PAGED_KERNELS_CUDA_DECODE_TILE=32"}]
    result["tune"] = {"rc": 0, "seconds": 9.0, "rows": rows, "verdict": tune_verdict.verdict(rows)}
    text = report.markdown(result)
    last = text.rstrip().splitlines()
    assert last[-1] == "```" and last[-5] == "rule: decode -> cuda:DECODE_TILE=32"
    assert "85% target (b>=32, ctx>=4096): cuda 84.0%, chosen 90.0%" in last
    assert "| cuda:PAGED_KERNELS_CUDA_DECODE_TILE=32 | decode | 32 | 4096 | 1 | 150.0 |" in text


def test_ptxas_summary_reads_both_log_formats():
    """The report counts kernels, registers and spills from ptxas' own -v lines and from the table
    that `python -m cuda.paged_cuda.build` prints (the format of the first H200 build log)."""
    from bench.gpu_check.report import ptxas_summary

    ptxas = ("ptxas info    : Used 40 registers, 0 bytes spill stores, 0 bytes spill loads\n"
             "ptxas info    : Used 96 registers, 8 bytes spill stores, 4 bytes spill loads\n")
    table = ("arch    regs stack spill st/ld  kernel\n"
             "sm_90     26     0     0/0      void pk_copy_blocks_kernel<uint2>(PkCopyParams)\n"
             "sm_80    255    16    12/4      void pk_decode_kernel<__half, 112, 8>(P)\n")
    assert ptxas_summary(ptxas) == {"kernels": 2, "max_registers": 96, "kernels_spilling": 1}
    assert ptxas_summary(table) == {"kernels": 2, "max_registers": 255, "kernels_spilling": 1}
    assert ptxas_summary("") == {"kernels": 0, "max_registers": 0, "kernels_spilling": 0}


def test_each_setting_reaches_the_planner_of_its_conformance_run(tmp_path, monkeypatch):
    """A setting the planner refuses fails its run: the setting is in the tests' environment."""
    import os
    import time

    monkeypatch.setattr(tuning, "planner_settings",
                        lambda: [{"PAGED_KERNELS_CUDA_DECODE_TILE": "33"}])
    [run] = tuning.settings_conformance(tmp_path, time.time() + 300, True, dict(os.environ))
    assert run["setting"] == "DECODE_TILE=33" and run["rc"] == 1 and run["failed"] > 0
    assert "===== DECODE_TILE=33 =====" in (tmp_path / "settings.log").read_text()
