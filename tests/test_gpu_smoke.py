"""scripts/gpu_smoke.py, the first command for a user with a GPU: its arguments,
and its one JSON line where it cannot run (no CUDA here)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_smoke.py"


@pytest.fixture(scope="module")
def smoke():
    spec = importlib.util.spec_from_file_location("gpu_smoke", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_arguments(smoke):
    a = smoke.parse_args([])
    assert (a.dtype, a.attention_backend, a.window, a.max_tokens, a.workdir) == (
        "float32",
        "TRITON_ATTN",
        16,
        64,
        None,
    )
    a = smoke.parse_args(["--dtype", "bfloat16", "--attention-backend", "FLASH_ATTN", "--window", "32"])
    assert (a.dtype, a.attention_backend, a.window) == ("bfloat16", "FLASH_ATTN", 32)
    for bad in (["--dtype", "int8"], ["--window", "0"], ["--max-tokens", "-1"]):
        with pytest.raises(SystemExit):
            smoke.parse_args(bad)


def test_without_a_gpu_it_says_so_in_one_json_line(smoke, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: run the script itself")
    assert smoke.main([]) == 2
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1
    out = json.loads(lines[0])
    assert out["ok"] is False and "no CUDA device" in out["skipped"]
