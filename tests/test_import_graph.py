"""The import graph of parse_vllm, read from the source with `ast` (nothing is imported).

Every `import` and `from ... import` statement counts, at module level or inside a function
(a function-level import is still a dependency, only a later one); relative imports are
resolved. Rules:

* no import cycle inside parse_vllm;
* the runtime (every module not under parse_vllm/tools/ and not parse_vllm/cli.py) imports
  nothing from parse_vllm.tools: the lab tools (model preparation, draft training, benchmarks,
  eval) sit on top of the runtime, never under it.

`import_records`, `import_graph` and `imported_top_level_names` are meant for more rules.
"""

from __future__ import annotations

import ast
import dataclasses
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "parse_vllm"
TOOLS = f"{PACKAGE}.tools"
CLI = f"{PACKAGE}.cli"


def module_files(root: Path = ROOT / PACKAGE, package: str = PACKAGE) -> dict[str, Path]:
    """{dotted module name: file} of every .py file of the package (a package is its __init__)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join([package, *parts])] = path
    return out


@dataclasses.dataclass(frozen=True)
class ImportRecord:
    module: str  # the importing module
    target: str  # absolute dotted name: a module, or for `from X import a` X.a when X.a is a module, else X
    names: tuple[str, ...]  # what a `from` import takes from the target (() for `import X`)
    lineno: int
    function_level: bool  # inside a def (or a lambda), so not run at import time
    type_checking: bool  # under `if TYPE_CHECKING:`, never run


def _package_of(module: str, path: Path) -> str:
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def import_records(files: Mapping[str, Path] | None = None) -> Iterator[ImportRecord]:
    """Every import statement of every module (top-level, function-level, type-checking only),
    module by module in source order."""
    files = module_files() if files is None else files
    for module, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        in_function: set[int] = set()
        in_type_checking: set[int] = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                in_function.update(id(n) for n in ast.walk(node) if n is not node)
            elif isinstance(node, ast.If) and _is_type_checking(node.test):
                in_type_checking.update(id(n) for stmt in node.body for n in ast.walk(stmt))
        imports = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
        for node in sorted(imports, key=lambda n: (n.lineno, n.col_offset)):
            where = dict(lineno=node.lineno, function_level=id(node) in in_function)
            where["type_checking"] = id(node) in in_type_checking
            if isinstance(node, ast.Import):
                for alias in node.names:
                    yield ImportRecord(module, alias.name, (), **where)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = _package_of(module, path)
                    for _ in range(node.level - 1):
                        base = base.rpartition(".")[0]
                    base = f"{base}.{node.module}" if node.module else base
                else:
                    base = node.module or ""
                plain = [a.name for a in node.names if f"{base}.{a.name}" not in files]
                for alias in node.names:
                    if f"{base}.{alias.name}" in files:  # `from package import submodule`
                        yield ImportRecord(module, f"{base}.{alias.name}", (), **where)
                if plain:
                    yield ImportRecord(module, base, tuple(plain), **where)


def import_graph(files: Mapping[str, Path] | None = None) -> dict[str, set[str]]:
    """{module: the parse_vllm modules it imports} over every module of the package (self-imports
    left out). `import parse_vllm._C` names the compiled op, which has no .py file: a node too."""
    files = module_files() if files is None else files
    graph: dict[str, set[str]] = {m: set() for m in files}
    for r in import_records(files):
        if (r.target == PACKAGE or r.target.startswith(PACKAGE + ".")) and r.target != r.module:
            graph[r.module].add(r.target)
            graph.setdefault(r.target, set())
    return graph


def imported_top_level_names(files: Mapping[str, Path] | None = None) -> dict[str, set[str]]:
    """{module: the top-level packages it imports (``vllm``, ``torch``, ``parse_vllm`` ...)}."""
    files = module_files() if files is None else files
    names: dict[str, set[str]] = {m: set() for m in files}
    for r in import_records(files):
        names[r.module].add(r.target.partition(".")[0])
    return names


def strongly_connected_components(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """The sets of nodes that all reach each other (Tarjan), those of more than one node only,
    each sorted, in a stable order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                components.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return sorted(components)


