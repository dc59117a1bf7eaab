"""ServerProcess, the one /health wait of tests and scripts, against stand-in servers."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from parse_vllm.tools.server_process import ServerProcess, ServerStartError

# A server that answers /health 404 until `ready_after` seconds have passed, then 200.
STAND_IN = """
import http.server, sys, time
start, ready_after = time.time(), float(sys.argv[2])
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        ok = self.path == "/health" and time.time() - start >= ready_after
        self.send_response(200 if ok else 404)
        self.end_headers()
    def log_message(self, *a):
        pass
print("stand-in listening", flush=True)
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_waits_for_health_then_stops_the_server(tmp_path):
    port = _port()
    cmd = [sys.executable, "-c", STAND_IN, str(port), "1.5"]
    t = time.time()
    with ServerProcess(cmd, tmp_path / "log", f"http://127.0.0.1:{port}", timeout=30) as server:
        assert time.time() - t >= 1.5  # not before /health said 200
        assert server.proc.poll() is None
        assert "stand-in listening" in server.log_tail()
    assert server.proc.poll() is not None  # stopped on exit


def test_a_starter_that_ignores_sigint_still_stops_its_server_at_once(tmp_path):
    """A script run in the background by a shell ignores SIGINT, and so does the server it
    starts (an ignored signal stays ignored across exec): the stop must not wait out its
    minute for a SIGINT the server never sees."""
    port = _port()
    cmd = [sys.executable, "-c", STAND_IN, str(port), "0"]
    saved = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        server = ServerProcess(cmd, tmp_path / "log", f"http://127.0.0.1:{port}", timeout=30).__enter__()
        start = time.monotonic()
        server.__exit__(None, None, None)
        took = time.monotonic() - start
    finally:
        signal.signal(signal.SIGINT, saved)
    assert server.proc.returncode == -signal.SIGTERM and took < 10, (server.proc.returncode, took)


def test_a_server_that_exits_gives_its_log(tmp_path):
    cmd = [sys.executable, "-c", "import sys; print('bad --flag'); sys.exit(3)"]
    with pytest.raises(ServerStartError, match=r"(?s)exited 3.*bad --flag"):
        with ServerProcess(cmd, tmp_path / "log", f"http://127.0.0.1:{_port()}", timeout=30):
            pass


def test_a_server_that_never_gets_healthy_is_stopped(tmp_path):
    port = _port()
    cmd = [sys.executable, "-c", STAND_IN, str(port), "3600"]
    server = ServerProcess(cmd, tmp_path / "log", f"http://127.0.0.1:{port}", timeout=3)
    with pytest.raises(ServerStartError, match="did not answer /health in 3 s"):
        server.__enter__()
    assert server.proc.poll() is not None


# A server that starts a child of its own (as `parse-vllm serve` starts engine processes),
# writes both pids to argv[2] and answers /health 200.
FAMILY_STAND_IN = """
import http.server, json, os, subprocess, sys
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
with open(sys.argv[2] + ".tmp", "w") as f:
    json.dump({"server": os.getpid(), "child": child.pid}, f)
os.rename(sys.argv[2] + ".tmp", sys.argv[2])
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def _started(pid: int) -> str | None:
    """The start time of live process `pid` (/proc/PID/stat), None if it is gone or a zombie."""
    try:
        stat = open(f"/proc/{pid}/stat").read()
    except FileNotFoundError:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # after "pid (comm)": state is field 3, starttime 22
    return None if fields[0] in "ZX" else fields[19]


def _wait_file(path, timeout: float):
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} not written in {timeout} s"
        time.sleep(0.1)
    return json.loads(path.read_text())


def _assert_all_gone(pids: dict[str, int], started: dict[str, str], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    left = dict(pids)
    while left and time.monotonic() < deadline:
        left = {k: p for k, p in left.items() if _started(p) == started[k]}
        time.sleep(0.1)
    assert not left, f"still running {timeout} s after: {left}"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_killing_pytest_ends_the_server_it_started(tmp_path):
    """A pytest run holding a server through conftest's running_server (the fixtures' way)
    is killed with SIGKILL, which it cannot handle: the server, the child the server
    started and the watcher are all gone soon after."""
    port, pids_file, ready = _port(), tmp_path / "pids.json", tmp_path / "ready.json"
    cmd = [sys.executable, "-c", FAMILY_STAND_IN, str(port), str(pids_file), "--port", str(port)]
    inner = tmp_path / "test_inner.py"
    inner.write_text(
        f"""
import json, os, sys, time
sys.path.insert(0, {str(Path(__file__).parent)!r})
from conftest import running_server
from parse_vllm.tools import server_process

def test_holds_a_server(tmp_path):
    held = []
    real = server_process.ServerProcess.__enter__
    def enter(self):
        held.append(real(self))
        return held[-1]
    server_process.ServerProcess.__enter__ = enter
    with running_server({cmd!r}, tmp_path / "server.log", None, timeout=60):
        with open({str(ready)!r}, "w") as f:
            json.dump({{"watcher": held[0].watcher.pid}}, f)
        time.sleep(600)
"""
    )
    pytest_run = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", str(inner)],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        pids = {**_wait_file(pids_file, 120), **_wait_file(ready, 120)}
        started = {k: _started(p) for k, p in pids.items()}
        assert all(started.values()), started
        os.kill(pytest_run.pid, signal.SIGKILL)
        pytest_run.wait()
        _assert_all_gone(pids, started, timeout=30)
    finally:
        if pytest_run.poll() is None:
            pytest_run.kill()
            pytest_run.wait()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_normal_stop_ends_the_servers_children_and_the_watcher(tmp_path):
    port, pids_file = _port(), tmp_path / "pids.json"
    cmd = [sys.executable, "-c", FAMILY_STAND_IN, str(port), str(pids_file)]
    with ServerProcess(cmd, tmp_path / "log", f"http://127.0.0.1:{port}", timeout=30) as server:
        pids = {**_wait_file(pids_file, 10), "watcher": server.watcher.pid}
        started = {k: _started(p) for k, p in pids.items()}
        assert all(started.values()), started
    _assert_all_gone(pids, started, timeout=10)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_server_started_from_a_thread_outlives_the_thread(tmp_path):
    """The parent-death signal fires when the starting thread ends; the server must stay
    until its starter process goes or stops it."""
    port = _port()
    server = ServerProcess(
        [sys.executable, "-c", STAND_IN, str(port), "0"], tmp_path / "log", f"http://127.0.0.1:{port}", timeout=30
    )
    t = threading.Thread(target=server.__enter__)
    t.start()
    t.join()
    try:
        time.sleep(2.5)  # the watcher wakes at the thread's end and checks within 1 s
        assert server.proc.poll() is None
        assert server.watcher.poll() is None
    finally:
        server.__exit__(None, None, None)
    assert server.proc.poll() is not None and server.watcher.poll() is not None
