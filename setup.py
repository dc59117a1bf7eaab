"""Build of parse-vllm's compiled op (`parse_vllm._C`).

Project metadata lives in pyproject.toml; this file only adds the C++/CUDA
extension.  Install with

    pip install --no-build-isolation -e .

(`--no-build-isolation`: the op is compiled against the torch that is already
installed; an isolated build environment would fetch a different torch).

What gets built
  * the CPU twin of `torch.ops.parse_vllm.prefix_verify_attention` -- always;
  * the CUDA kernel -- when torch has CUDA (torch.version.cuda) and nvcc is
    found (CUDA_HOME / PATH).  PARSE_VLLM_BUILD_CUDA=0 forces it off, =1 forces
    it on (and fails if it cannot be built).

Knobs (environment variables)
  PARSE_VLLM_BUILD_CUDA   auto (default) | 0 | 1
  PARSE_VLLM_CPU_ISA      auto (default) | avx512 | avx2 | default
                          The CPU twin is compiled for one SIMD flavour; `auto`
                          picks what the build machine's CPU supports (as vLLM's
                          CPU backend does).  Use `default` for a build that must
                          run on any x86-64 / other CPU.
  PARSE_VLLM_CUDA_ARCHS   e.g. "8.0;9.0" (default: TORCH_CUDA_ARCH_LIST, else
                          DEFAULT_CUDA_ARCHS: SASS for Ampere, Ada and Hopper, and PTX of
                          the highest, which newer GPUs (Blackwell) compile at first load).
                          The list is compiled into the op (`ops.cuda_archs()`), and
                          PARSE picks the kernel only on a GPU it covers.
  MAX_JOBS                parallel compile jobs (ninja), default 2
"""

from __future__ import annotations

import importlib.util
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))


DEFAULT_CUDA_ARCHS = "8.0;8.6;8.9;9.0+PTX"


def _log(msg: str) -> None:
    # stderr: pip shows it on failure and with -v; plain `setup.py` shows it always.
    print(f"parse-vllm: {msg}", file=sys.stderr, flush=True)


def _rel(*parts: str) -> str:
    # setuptools wants source paths relative to the project root.
    return os.path.join(*parts)


def _cpu_flags() -> list[str]:
    return (
        sorted(
            {
                f
                for line in open("/proc/cpuinfo", encoding="utf-8", errors="replace")
                if line.startswith("flags")
                for f in line.split(":", 1)[1].split()
            }
        )
        if os.path.exists("/proc/cpuinfo")
        else []
    )


def _compiler_accepts(flags: list[str]) -> bool:
    cxx = os.environ.get("CXX", "c++")
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "t.cpp")
        with open(src, "w") as f:
            f.write("int main() { return 0; }\n")
        try:
            r = subprocess.run([cxx, *flags, src, "-o", os.path.join(d, "t")], capture_output=True, timeout=60)
        except (OSError, subprocess.SubprocessError):
            return False
        return r.returncode == 0


_ISA_FLAGS = {
    "avx512": [
        "-mavx512f",
        "-mavx512bw",
        "-mavx512vl",
        "-mavx512dq",
        "-mavx2",
        "-mfma",
        "-mf16c",
        "-DCPU_CAPABILITY_AVX512",
        "-DCPU_CAPABILITY=AVX512",
    ],
    "avx2": ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY_AVX2", "-DCPU_CAPABILITY=AVX2"],
    "default": [],
}


def _cpu_isa() -> str:
    want = os.environ.get("PARSE_VLLM_CPU_ISA", "auto").strip().lower()
    if want in _ISA_FLAGS:
        return want
    if want != "auto":
        raise SystemExit(f"parse-vllm: PARSE_VLLM_CPU_ISA={want!r}: use auto, avx512, avx2 or default")
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return "default"
    have = set(_cpu_flags())
    for isa, need in (
        ("avx512", {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2", "fma", "f16c"}),
        ("avx2", {"avx2", "fma", "f16c"}),
    ):
        if need <= have and _compiler_accepts(_ISA_FLAGS[isa]):
            return isa
    return "default"


def _shared_libstdcxx() -> list[str]:
    """Link the shared libstdc++ by name, whatever the toolchain's default.

    Python and torch have already loaded libstdc++.so.6 when the op is imported.
    A toolchain that links libstdc++ statically (some GCC builds, conda and
    devtoolset setups, `-static-libstdc++` in a wrapper) puts a second copy into
    `_C.so` whose GNU_UNIQUE locale-facet ids merge with the loaded one's: the
    first error message that formats an integer then uses a wrong facet and the
    process dies (SIGSEGV) or the message is cut at the first number.  Naming the
    shared object (`-l:libstdc++.so.6`, before the driver's own `-lstdc++`) binds
    every std symbol to it, so the static archive contributes nothing.  Plain
    `-lstdc++` is not enough: such a toolchain resolves it from its own lib
    directory to the archive.  tests/test_build_link.py checks the result.
    """
    if sys.platform != "linux":
        return []
    return ["-l:libstdc++.so.6"]


def _set_cuda_home() -> None:
    """Point CUDA_HOME at the real toolkit when only a `nvcc` on PATH is known.

    torch guesses CUDA_HOME as the parent of `which nvcc`'s directory; with a
    wrapper script such as /usr/local/bin/nvcc that guess is /usr/local, which
    has neither the CUDA headers nor libcudart.  nvcc itself knows its root.
    """
    if os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH"):
        return
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return
    cands = [os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))]
    try:
        r = subprocess.run([nvcc, "--dryrun", "-c", "-x", "cu", os.devnull], capture_output=True, text=True, timeout=60)
        for line in (r.stdout + r.stderr).splitlines():
            if "TOP=" in line:
                cands.insert(0, os.path.normpath(line.split("TOP=", 1)[1].strip().strip('"')))
                break
    except (OSError, subprocess.SubprocessError):
        pass
    cands.append("/usr/local/cuda")
    for c in cands:
        if os.path.exists(os.path.join(c, "include", "cuda_runtime_api.h")):
            os.environ["CUDA_HOME"] = c
            return


