"""`ruff check` and `ruff format --check` over the package, the tests and the scripts,
with the rules in pyproject.toml ([tool.ruff]); ruff comes with the `test` extra."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PATHS = ["parse_vllm", "tests", "scripts"]


def _ruff() -> list[str]:
    exe = Path(sys.executable).with_name("ruff")
    if exe.exists():
        return [str(exe)]
    found = shutil.which("ruff")
    assert found, "ruff is not installed: pip install -e '.[test]'"
    return [found]


@pytest.mark.parametrize("args", [["check"], ["format", "--check"]], ids=["check", "format"])
def test_ruff(args):
    r = subprocess.run([*_ruff(), *args, *PATHS], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, f"ruff {' '.join(args)} failed:\n{r.stdout}{r.stderr}"
