"""The vLLM adapter boundary (parse_vllm/_vllm/), checked on the source with `ast`:

1. no module outside parse_vllm/_vllm/ imports vLLM (at the top or inside a
   function): vLLM comes through `parse_vllm._vllm`;
2. nothing in parse_vllm/_vllm/ imports the rest of parse_vllm (relative
   imports resolved), so the adapter is one-way;
3. vLLM is named by symbol, never by `file.py:LINE`;
4. every `_vllm.<name>` the package reads is one the adapter exports;
5. importing parse_vllm imports no platform-specific vLLM module: each
   platform's worker and runner classes are built only when that platform's
   engine names them (`parse_vllm.worker.<Cls>` resolved by vLLM), because
   importing some of them changes the whole process (vLLM's CPU worker module
   imports vllm.v1.worker.cpu.shm, which swaps torch.cuda.Event/Stream,
   Tensor.pin_memory, torch.accelerator.get_memory_info and
   vllm.utils.torch_utils.async_tensor_h2d for CPU stand-ins). Checked by
   importing the package in a fresh interpreter (rule 5 is about what runs,
   so it is not an `ast` scan).

Every import statement counts, wherever it is (module level, functions,
methods), and so do `importlib.import_module("...")` / `__import__("...")`
with a literal name."""

from __future__ import annotations

import ast
import functools
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "parse_vllm"
ADAPTER = "parse_vllm._vllm"


@dataclass(frozen=True)
class Import:
    module: str  # the importing module, e.g. parse_vllm.cli
    line: int
    target: str  # absolute dotted name imported, e.g. vllm.LLM or parse_vllm.plugin
    statement: str  # the source text, for the failure message
    top_level: bool  # executed when the module is imported


