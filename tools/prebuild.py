"""`python -m tools.prebuild`: builds every C++ extension the package builds on first use, two at
a time (or `--jobs N`), so that a fresh machine's set-up pays for them on all its cores instead of
the first test or request that needs each one paying alone.

Each build runs in its own process through the same loader its user calls (the same build cache,
keyed by source, headers and flags), so a later load finds it built. A build that fails is
reported and the exit status stays 0: the first use reports the compiler's error again, with the
context of its caller.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

#: What to build: a name and the statement that loads (and, the first time, builds) it. The
#: slowest first, so that the pool ends on short builds.
BUILDS = (
    ("cpu backend", "from cpu_impl import build; build.load()"),
    ("cuda-host emulation", "from cuda.paged_cuda import host_build; host_build.host_module()"),
    ("engine layer ops", "from engine.model import layer_ops; assert layer_ops.native()"),
    ("engine int8 matmul", "from engine import native_build; native_build.load_int8()"),
    ("engine GGUF matmul", "from engine import native_build; native_build.load_quant()"),
    ("engine tiled bf16 matmul", "from engine import native_build; native_build.load_tiled()"),
)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def build(name: str, statement: str) -> tuple[str, int, float, str]:
    """Runs one build in a fresh interpreter; (name, exit status, seconds, stderr tail)."""
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", statement], cwd=ROOT, capture_output=True,
                          text=True)
    return name, proc.returncode, time.monotonic() - start, proc.stderr[-1500:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.prebuild", description=__doc__)
    parser.add_argument("--jobs", type=int, default=max(1, min(os.cpu_count() or 1, 4)),
                        help="builds at a time (default: the CPU count, at most 4)")
    args = parser.parse_args(argv)
    with ThreadPoolExecutor(args.jobs) as pool:
        for name, rc, seconds, err in pool.map(lambda b: build(*b), BUILDS):
            status = "ok" if rc == 0 else f"FAILED (exit {rc}); its first use will say why"
            print(f"prebuild: {name}: {status} in {seconds:.0f} s", flush=True)
            if rc != 0:
                print(err, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
