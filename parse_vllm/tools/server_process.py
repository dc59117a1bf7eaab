"""A `parse-vllm serve` child process for tests and scripts: started in its own session,
ready once GET /health answers 200, stopped (SIGINT, then SIGKILL of its process group)
whatever happens.

Standard library only: tests, the load test and the core benchmark all use it, and none
of them should depend on which HTTP client the others import.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now (the OS picks it; another process may take it later)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ServerStartError(RuntimeError):
    """The server exited or did not answer /health in time; the message ends with its log."""


class ServerProcess:
    """`with ServerProcess(cmd, log_path, base_url) as srv:` starts `cmd` (a full
    `parse-vllm serve ...` argv, its port inside `base_url`), returns once
    `{base_url}/health` answers 200, and stops the server on exit."""

    def __init__(
        self,
        cmd: list[str],
        log_path: Path,
        base_url: str,
        env: dict[str, str] | None = None,
        timeout: float = 600,
    ):
        self.cmd = cmd
        self.log_path = Path(log_path)
        self.base = base_url.rstrip("/")
        self.env = env
        self.timeout = timeout
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> ServerProcess:
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            self.cmd, stdout=self._log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
        )
        try:
            self._wait_healthy()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _wait_healthy(self) -> None:
        deadline = time.time() + self.timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise ServerStartError(f"server exited {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.base + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass  # not listening yet, or still loading
            time.sleep(1)
        raise ServerStartError(f"server did not answer /health in {self.timeout:.0f} s:\n{self.log_tail()}")

    def log_tail(self, chars: int = 4000) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-chars:]

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # lets vLLM shut its engine down
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()
