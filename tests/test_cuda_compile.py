"""CI proof that the CUDA source compiles: nvcc turns every csrc/**/*.cu into an
object file, against the installed torch's headers, for sm_80 and sm_90.

Runs without a GPU and without a CUDA build of torch: the CPU wheel ships the
c10/ATen CUDA headers except one generated file (c10/cuda/impl/
cuda_cmake_macros.h, whose only content is `#define C10_CUDA_BUILD_SHARED_LIBS`,
a Windows export switch); C10_CUDA_NO_CMAKE_CONFIGURE_FILE tells c10 not to
include it.  Device code is compiled at -O0 (cicc and ptxas) to keep the test
well under two minutes on two cores; the optimised build is what setup.py does.
Skipped, with the reason, when nvcc is absent.

Knobs: PARSE_VLLM_COMPILE_TEST_ARCHS (default "80,90"), PARSE_VLLM_NVCC_THREADS (default 1).
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sysconfig
import time

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CU_FILES = sorted(glob.glob(os.path.join(ROOT, "csrc", "**", "*.cu"), recursive=True))
assert CU_FILES, "no .cu files under csrc/"  # else the compile test below would have no cases


def _nvcc() -> str | None:
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")):
        if home and os.path.exists(os.path.join(home, "bin", "nvcc")):
            return os.path.join(home, "bin", "nvcc")
    return shutil.which("nvcc")


NVCC = _nvcc()


def _torch_includes() -> list[str]:
    from torch.utils.cpp_extension import include_paths

    return include_paths()


@pytest.mark.skipif(NVCC is None, reason="nvcc not found (neither $CUDA_HOME/bin/nvcc nor nvcc on PATH)")
@pytest.mark.parametrize("cu", CU_FILES, ids=[os.path.relpath(p, ROOT) for p in CU_FILES])
def test_cu_compiles_to_object(cu, tmp_path):
    archs = os.environ.get("PARSE_VLLM_COMPILE_TEST_ARCHS", "80,90").replace(";", ",").split(",")
    cmd = [
        NVCC,
        "-c",
        cu,
        "-o",
        str(tmp_path / "out.o"),
        "-std=c++17",
        "-Xcompiler",
        "-fPIC",
        "--expt-relaxed-constexpr",
        "-O0",
        "-Xcicc",
        "-O0",
        "-Xptxas",
        "-O0",
        "--threads",
        os.environ.get("PARSE_VLLM_NVCC_THREADS", "1"),
        "-diag-suppress",
        "3306",
        "-Xcompiler",
        "-Wno-c++20-extensions",
        f"-I{sysconfig.get_paths()['include']}",
    ]
    for a in archs:
        a = a.strip().replace(".", "")
        cmd += ["-gencode", f"arch=compute_{a},code=sm_{a}"]
    cmd += [f"-I{p}" for p in _torch_includes()]
    macros = os.path.join(_torch_includes()[0], "c10", "cuda", "impl", "cuda_cmake_macros.h")
    if not os.path.exists(macros):  # CPU wheel of torch: see the module docstring
        cmd.append("-DC10_CUDA_NO_CMAKE_CONFIGURE_FILE")
    t0 = time.time()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    took = time.time() - t0
    assert r.returncode == 0, (
        f"nvcc failed ({took:.0f}s) for torch {torch.__version__}:\n{' '.join(cmd)}\n{r.stderr[-6000:]}"
    )
    obj = tmp_path / "out.o"
    assert obj.exists() and obj.stat().st_size > 0
    # the object carries device code for every requested arch
    listing = (
        subprocess.run(
            [os.path.join(os.path.dirname(NVCC), "cuobjdump"), "--list-elf", str(obj)], capture_output=True, text=True
        )
        if os.path.exists(os.path.join(os.path.dirname(NVCC), "cuobjdump"))
        else None
    )
    if listing is not None and listing.returncode == 0:
        for a in archs:
            assert f"sm_{a.strip().replace('.', '')}" in listing.stdout, listing.stdout
    print(f"nvcc compiled {os.path.relpath(cu, ROOT)} for sm_{', sm_'.join(archs)} in {took:.0f}s")
