"""What a user's `pip install` pulls in: the `gpu` extra names vLLM alone (it ships its own
FlashAttention; flash-attn is an sdist whose build needs torch and compiles for hours), and
nothing on an install path pulls a second torch."""

from __future__ import annotations

from pathlib import Path

import tomllib
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
EXTRAS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]


def _names(extra: str) -> set[str]:
    return {Requirement(r).name.lower() for r in EXTRAS[extra]}


def test_the_gpu_extra_is_vllm_0_33_alone():
    (req,) = (Requirement(r) for r in EXTRAS["gpu"])
    assert req.name == "vllm" and str(req.specifier) == "<0.34,>=0.33.0"


def test_attention_libraries_that_compile_against_torch_stay_off_the_install_paths():
    for extra in ("gpu", "cpu", "test", "models", "bench", "judge", "humaneval", "ray"):
        assert not _names(extra) & {"flash-attn", "xformers", "torch", "torchvision", "torchaudio"}, extra
    assert {"flash-attn", "xformers"} <= _names("kernel-bench")
