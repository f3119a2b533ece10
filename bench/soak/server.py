"""The server under soak: a real `python -m engine.serve` subprocess on a free loopback port,
with the debug endpoints on, a small KV pool and one preemption mode; its resident memory read
with psutil.

The soak serves float32 with dense weights (`--dtype float32 --quantization none`): greedy
answers must not depend on how requests happen to be batched, and in bfloat16, or with the
GGUF blocks used only for steps of few tokens, a near-tie between two tokens can resolve
differently in another batch.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from typing import IO, Any, Optional

import httpx
import psutil

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SoakServer:
    """One server; `flags` are `engine.serve` flags added to the soak's own; its log goes to
    `log_path`."""

    def __init__(self, mode: str, num_kv_blocks: int, max_model_len: int, log_path: str,
                 flags: tuple[str, ...] = ()) -> None:
        self.mode = mode
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.args = ["--host", "127.0.0.1", "--port", str(self.port),
                     "--enable-debug-endpoints", "--num-kv-blocks", str(num_kv_blocks),
                     "--preemption-mode", mode, "--max-model-len", str(max_model_len),
                     "--dtype", "float32", "--quantization", "none", "--num-threads", "1",
                     "--log-level", "warning", *flags]
        self.proc: Optional[subprocess.Popen] = None
        self._log: Optional[IO[str]] = None

    @property
    def command(self) -> str:
        return " ".join(["python", "-m", "engine.serve", *self.args])

    async def start(self, timeout: float) -> float:
        """Starts the server and waits for `/health` 200; returns the seconds it took."""
        t0 = time.monotonic()
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "engine.serve", *self.args],
                                     cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        async with httpx.AsyncClient(base_url=self.base_url, timeout=5.0) as http:
            while time.monotonic() - t0 < timeout:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"the {self.mode} server exited with "
                                       f"{self.proc.returncode}; see {self.log_path}")
                try:
                    if (await http.get("/health")).status_code == 200:
                        return time.monotonic() - t0
                except httpx.TransportError:
                    pass
                await asyncio.sleep(0.1)
        raise TimeoutError(f"the {self.mode} server was not healthy after {timeout:.0f} s; see "
                           f"{self.log_path}")

    def rss_bytes(self) -> Optional[int]:
        """The server process's resident set size, None once it has exited."""
        if self.proc is None or self.proc.poll() is not None:
            return None
        try:
            return int(psutil.Process(self.proc.pid).memory_info().rss)
        except psutil.Error:
            return None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> Optional[int]:
        """SIGTERM, then SIGKILL after 15 s; returns the exit status."""
        code = None
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.terminate()
                try:
                    self.proc.wait(15)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(5)
            code = self.proc.returncode
        if self._log is not None:
            self._log.close()
        return code


def log_tail(path: str, lines: int = 40) -> list[str]:
    """The last `lines` lines of a server log."""
    try:
        with open(path) as f:
            return f.read().splitlines()[-lines:]
    except OSError:
        return []


def summarize_stats(stats: Any) -> dict[str, Any]:
    """The fields of `/internal/stats` the soak reports."""
    keys = ("num_running", "num_waiting", "num_swapped", "num_free_blocks", "num_total_blocks",
            "num_preemptions", "prefix_cache_queries", "prefix_cache_hits")
    return {k: stats.get(k) for k in keys} if isinstance(stats, dict) else {"raw": stats}
