"""ServerProcess, the one /health wait of tests and scripts, against stand-in servers."""

import socket
import sys
import time

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
