"""The compiled op uses the libstdc++ that torch uses (issue 35).

A toolchain that links libstdc++ statically (some GCC builds, conda and devtoolset
setups; the GPU image's /opt/gcc) used to put a second copy of it into `_C.so`.  Its
GNU_UNIQUE locale-facet ids merged with the copy Python and torch had already loaded,
so the first error message formatting a number crashed the process (SIGSEGV) or was
cut at that number.  setup.py links `-l:libstdc++.so.6` by name; these tests check the
result:

  * the built `parse_vllm/_C*.so` lists libstdc++.so.6 as NEEDED and defines no
    std::locale machinery (fast; also a step of scripts/gpu_check.sh);
  * (slow) the CPU op built into a temporary folder by a `CXX` wrapper that adds
    `-static-libstdc++` has the same two properties, and every malformed call of
    tests/test_kernel_cpu.py raises its whole message with that library.

No vLLM here: this file runs on a GPU machine that has none (`-m "not slow"`).
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ELF shared objects: Linux only")

# libstdc++'s locale machinery, by mangled name: std::locale's members (_ZNSt6locale...,
# _ZNKSt6locale... for const ones) and the facets' ids (std::num_put<...>::id,
# std::__cxx11::numpunct<char>::id, ... = _ZNSt...2idE) with their guard variables.  A
# library that links the shared libstdc++ defines none of them; a static copy defines
# ~170 (115 GNU_UNIQUE ids in the GPU image's build).
LOCALE_SYMBOL = re.compile(r"^_ZN?K?St6locale|^_Z(GV)?NSt.*2idE$")


# --------------------------------------------------------------------------- reading an ELF file


def _run(*cmd: str) -> str:
    return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout


def _elf_readelf(so: str) -> tuple[list[str], set[str]]:
    needed = re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", _run("readelf", "-dW", so))
    defined = set()
    for line in _run("readelf", "-sW", so).splitlines():  # .dynsym and .symtab
        parts = line.split()
        if len(parts) >= 8 and parts[0].endswith(":") and parts[6] != "UND":
            defined.add(parts[7].split("@")[0])
    return needed, defined


def _elf_objdump(so: str) -> tuple[list[str], set[str]]:
    needed = re.findall(r"^\s*NEEDED\s+(\S+)", _run("objdump", "-p", so), re.M)
    defined = set()
    for flag in ("-T", "-t"):  # objdump -t says "no symbols" on a stripped library
        for line in _run("objdump", flag, so).splitlines():
            parts = line.split()
            if len(parts) >= 4 and re.fullmatch(r"[0-9a-f]{8,}", parts[0]) and "*UND*" not in parts:
                defined.add(parts[-1])
    return needed, defined


def _elf_pyelftools(so: str) -> tuple[list[str], set[str]]:
    from elftools.elf.dynamic import DynamicSection
    from elftools.elf.elffile import ELFFile
    from elftools.elf.sections import SymbolTableSection

    needed, defined = [], set()
    with open(so, "rb") as f:
        elf = ELFFile(f)
        for sec in elf.iter_sections():
            if isinstance(sec, DynamicSection):
                needed += [t.needed for t in sec.iter_tags() if t.entry.d_tag == "DT_NEEDED"]
            if isinstance(sec, SymbolTableSection):
                defined |= {s.name for s in sec.iter_symbols() if s.name and s["st_shndx"] != "SHN_UNDEF"}
    return needed, defined


def elf_info(so: str) -> tuple[list[str], set[str]]:
    """(NEEDED entries, names of the symbols it defines) of a shared object, with
    readelf, else objdump (binutils), else pyelftools; skips when none is there."""
    if shutil.which("readelf"):
        return _elf_readelf(so)
    if shutil.which("objdump"):
        return _elf_objdump(so)
    if importlib.util.find_spec("elftools") is not None:
        return _elf_pyelftools(so)
    pytest.skip("no readelf, objdump or pyelftools to read the shared object with")


def link_problems(so: str) -> list[str]:
    """What is wrong with how `so` links libstdc++ (empty: nothing)."""
    needed, defined = elf_info(so)
    wrong = []
    if "libstdc++.so.6" not in needed:
        wrong.append(f"libstdc++.so.6 is not NEEDED (NEEDED: {', '.join(needed)}): libstdc++ was linked statically")
    locale = sorted(s for s in defined if LOCALE_SYMBOL.search(s))
    if locale:
        wrong.append(f"it defines {len(locale)} std::locale symbols (a copy of libstdc++), e.g. {locale[:4]}")
    return wrong


# --------------------------------------------------------------------------- the library built here


def built_library() -> str:
    spec = importlib.util.find_spec("parse_vllm._C")
    assert spec is not None and spec.origin, (
        "parse_vllm._C is not built (pip install --no-build-isolation -e ., or setup.py build_ext --inplace)"
    )
    return spec.origin


def test_the_built_op_links_the_shared_libstdcxx():
    so = built_library()
    wrong = link_problems(so)
    if wrong:
        pytest.fail(f"{so}: " + "; ".join(wrong), pytrace=False)


# --------------------------------------------------------------------------- a toolchain that links statically

# setup.py's extension built into a folder of ours (`python setup.py build_ext` without
# reading pyproject.toml, as scripts/gpu_check.sh does): setup() is captured, then built.
_BUILD = textwrap.dedent(
    """
    import os, runpy, sys
    import setuptools
    from setuptools.dist import Distribution

    out = sys.argv[1]
    captured = {}
    setuptools.setup = lambda **kw: captured.update(kw)
    runpy.run_path("setup.py", run_name="__main__")
    ext = captured["ext_modules"][0]
    print("link args:", ext.extra_link_args, flush=True)
    dist = Distribution(dict(name="parse-vllm", version="0", packages=[], py_modules=[],
                             ext_modules=captured["ext_modules"], cmdclass=captured["cmdclass"],
                             script_name="setup.py",
                             script_args=["build_ext", "--build-lib", os.path.join(out, "lib"),
                                          "--build-temp", os.path.join(out, "tmp")]))
    dist.parse_command_line()
    dist.run_commands()
    """
)


def _static_cxx(tmp: Path) -> str:
    """A CXX that links libstdc++ statically (the compiler this build would use, plus
    -static-libstdc++), checked to do so on a small shared object; skips when the
    toolchain cannot (no GCC/Clang driver, no libstdc++.a).  It also compiles at -O0 without
    debug information (after setup.py's -O3 and Python's -g, so it wins): the quickest compile,
    and the code generated plays no part in which libstdc++ the link takes."""
    real = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not real:
        pytest.skip("no C++ compiler")
    wrapper = tmp / "static-cxx"
    wrapper.write_text(f'#!/bin/sh\nexec {real} "$@" -O0 -g0 -static-libstdc++\n')
    wrapper.chmod(0o755)
    src = tmp / "probe.cpp"
    src.write_text(
        '#include <sstream>\nextern "C" int probe(long x) { std::ostringstream s; s << x; '
        "return (int)s.str().size(); }\n"
    )
    probe = tmp / "probe.so"
    r = subprocess.run([str(wrapper), "-shared", "-fPIC", str(src), "-o", str(probe)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"{real} -static-libstdc++ cannot link here: {r.stderr.strip()[-300:]}")
    if not link_problems(str(probe)):
        pytest.skip(f"{real} -static-libstdc++ still links the shared libstdc++: the wrapper reproduces nothing")
    return str(wrapper)


@pytest.mark.slow
def test_a_toolchain_linking_libstdcxx_statically_still_gives_whole_messages(tmp_path):
    """The CPU op built with `CXX` = g++ -static-libstdc++ (at -O0: see _static_cxx): without
    setup.py's -l:libstdc++.so.6 it had no NEEDED libstdc++.so.6, 171 locale symbols of its own,
    and every malformed call of tests/test_kernel_cpu.py whose message holds a number raised it
    cut at that number (26 of the 31 cases at 45fd9de; the GPU image's toolchain crashed)."""
    if not (ROOT / "setup.py").exists():
        pytest.skip("no setup.py: not a source checkout")
    cxx = _static_cxx(tmp_path)
    env = {
        **os.environ,
        "CXX": cxx,
        "PARSE_VLLM_BUILD_CUDA": "0",  # the CPU op is where the messages are formatted
        "PARSE_VLLM_CPU_ISA": "default",  # the quickest compile; the ISA plays no part
        "MAX_JOBS": os.environ.get("MAX_JOBS", "2"),
    }
    out = tmp_path / "build"
    r = subprocess.run(
        [sys.executable, "-c", _BUILD, str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900
    )
    assert r.returncode == 0, f"the build failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    (so,) = (out / "lib" / "parse_vllm").glob("_C*.so")
    wrong = link_problems(str(so))

    from test_kernel_cpu import bad_input_failures, run_bad_inputs

    failures = bad_input_failures(run_bad_inputs(so=str(so)))
    if failures and len(set(failures.values())) == 1:  # the child could not run at all: once
        wrong.append(f"every malformed call: {next(iter(failures.values()))}")
    else:
        wrong += [f"{name}: {why}" for name, why in failures.items()]
    if wrong:
        pytest.fail(f"{so}, built with a static-libstdc++ toolchain:\n" + "\n".join(wrong), pytrace=False)
