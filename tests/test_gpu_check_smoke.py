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
