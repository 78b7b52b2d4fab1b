"""No two modules of ``vllm_kunserve`` import each other, directly or in a circle.

Every module is parsed with ``ast``: all imports count, including those inside functions (a lazy
import is still a dependency) and relative ones. ``from A import b`` is an edge to ``A.b`` when that
is a module, else to ``A``. A package's ``__init__`` is the module named after the package; the
implicit import of a parent package by its submodules is not an edge (else every ``__init__`` that
re-exports its submodules would close a circle).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
PKG = "vllm_kunserve"
#: being rewritten elsewhere; a circle only among these is tolerated for now (xfail, not skipped)
IN_REWRITE = ("vllm_kunserve.plugin", "vllm_kunserve.config", "vllm_kunserve.integration", "vllm_kunserve.engine")


def _in_rewrite(module: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in IN_REWRITE)


def module_files(root: Path = ROOT, pkg: str = PKG) -> dict[str, Path]:
    out = {}
    for path in sorted((root / pkg).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, modules: set[str]) -> set[str]:
    is_pkg = path.name == "__init__.py"
    here = name if is_pkg else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = here
            for _ in range(node.level - 1 if node.level else 0):
                base = base.rpartition(".")[0]
            target = ".".join(p for p in ((base if node.level else ""), node.module or "") if p)
            for a in node.names:
                sub = f"{target}.{a.name}"
                found.add(sub if sub in modules else target)
    return {m for m in found if m in modules and m != name}


def import_graph(root: Path = ROOT, pkg: str = PKG) -> dict[str, set[str]]:
    files = module_files(root, pkg)
    return {name: _imports(name, path, set(files)) for name, path in files.items()}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component with more than one module (Tarjan), each as a
    path ``a -> b -> ... -> a`` found inside its component."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    comps: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_path_in(graph, comp) for comp in comps]


def _path_in(graph: dict[str, set[str]], comp: set[str]) -> list[str]:
    start = min(comp)
    prev = {start: None}
    todo = [start]
    while todo:  # breadth first back to start inside the component
        v = todo.pop(0)
        for w in sorted(graph[v] & comp):
            if w == start:
                path = [v]
                while prev[path[-1]] is not None:
                    path.append(prev[path[-1]])
                return [start, *reversed(path[:-1]), start] if len(path) > 1 else [start, v, start]
            if w not in prev:
                prev[w] = v
                todo.append(w)
    raise AssertionError(f"no cycle through {start} in {sorted(comp)}")


def test_checker_finds_direct_lazy_and_relative_cycles(tmp_path):
    pkg = tmp_path / "p"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .a import x\n")
    (pkg / "a.py").write_text("def f():\n    from .sub import b\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("from .. import c\n")
    (pkg / "c.py").write_text("import p.a\n")
    (pkg / "d.py").write_text("from p import a\n")
    g = import_graph(tmp_path, "p")
    assert g["p"] == {"p.a"} and g["p.a"] == {"p.sub.b"} and g["p.sub.b"] == {"p.c"} and g["p.d"] == {"p.a"}
    assert find_cycles(g) == [["p.a", "p.sub.b", "p.c", "p.a"]]
    (pkg / "c.py").write_text("")
    assert find_cycles(import_graph(tmp_path, "p")) == []


def test_no_import_cycles():
    cycles = find_cycles(import_graph())
    shown = "\n".join(" -> ".join(c) for c in cycles)
    if cycles and all(_in_rewrite(m) for c in cycles for m in c):
        print(f"import cycles among modules being rewritten:\n{shown}")
        pytest.xfail(f"import cycles only among modules being rewritten:\n{shown}")
    assert not cycles, f"import cycles:\n{shown}"


def test_policy_is_pure():
    """``policy/`` sees snapshots only: the standard library, numpy/scipy, ``policy`` and ``config``."""
    import sys

    files = module_files()
    allowed = set(sys.stdlib_module_names) | {"numpy", "scipy"}
    bad = []
    for name, path in files.items():
        if not name.startswith(f"{PKG}.policy"):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            mods = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                    [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            for m in mods:
                ok = (m.split(".")[0] in allowed or m == f"{PKG}.config" or m == f"{PKG}.policy"
                      or m.startswith(f"{PKG}.policy."))
                if not ok:
                    bad.append(f"{name} imports {m}")
    assert not bad, "\n".join(bad)
