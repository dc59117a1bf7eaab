"""A `parse-vllm serve` child process for tests and scripts: started in its own session,
ready once GET /health answers 200, stopped (SIGINT, then SIGKILL of its process group)
whatever happens -- also when the process that started it is killed (SIGKILL, a timeout):
a watcher process, a child of the starter in a session of its own, waits for the starter's
death and then ends the server's whole process group (SIGTERM, then SIGKILL).

Why a watcher rather than PR_SET_PDEATHSIG on the server itself: the parent-death signal
reaches only the direct child, not the engine processes it starts, and it fires when the
*thread* that started the child ends, which would kill a server started from a worker
thread. The watcher is woken by that signal (Linux) but only acts once its parent process
is really gone (getppid changes), and polls getppid where prctl is missing. Its own
session keeps it out of signals sent to the starter's process group (`timeout -s KILL`,
Ctrl-C), which it has to outlive.

Standard library only: tests, the load test and the core benchmark all use it, and none
of them should depend on which HTTP client the others import.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
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
        self.watcher: subprocess.Popen | None = None

    def __enter__(self) -> ServerProcess:
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            self.cmd, stdout=self._log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
        )
        try:
            self.watcher = subprocess.Popen(
                [sys.executable, __file__, "--watch", str(self.proc.pid), str(os.getpid())],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                start_new_session=True,
            )
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
            time.sleep(0.25)  # a server is ready within a poll of its start, not a second later
        raise ServerStartError(f"server did not answer /health in {self.timeout:.0f} s:\n{self.log_tail()}")

    def log_tail(self, chars: int = 4000) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-chars:]

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            # SIGINT lets vLLM shut its engine down; a starter that ignores SIGINT (a script
            # run in the background by a shell) passed the ignoring on to the server, which
            # would wait out the minute below: SIGTERM, which vLLM handles the same way
            ignored = signal.getsignal(signal.SIGINT) == signal.SIG_IGN
            self.proc.send_signal(signal.SIGTERM if ignored else signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if self.proc is not None:
            _kill_group(self.proc.pid, signal.SIGKILL)  # what the server started and left behind
        if self.watcher is not None and self.watcher.poll() is None:
            self.watcher.kill()
            self.watcher.wait()
        self._log.close()


def _kill_group(pgid: int, sig: int) -> bool:
    """Signal process group `pgid`; False when no process is left in it."""
    try:
        os.killpg(pgid, sig)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:  # only zombies or others' processes left: nothing we can end
        return False


def _set_parent_death_signal(sig: int) -> None:
    """prctl(PR_SET_PDEATHSIG, sig) where the C library has it (Linux); else nothing."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, sig, 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def watch(pgid: int, parent: int, grace: float = 10.0) -> None:
    """The watcher's body: wait until `parent` is no longer this process's parent, then end
    process group `pgid` (SIGTERM, so vLLM can stop its engine processes; SIGKILL after
    `grace` seconds)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    _set_parent_death_signal(signal.SIGTERM)
    while os.getppid() == parent:  # checked after prctl: a parent that died before it counts
        signal.sigtimedwait({signal.SIGTERM}, 1.0)
    if not _kill_group(pgid, signal.SIGTERM):
        return
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        time.sleep(0.1)
        if not _kill_group(pgid, 0):
            return
    _kill_group(pgid, signal.SIGKILL)


if __name__ == "__main__" and sys.argv[1:2] == ["--watch"]:
    watch(int(sys.argv[2]), int(sys.argv[3]))
