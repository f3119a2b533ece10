"""One subprocess of the GPU check, its output streamed to a log file in OUT (so what it printed
survives a timeout or a killed call)."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_logged(cmd: list[str], log: Path, timeout: float, env: dict,
               title: str | None = None) -> dict:
    """Runs `cmd` in the repository root with stdout and stderr to `log`: the log is replaced,
    or, with a `title`, appended to under a `===== title =====` line. Returns rc (124 on
    timeout), seconds, the log's name and `text`, what this run wrote."""
    start = time.time()
    with open(log, "a" if title is not None else "w") as f:
        if title is not None:
            f.write(f"\n===== {title} =====\n")
            f.flush()
        begin = f.tell()
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout,
                                cwd=ROOT, env=env).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    with open(log, errors="replace") as f:
        f.seek(begin)
        text = f.read()
    return {"rc": rc, "seconds": round(time.time() - start, 1), "log": log.name, "text": text}