def find_cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component: the shortest way from the component's first
    node back to itself, as a list of nodes each importing the next (the last the first)."""
    cycles = []
    for comp in strongly_connected_components(graph):
        start, inside = comp[0], set(comp)
        prev: dict[str, str] = {}
        frontier, last = [start], None
        while last is None:  # breadth first; the component guarantees a way back
            nxt = []
            for v in frontier:
                for w in sorted(graph[v]):
                    if w == start and last is None:
                        last = v
                    elif w in inside and w != start and w not in prev:
                        prev[w] = v
                        nxt.append(w)
            frontier = nxt
        path = [last]
        while path[-1] != start:
            path.append(prev[path[-1]])
        cycles.append(path[::-1])
    return cycles


def runtime_modules(graph: Mapping[str, set[str]]) -> list[str]:
    return sorted(m for m in graph if m != CLI and m != TOOLS and not m.startswith(TOOLS + "."))


# -- the rules ----------------------------------------------------------------------------


def test_cycle_finder_on_hand_made_graphs():
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    two = find_cycles({"a": {"b", "x"}, "b": {"a"}, "x": {"y"}, "y": {"z"}, "z": {"x"}})
    assert two == [["a", "b"], ["x", "y", "z"]]
    # the shortest way round is reported, not the first one found
    assert find_cycles({"a": {"b", "c"}, "b": {"c"}, "c": {"a"}}) == [["a", "c"]]


def test_graph_reads_function_level_and_relative_imports(tmp_path):
    pkg = tmp_path / PACKAGE
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text(
        "import os\nimport typing\n\nif typing.TYPE_CHECKING:\n    import torch\n\n"
        "def f():\n    from .sub import b\n    import vllm.config\n"
    )
    (pkg / "sub" / "__init__.py").write_text("from . import b\n")
    (pkg / "sub" / "b.py").write_text("from ..a import f\nfrom parse_vllm import sub\nimport parse_vllm._C\n")
    files = module_files(pkg)
    graph = import_graph(files)
    assert graph[f"{PACKAGE}.a"] == {f"{PACKAGE}.sub.b"}
    assert graph[f"{PACKAGE}.sub"] == {f"{PACKAGE}.sub.b"}
    assert graph[f"{PACKAGE}.sub.b"] == {f"{PACKAGE}.a", f"{PACKAGE}.sub", f"{PACKAGE}._C"}
    assert strongly_connected_components(graph) == [[f"{PACKAGE}.a", f"{PACKAGE}.sub", f"{PACKAGE}.sub.b"]]
    assert find_cycles(graph) == [[f"{PACKAGE}.a", f"{PACKAGE}.sub.b"]]
    assert imported_top_level_names(files)[f"{PACKAGE}.a"] == {"os", "typing", "torch", PACKAGE, "vllm"}
    records = {r.target: r for r in import_records(files) if r.module == f"{PACKAGE}.a"}
    assert list(records) == ["os", "typing", "torch", f"{PACKAGE}.sub.b", "vllm.config"]
    assert records["vllm.config"].function_level and records["vllm.config"].lineno == 9
    assert records["torch"].type_checking and not records["torch"].function_level
    assert not records["os"].type_checking and not records["os"].function_level
    (from_sub,) = [r for r in import_records(files) if r.module == f"{PACKAGE}.sub.b" and r.target == f"{PACKAGE}.a"]
    assert from_sub.names == ("f",)


def test_no_import_cycle():
    graph = import_graph()
    report = [
        f"{' -> '.join([*cycle, cycle[0]])}  (tangled together: {', '.join(comp)})"
        for cycle, comp in zip(find_cycles(graph), strongly_connected_components(graph))
    ]
    assert not report, "import cycles in parse_vllm:\n" + "\n".join(report)


def test_runtime_imports_no_lab_tool():
    graph = import_graph()
    assert any(m.startswith(TOOLS + ".") for m in graph), "parse_vllm.tools not found: the rule would hold vacuously"
    bad = {
        m: sorted(t for t in graph[m] if t == TOOLS or t.startswith(TOOLS + "."))
        for m in runtime_modules(graph)
        if any(t == TOOLS or t.startswith(TOOLS + ".") for t in graph[m])
    }
    assert not bad, f"runtime modules import lab tools (parse_vllm.tools): {bad}"


@pytest.mark.parametrize(
    "module, runtime",
    [
        ("parse_vllm", True),
        ("parse_vllm.runner", True),
        ("parse_vllm.presets", True),
        ("parse_vllm.cli", False),
        ("parse_vllm.tools", False),
        ("parse_vllm.tools.benchmarks.e2e", False),
    ],
)
def test_which_modules_are_the_runtime(module, runtime):
    graph = import_graph()
    assert module in graph
    assert (module in runtime_modules(graph)) == runtime