def _want_cuda(torch) -> tuple[bool, str]:
    """(build the CUDA op?, why / why not)."""
    force = os.environ.get("PARSE_VLLM_BUILD_CUDA", "").strip().lower()
    from torch.utils.cpp_extension import CUDA_HOME

    nvcc = None
    if CUDA_HOME and os.path.exists(os.path.join(CUDA_HOME, "bin", "nvcc")):
        nvcc = os.path.join(CUDA_HOME, "bin", "nvcc")
    elif shutil.which("nvcc"):
        nvcc = shutil.which("nvcc")
    reasons = []
    if not torch.version.cuda:
        reasons.append(f"torch {torch.__version__} has no CUDA")
    if nvcc is None:
        reasons.append("nvcc not found (set CUDA_HOME)")
    if force in ("0", "false", "no", "off"):
        return False, "PARSE_VLLM_BUILD_CUDA=0"
    if force in ("1", "true", "yes", "on"):
        if reasons:
            raise SystemExit(
                "parse-vllm: PARSE_VLLM_BUILD_CUDA=1 but the CUDA op cannot be built: " + "; ".join(reasons)
            )
        return True, f"PARSE_VLLM_BUILD_CUDA=1, nvcc {nvcc}, torch CUDA {torch.version.cuda}"
    if reasons:
        return False, "; ".join(reasons)
    return True, f"torch CUDA {torch.version.cuda}, nvcc {nvcc}"


def _extensions():
    try:
        import torch
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise SystemExit(
            "parse-vllm: torch must be installed before building (the op is compiled against it); "
            "install torch, then `pip install --no-build-isolation -e .`"
        ) from e

    os.environ.setdefault("MAX_JOBS", "2")
    if torch.version.cuda:
        _set_cuda_home()  # before torch.utils.cpp_extension computes CUDA_HOME
    # The venv's `ninja` (pip package) is on PATH only in an activated venv;
    # BuildExtension looks it up on PATH (and falls back to a serial build).
    os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension

    isa = _cpu_isa()
    build_cuda, why = _want_cuda(torch)

    sources = [
        _rel("csrc", "torch_bindings.cpp"),
        _rel("csrc", "cpu", "prefix_verify_attention.cpp"),
        _rel("csrc", "cpu", "prefix_verify_tc_emulator.cpp"),
    ]
    # The kernels' version (parse_vllm/ops/kernel_sources.py): a hash of csrc/, reported by the op.
    root = os.path.dirname(os.path.abspath(__file__))
    spec = importlib.util.spec_from_file_location(
        "_pv_kernel_sources", os.path.join(root, "parse_vllm", "ops", "kernel_sources.py")
    )
    kernel_sources = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kernel_sources)
    kernel_hash = kernel_sources.kernel_sources_hash(root)
    cxx = [
        "-O3",
        "-fopenmp",
        "-Wno-unused-function",
        "-Wno-maybe-uninitialized",
        f"-DPARSE_VLLM_KERNEL_HASH={kernel_hash}",
        *_ISA_FLAGS[isa],
    ]
    link = ["-fopenmp", *_shared_libstdcxx()]
    if build_cuda:
        arch_list = (
            os.environ.get("PARSE_VLLM_CUDA_ARCHS") or os.environ.get("TORCH_CUDA_ARCH_LIST") or DEFAULT_CUDA_ARCHS
        )
        os.environ["TORCH_CUDA_ARCH_LIST"] = arch_list
        archs_macro = "-DPARSE_VLLM_CUDA_ARCHS=" + ",".join(re.split(r"[;,\s]+", arch_list.strip()))
        sources += [
            _rel("csrc", "cuda", "prefix_verify_attention.cu"),
            _rel("csrc", "cuda", "prefix_verify_attention_tc.cu"),
        ]
        ext = CUDAExtension(
            name="parse_vllm._C",
            sources=sources,
            extra_compile_args={
                # PARSE_VLLM_WITH_CUDA: the bindings register the CUDA kernel too
                "cxx": [*cxx, "-DPARSE_VLLM_WITH_CUDA", archs_macro],
                "nvcc": ["-O3", "--use_fast_math", "-lineinfo", "--expt-relaxed-constexpr", "-DPARSE_VLLM_WITH_CUDA"],
            },
            extra_link_args=link,
        )
        _log(f"building CPU op ({isa}) and CUDA op ({why}; archs {arch_list})")
    else:
        ext = CppExtension(
            name="parse_vllm._C",
            sources=sources,
            extra_compile_args={"cxx": cxx},
            extra_link_args=link,
        )
        _log(f"building CPU op ({isa}); CUDA op skipped: {why}")
    return [ext], {"build_ext": BuildExtension}


ext_modules, cmdclass = _extensions()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
