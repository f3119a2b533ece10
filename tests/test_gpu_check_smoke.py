"""CI runs the one-shot GPU check end to end on the CPU at tiny sizes, so the script is never found
broken on the day a GPU is there."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

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
    last = (tmp_path / "report.md").read_text().rstrip().splitlines()[-3:]
    assert last[-1] == "```" and all(len(line) <= 80 for line in last)


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
