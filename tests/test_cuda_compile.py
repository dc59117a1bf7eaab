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
import re
import shutil
import subprocess
import sysconfig
import time

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TC_CU = os.path.join(ROOT, "csrc", "cuda", "prefix_verify_attention_tc.cu")
# test_tensor_core_kernel_builds_without_spills_and_uses_hmma builds the tensor-core kernel at
# -O3 for every architecture and reads its object; compiling it again at -O0 here tells nothing more
CU_FILES = sorted(set(glob.glob(os.path.join(ROOT, "csrc", "**", "*.cu"), recursive=True)) - {TC_CU})
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


def _disassembler() -> tuple[str, dict] | None:
    """cuobjdump with an nvdisasm beside it (cuobjdump -sass runs nvdisasm): Triton's bundled
    copies (a vLLM dependency), else the nvidia-cuda-cuobjdump/-nvdisasm wheels, else the toolkit's."""
    import importlib.util

    dirs = []
    spec = importlib.util.find_spec("triton")
    if spec is not None and spec.origin:
        dirs.append(os.path.join(os.path.dirname(spec.origin), "backends", "nvidia", "bin"))
    dirs += glob.glob(os.path.join(sysconfig.get_paths()["purelib"], "nvidia", "*", "bin"))
    if NVCC:
        dirs.append(os.path.dirname(NVCC))
    cuobjdump = next((os.path.join(d, "cuobjdump") for d in dirs if os.path.exists(os.path.join(d, "cuobjdump"))), None)
    nvdisasm = next((d for d in dirs if os.path.exists(os.path.join(d, "nvdisasm"))), None)
    if cuobjdump is None or nvdisasm is None:
        return None
    return cuobjdump, dict(os.environ, PATH=nvdisasm + os.pathsep + os.environ.get("PATH", ""))


# SASS of the default build's two major architectures. setup.py DEFAULT_CUDA_ARCHS also has sm_86 and
# sm_89: their PTX is compute_80's (no code depends on the minor version: no numeric __CUDA_ARCH__ test
# in csrc), their register file and per-thread limit sm_80's, and their smaller shared memory (99 KB) is
# checked by the header's static_asserts (TcSmem) in any build. Lowering it for them took 20 of this
# test's 87 s here (two ptxas runs); scripts/gpu_check.sh builds for the GPU it runs on.
TC_ARCHS = ("80", "90")


@pytest.mark.skipif(NVCC is None, reason="nvcc not found (neither $CUDA_HOME/bin/nvcc nor nvcc on PATH)")
def test_tensor_core_kernel_builds_without_spills_and_uses_hmma(tmp_path):
    """The tensor-core kernel as setup.py builds it (-O3), SASS for sm_80 and sm_90 (TC_ARCHS):
    ptxas reports 0 spill bytes and no stack frame for every kernel instance (each head size x
    bf16/fp16, and the merge), the shared memory of one CTA fits the 99 KB of sm_86/89 (the
    header's static_asserts and TcSmem), and the SASS runs its products on tensor cores
    (HMMA.16816.F32.BF16 and .F32 for fp16) with no local-memory traffic (LDL/STL)."""
    cu = TC_CU
    obj = tmp_path / "tc.o"
    cmd = [
        NVCC,
        "-c",
        cu,
        "-o",
        str(obj),
        "-std=c++17",
        "-Xcompiler",
        "-fPIC",
        "--expt-relaxed-constexpr",
        "-O3",
        "--use_fast_math",
        "-diag-suppress",
        "3306",
        "-Xcompiler",
        "-Wno-c++20-extensions",
        "-Xptxas",
        "-v",
        "--threads",
        os.environ.get("PARSE_VLLM_NVCC_THREADS", "2"),
        f"-I{sysconfig.get_paths()['include']}",
    ]
    cmd += [arg for a in TC_ARCHS for arg in ("-gencode", f"arch=compute_{a},code=sm_{a}")]
    cmd += [f"-I{p}" for p in _torch_includes()]
    if not os.path.exists(os.path.join(_torch_includes()[0], "c10", "cuda", "impl", "cuda_cmake_macros.h")):
        cmd.append("-DC10_CUDA_NO_CMAKE_CONFIGURE_FILE")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stderr[-6000:]
    info = r.stderr + r.stdout
    # ptxas -v: per entry function "Compiling entry function '<name>' for 'sm_XX'", then its
    # "N bytes stack frame, N bytes spill stores, N bytes spill loads" and "Used N registers"
    entries = re.findall(r"Compiling entry function '([^']+)' for 'sm_(\d+)'", info)
    spills = re.findall(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", info)
    assert len(entries) == len(spills) > 0, info[-3000:]
    per_arch = {a: 0 for a in TC_ARCHS}
    bad = []
    for (name, arch), (stack, st, ld) in zip(entries, spills):
        per_arch[arch] += 1
        if (int(stack), int(st), int(ld)) != (0, 0, 0):
            bad.append(f"sm_{arch} {name}: {stack} B stack, {st} B spill stores, {ld} B spill loads")
    assert not bad, "\n".join(bad)
    # 6 head sizes x 2 dtypes x (kernel + merge) per architecture
    assert per_arch == {a: 24 for a in TC_ARCHS}, per_arch
    dis = _disassembler()
    if dis is None:
        pytest.skip("spills checked; no cuobjdump + nvdisasm here to read the SASS")
    cuobjdump, env = dis
    for a in TC_ARCHS:
        sass = subprocess.run(
            [cuobjdump, "-sass", "-arch", f"sm_{a}", str(obj)], capture_output=True, text=True, env=env, timeout=600
        )
        assert sass.returncode == 0, sass.stderr[-2000:]
        assert re.search(r"HMMA\.16816\.F32\.BF16", sass.stdout), f"sm_{a}: no bf16 HMMA in the SASS"
        assert re.search(r"HMMA\.16816\.F32\s", sass.stdout), f"sm_{a}: no fp16 HMMA in the SASS"
        assert not re.search(r"\b(LDL|STL)(\.\w+)*\s", sass.stdout), f"sm_{a}: local-memory traffic in the SASS"
