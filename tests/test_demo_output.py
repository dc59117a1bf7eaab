"""The demo's terminal shows PARSE's lines: vLLM's log, warnings, progress bars and native
libraries' stderr go to the log file it names; and it says plainly when memory is short."""

import subprocess
import sys

from parse_vllm.tools.demo import PEAK_RSS, mem_available, memory_shortfall

# Routes the output, then writes as vLLM (imported afterwards, so it sets its loggers up
# from the environment), Python warnings, tqdm, a C library and the demo itself would.
SCRIPT = """
import os, sys, warnings
from pathlib import Path
from parse_vllm.tools.demo import begin
begin("smollm2", Path(sys.argv[1]))
from vllm.logger import init_logger
log = init_logger("vllm.some_module")
log.info("vllm info line")
log.warning("vllm warning line")
warnings.warn("a deprecation line", DeprecationWarning, stacklevel=1)
warnings.warn("a user warning line", stacklevel=1)
from tqdm import tqdm
for _ in tqdm(range(3), desc="a progress bar"):
    pass
os.write(2, b"native library line\\n")
log.error("vllm error line")
print("PARSE story line", flush=True)
"""


def test_vllm_output_goes_to_the_named_log(tmp_path):
    log = tmp_path / "run" / "vllm.log"
    r = subprocess.run(
        [sys.executable, "-W", "always", "-c", SCRIPT, str(log)], capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [f"vLLM's own log: {log}", "PARSE story line"]
    assert r.stderr.strip() == "vllm error line"  # errors still reach the terminal
    text = log.read_text()
    for line in ("vllm info line", "vllm warning line", "a deprecation line", "a user warning line"):
        assert line in text
    assert "native library line" in text and "vllm error line" in text
    assert "a progress bar" not in r.stderr


def test_a_crash_shows_its_traceback_on_the_terminal(tmp_path):
    log = tmp_path / "vllm.log"
    script = "import sys; from parse_vllm.tools.demo import begin; begin('x', sys.argv[1]); raise ValueError('boom')"
    r = subprocess.run([sys.executable, "-c", script, str(log)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert "ValueError: boom" in r.stderr and "ValueError: boom" in log.read_text()


def test_mem_available_reads_meminfo(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemFree:         1000000 kB\nMemAvailable:   12345678 kB\n")
    assert mem_available(meminfo) == 12345678 * 1024
    meminfo.write_text("MemTotal:       24000000 kB\n")
    assert mem_available(meminfo) is None
    assert mem_available(tmp_path / "missing") is None


def test_the_memory_check_speaks_only_when_short():
    need = PEAK_RSS["coder"]
    assert memory_shortfall(need, int(need) + 1) is None
    assert memory_shortfall(need, None) is None
    short = memory_shortfall(need, 8_000_000_000)
    assert "8.0 GB of memory available" in short and "peaks at 16.2 GB" in short