def module_name(path: Path) -> tuple[str, bool]:
    """(dotted module name, is a package) of a file under the repository root."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    is_package = parts[-1] == "__init__"
    if is_package:
        parts.pop()
    return ".".join(parts), is_package


def _resolve(module: str, is_package: bool, level: int, name: str | None) -> str:
    if level == 0:
        return name or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join([*base, name] if name else base)


def _top_level_nodes(tree: ast.Module) -> set[int]:
    """ids of the import nodes run at import time: module level, including
    inside if/try/with blocks, but not under `if TYPE_CHECKING:`."""
    found: set[int] = set()

    def visit(stmts):
        for node in stmts:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if isinstance(node, ast.ClassDef):  # a class body runs at import
                    visit(node.body)
                continue
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                visit(node.orelse)
                continue
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                found.add(id(node))
            for field in ("body", "orelse", "finalbody", "handlers"):
                visit(getattr(node, field, []) or [])

    visit(tree.body)
    return found


def imports_of(source: str, module: str, is_package: bool = False) -> Iterator[Import]:
    """Every import in `source` (the text of `module`), resolved to absolute names."""
    tree = ast.parse(source)
    top = _top_level_nodes(tree)
    lines = source.splitlines()

    def text(node) -> str:
        return " ".join(line.strip() for line in lines[node.lineno - 1 : node.end_lineno])

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(module, node.lineno, alias.name, text(node), id(node) in top)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(module, is_package, node.level, node.module)
            for alias in node.names:
                # `from pkg import sub` may import a submodule: count pkg.sub.
                yield Import(module, node.lineno, f"{base}.{alias.name}", text(node), id(node) in top)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = ast.unparse(node.func)
            name = node.args[0].value
            if func in ("importlib.import_module", "import_module", "__import__") and isinstance(name, str):
                package = node.args[1].value if len(node.args) > 1 and isinstance(node.args[1], ast.Constant) else None
                level = len(name) - len(name.lstrip("."))
                if level:
                    base = package if package is not None else module
                    target = _resolve(base, True, level, name[level:] or None)
                else:
                    target = name
                yield Import(module, node.lineno, target, text(node), False)


def _in(target: str, package: str) -> bool:
    return target == package or target.startswith(package + ".")


def package_modules() -> list[tuple[str, bool, Path]]:
    return sorted((*module_name(p), p) for p in PACKAGE.rglob("*.py"))


@functools.cache
def all_imports() -> list[Import]:
    return [imp for name, pkg, path in package_modules() for imp in imports_of(path.read_text(), name, pkg)]


def _report(bad: list[Import], rule: str) -> str:
    lines = [f"{imp.module} (line {imp.line}) imports {imp.target}: `{imp.statement}`" for imp in bad]
    return f"{rule}:\n  " + "\n  ".join(lines)


# -- the rules ---------------------------------------------------------------------


def test_vllm_is_imported_only_by_the_adapter():
    bad = [imp for imp in all_imports() if _in(imp.target, "vllm") and not _in(imp.module, ADAPTER)]
    assert not bad, _report(bad, "vLLM imported outside parse_vllm/_vllm/ (take it from parse_vllm._vllm)")


def test_the_adapter_imports_nothing_else_of_parse_vllm():
    bad = [
        imp
        for imp in all_imports()
        if _in(imp.module, ADAPTER) and _in(imp.target, "parse_vllm") and not _in(imp.target, ADAPTER)
    ]
    assert not bad, _report(bad, "parse_vllm/_vllm/ imports the rest of parse_vllm (the adapter must be one-way)")


def test_the_adapter_imports_vllm_only_when_called():
    """parse_vllm._vllm is imported while vLLM resolves its platform (inside
    `import vllm.config`), when most of vLLM cannot be imported yet: its
    modules import vLLM inside functions only."""
    bad = [imp for imp in all_imports() if _in(imp.module, ADAPTER) and _in(imp.target, "vllm") and imp.top_level]
    assert not bad, _report(bad, "module-level vLLM import in parse_vllm/_vllm/")


def test_vllm_is_named_by_symbol_not_by_file_line():
    pattern = re.compile(r"\.py:\d+")
    bad = []
    for path in sorted(PACKAGE.rglob("*")):
        if not path.is_file() or path.suffix in (".so", ".safetensors", ".bin", ".pt"):
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        for n, line in enumerate(text.splitlines(), 1):
            if pattern.search(line):
                bad.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not bad, "file:line references (name the vLLM symbol instead):\n  " + "\n  ".join(bad)


def _adapter_names_read() -> list[tuple[str, int, str]]:
    """(module, line, name) of each `_vllm.<name>` read and each
    `from parse_vllm._vllm import <name>` outside the adapter (the package,
    the tests and the scripts)."""
    found = []
    others = [(*module_name(p), p) for d in ("tests", "scripts") for p in sorted((ROOT / d).rglob("*.py"))]
    for name, pkg, path in package_modules() + others:
        if _in(name, ADAPTER):
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "_vllm":
                found.append((name, node.lineno, node.attr))
            elif isinstance(node, ast.ImportFrom) and _resolve(name, pkg, node.level, node.module) == ADAPTER:
                found += [(name, node.lineno, a.name) for a in node.names]
    return found


def test_every_name_read_from_the_adapter_is_exported():
    from parse_vllm import _vllm

    read = _adapter_names_read()
    assert read, "no _vllm.<name> found: the scan is broken"
    missing = [
        f"{mod} (line {line}) reads _vllm.{attr}"
        for mod, line, attr in read
        if attr not in _vllm.__all__ and not attr.startswith("__")
    ]
    assert not missing, "names not exported by parse_vllm._vllm.__all__:\n  " + "\n  ".join(missing)


def test_every_exported_name_resolves():
    from parse_vllm import _vllm

    unresolved = [name for name in _vllm.__all__ if not hasattr(_vllm, name)]
    assert not unresolved, f"parse_vllm._vllm.__all__ names that do not resolve: {unresolved}"


# Rule 5: modules only the CPU, or only the GPU, worker process may import.
PLATFORM_MODULES = {
    "cpu": ("vllm.v1.worker.cpu_worker", "vllm.v1.worker.cpu_model_runner", "vllm.v1.worker.cpu"),
    "gpu": ("vllm.v1.worker.gpu_worker", "vllm.v1.worker.gpu_model_runner"),
}

_PLATFORM_PROBE = r"""
import importlib, json, pkgutil, sys
import torch
import vllm
import vllm.utils.torch_utils as torch_utils

def patched_objects():
    return {
        "torch.cuda.Event": torch.cuda.Event,
        "torch.cuda.Stream": torch.cuda.Stream,
        "torch.Event": torch.Event,
        "torch.accelerator.get_memory_info": torch.accelerator.get_memory_info,
        "torch.Tensor.pin_memory": torch.Tensor.pin_memory,
        "vllm.utils.torch_utils.async_tensor_h2d": torch_utils.async_tensor_h2d,
    }

