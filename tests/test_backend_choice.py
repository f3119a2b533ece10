"""How "auto" chooses: fastest first, never an interpreter or emulation, and without loading
(or building) the backends it does not need."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_auto_on_cpu_loads_nothing_past_its_choice():
    script = textwrap.dedent("""
        import torch, paged_kernels as pk
        from paged_kernels import backends
        q = torch.randn(2, 4, 64)
        cache = torch.randn(4, 2, 16, 64)
        table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
        pk.paged_attention(q, cache, cache, table, torch.tensor([20, 3], dtype=torch.int32))
        chosen = backends.resolve_backend("auto", q.device)
        print(chosen.name, sorted(backends._instances))
    """)
    # a minimal environment, but the same HOME (so the same build cache) as the test run, and
    # the interpreter's own bin first: torch's build then runs the same ninja as every other
    # build (ninja of another version discards the build log and rebuilds from scratch)
    env = {"PATH": f"{os.path.dirname(sys.executable)}:/usr/bin:/bin", "TRITON_INTERPRET": "1",
           "PYTHONPATH": str(ROOT), "HOME": os.environ.get("HOME", str(Path.home()))}
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    chosen, loaded = proc.stdout.split(maxsplit=1)
    assert chosen in ("cpu", "reference")
    assert "cuda-host" not in loaded, "auto built the host emulation it never uses"
