"""A real `python -m engine.serve` in a subprocess on a free loopback port, for the server tests.

`ServerProcess(...).start()` launches it and polls `/health` until 200, remembering every status
it saw on the way (so a test can check the 503s of the loading phase); `stop()` ends it.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from typing import Optional

import httpx

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """One server subprocess; `args` are extra command-line flags. `launcher`: the command
    that starts the server (default `python -m engine.serve`); `host`: the address to bind."""

    def __init__(self, *args: str, env: Optional[dict[str, str]] = None,
                 launcher: Optional[list[str]] = None, host: str = "127.0.0.1") -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.args = ["--host", host, "--port", str(self.port), *args]
        self.launcher = launcher or [sys.executable, "-m", "engine.serve"]
        self.env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}
        self.log = tempfile.NamedTemporaryFile("w+", prefix="serve-", suffix=".log", delete=False)
        self.proc: Optional[subprocess.Popen] = None
        #: (status, JSON body or None) of each /health answer seen while starting.
        self.startup_answers: list[tuple[int, Optional[dict]]] = []
        #: status and body of a POST /v1/completions sent at the first 503 of /health.
        self.early_completion: Optional[tuple[int, dict]] = None

    def start(self, timeout: float = 600.0, early_headers: Optional[dict] = None,
              until_ready: bool = True) -> "ServerProcess":
        """Launches the server; returns once `/health` answers 200, or, with `until_ready`
        False, once it answers at all (the HTTP side is up while the model loads)."""
        self.proc = subprocess.Popen([*self.launcher, *self.args],
                                     cwd=REPO, env=self.env, stdout=self.log,
                                     stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=10.0) as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    text = self.log_text()
                    self.stop()
                    raise RuntimeError(f"server exited with {self.proc.returncode}:\n{text}")
                try:
                    r = client.get(f"{self.base_url}/health")
                except httpx.TransportError:
                    time.sleep(0.05)
                    continue
                self.startup_answers.append((r.status_code, _json_or_none(r)))
                if r.status_code == 200 or not until_ready:
                    return self
                if self.early_completion is None:
                    e = client.post(f"{self.base_url}/v1/completions",
                                    json={"prompt": "hi", "max_tokens": 1},
                                    headers=early_headers or {})
                    self.early_completion = (e.status_code, _json_or_none(e))
                time.sleep(0.05)
        text = self.log_text()
        self.stop()
        raise TimeoutError(f"server not healthy after {timeout} s:\n{text}")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_text(self) -> str:
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.log.close()
        if os.path.exists(self.log.name):
            os.unlink(self.log.name)


def _json_or_none(response: httpx.Response) -> Optional[dict]:
    try:
        return response.json()
    except ValueError:
        return None