def report(before):
    now = patched_objects()
    return {
        "changed": sorted(k for k in before if now[k] is not before[k]),
        "modules": sorted(m for m in sys.modules if m.startswith("vllm.v1.worker.")),
    }

import parse_vllm
before = patched_objects()
out = {}
for m in pkgutil.walk_packages(parse_vllm.__path__, "parse_vllm."):
    importlib.import_module(m.name)
out["import"] = report(before)
# What a GPU worker process resolves: its worker class, which builds its runner.
from vllm.utils.import_utils import resolve_obj_by_qualname
from parse_vllm.plugin import CPU_WORKER_CLS, GPU_WORKER_CLS
resolve_obj_by_qualname(GPU_WORKER_CLS)
importlib.import_module("parse_vllm.runner").ParseGPUModelRunner
out["gpu"] = report(before)
resolve_obj_by_qualname(CPU_WORKER_CLS)
out["cpu"] = report(before)
print(json.dumps(out))
"""


def _imported(modules: list[str], platform: str) -> list[str]:
    return [m for m in modules if any(m == p or m.startswith(p + ".") for p in PLATFORM_MODULES[platform])]


def test_importing_parse_vllm_leaves_torch_and_platform_modules_alone():
    """Rule 5, in a fresh interpreter: every module of parse_vllm imported
    leaves torch's CUDA objects (and vLLM's host-to-device helper) as they
    were and imports no platform's worker or runner module; resolving the GPU
    worker (what a GPU worker process does) imports no CPU module; resolving
    the CPU worker does swap those objects, which shows the probe sees it."""
    import json
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", _PLATFORM_PROBE], capture_output=True, text=True, timeout=600, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["import"]["changed"] == [], out["import"]
    assert _imported(out["import"]["modules"], "cpu") == [] and _imported(out["import"]["modules"], "gpu") == []
    assert out["gpu"]["changed"] == [], out["gpu"]
    assert _imported(out["gpu"]["modules"], "cpu") == []
    assert "vllm.v1.worker.gpu_worker" in out["gpu"]["modules"]
    assert "vllm.v1.worker.cpu_worker" in out["cpu"]["modules"]
    assert "torch.cuda.Event" in out["cpu"]["changed"] and "torch.Tensor.pin_memory" in out["cpu"]["changed"]


# -- the walker itself -------------------------------------------------------------


def test_walker_finds_function_level_and_relative_imports():
    source = """
import os

def f():
    import vllm.config
    from vllm import LLM

class C:
    def m(self):
        from .. import plugin
        from . import batch
        from .sampling import sample_rows
        import importlib
        return importlib.import_module("vllm.v1.outputs")

if TYPE_CHECKING:
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata
"""
    found = {(imp.target, imp.top_level) for imp in imports_of(source, "parse_vllm._vllm.forward")}
    assert ("vllm.config", False) in found  # function level
    assert ("vllm.LLM", False) in found
    assert ("parse_vllm.plugin", False) in found  # `from .. import` out of the adapter
    assert ("parse_vllm._vllm.batch", False) in found
    assert ("parse_vllm._vllm.sampling.sample_rows", False) in found
    assert ("vllm.v1.outputs", False) in found  # importlib with a literal
    assert ("vllm.v1.spec_decode.metadata.SpecDecodeMetadata", False) in found  # type checking only
    assert ("os", True) in found

    # The rules flag them: a made-up adapter module importing parse_vllm, and
    # a made-up package module importing vLLM inside a function.
    adapter = list(imports_of(source, "parse_vllm._vllm.forward"))
    assert [i.target for i in adapter if _in(i.target, "parse_vllm") and not _in(i.target, ADAPTER)] == [
        "parse_vllm.plugin"
    ]
    outside = list(imports_of("def g():\n    import vllm\n", "parse_vllm.runner"))
    assert [(i.module, i.target, i.top_level) for i in outside] == [("parse_vllm.runner", "vllm", False)]
    assert "parse_vllm.runner (line 2) imports vllm: `import vllm`" in _report(outside, "rule")
    # A package's relative import resolves from the package itself.
    assert [i.target for i in imports_of("from .log import init_logger", ADAPTER, is_package=True)] == [
        "parse_vllm._vllm.log.init_logger"
    ]
