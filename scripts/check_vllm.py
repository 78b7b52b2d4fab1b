"""``make check-vllm``: every vLLM symbol of ``versions.TOUCHPOINTS`` against the source of every release.

Each release's sdist is downloaded from PyPI once into ``--cache`` (sha256 checked, written atomically)
and its ``vllm/**/*.py`` parsed with ``ast`` out of the tarball: nothing of vLLM is imported. A symbol
``module:Qual.name`` must resolve (imported names followed to their defining module, class members
looked up in vLLM base classes too), ``params`` must lead its parameters and every one of ``attrs``
must be on the class (a class-level field, ``self.X = ...`` in a method of it or of a vLLM base, a
property or method). Exits 1 unless every supported cell passes.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import importlib.util
import json
import os
import sys
import tarfile
import urllib.parse
import urllib.request
from pathlib import Path

VERSIONS_PY = Path(__file__).resolve().parents[1] / "vllm_kunserve/integration/vllm/versions.py"
PYPI = "https://pypi.org/pypi/vllm"
DEFS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
FUNCS = (ast.FunctionDef, ast.AsyncFunctionDef)


def load_versions():
    """versions.py alone: the package's ``__init__`` imports torch, versions.py no vLLM."""
    spec = importlib.util.spec_from_file_location("_kunserve_vllm_versions", VERSIONS_PY)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


# -- sources ------------------------------------------------------------------------------------
def _sdist_meta(ver: str, timeout: float) -> tuple[str, str]:
    """The sdist's (url, sha256) from PyPI's JSON API: the release's page, else the project's (a
    mirror may lack the first, and may give relative URLs). One try each, no retries."""
    err: Exception = LookupError(f"no sdist of vllm {ver} on PyPI")
    for url, key in ((f"{PYPI}/{ver}/json", "urls"), (f"{PYPI}/json", "releases")):
        try:
            with urllib.request.urlopen(url, timeout=timeout) as r:
                data = json.load(r)
        except OSError as e:   # URLError, HTTPError, timeout
            err = e
            continue
        for f in data["urls"] if key == "urls" else data.get("releases", {}).get(ver, []):
            if f.get("packagetype") == "sdist":
                return urllib.parse.urljoin(url, f["url"]), f["digests"]["sha256"]
    raise err


def fetch_sdist(ver: str, cache: Path, timeout: float = 20.0) -> Path:
    """The cached sdist of ``ver``, downloaded once (no network when cached)."""
    dest = cache / f"vllm-{ver}.tar.gz"
    if dest.is_file():
        return dest
    url, sha256 = _sdist_meta(ver, timeout)
    cache.mkdir(parents=True, exist_ok=True)
    tmp, h = dest.with_name(f"{dest.name}.{os.getpid()}.part"), hashlib.sha256()
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r, open(tmp, "wb") as f:
            while chunk := r.read(1 << 20):
                h.update(chunk)
                f.write(chunk)
        if h.hexdigest() != sha256:
            raise ValueError(f"sha256 mismatch for {url}")
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    return dest


class Source:
    """One release's ``vllm/**/*.py`` (path -> text); trees parsed on first use."""

    def __init__(self, files: dict[str, str]) -> None:
        self.files, self._trees = files, {}

    @classmethod
    def from_sdist(cls, path: Path) -> "Source":
        files = {}
        with tarfile.open(path, "r:gz") as tar:
            for m in tar:
                rel = m.name.split("/", 1)[-1]   # vllm-<ver>/vllm/x.py -> vllm/x.py
                if m.isfile() and rel.startswith("vllm/") and rel.endswith(".py"):
                    files[rel] = tar.extractfile(m).read().decode("utf-8", "replace")
        return cls(files)

    def path(self, module: str) -> str | None:
        base = module.replace(".", "/")
        return next((p for p in (f"{base}.py", f"{base}/__init__.py") if p in self.files), None)

    def tree(self, module: str) -> ast.Module:
        if module not in self._trees:
            self._trees[module] = ast.parse(self.files[self.path(module)])
        return self._trees[module]


# -- resolution: (defining module, node); node None for a module; ("external", None) outside vLLM --
def _flat(body: list) -> list:
    """Statements of a body, with those under if/try/with (TYPE_CHECKING, optional imports)."""
    out = []
    for st in body:
        if isinstance(st, (ast.If, ast.Try, ast.With)):
            for part in (st.body, getattr(st, "orelse", []), getattr(st, "finalbody", []),
                         *(h.body for h in getattr(st, "handlers", []))):
                out += _flat(part)
        else:
            out.append(st)
    return out


def _names(targets: list) -> list:
    return [e for t in targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]


def _assigned(st) -> list[str]:
    ts = st.targets if isinstance(st, ast.Assign) else [st.target]
    return [e.id for e in _names(ts) if isinstance(e, ast.Name)]


def _abs(src: Source, module: str, imp: ast.ImportFrom) -> str:
    if not imp.level:
        return imp.module or ""
    parts = module.split(".")[: None if src.path(module).endswith("__init__.py") else -1]
    parts = parts[: len(parts) - (imp.level - 1)]
    return ".".join(parts + ([imp.module] if imp.module else []))


def lookup(src: Source, module: str, name: str, seen=None):
    """``name`` as ``module`` binds it, followed through imports to where it is defined; or None."""
    seen = set() if seen is None else seen
    if (module, name) in seen or src.path(module) is None:
        return None
    seen.add((module, name))
    imports, stars = [], []
    for st in _flat(src.tree(module).body):
        if (isinstance(st, DEFS) and st.name == name) or (
                isinstance(st, (ast.Assign, ast.AnnAssign)) and name in _assigned(st)):
            return module, st
        if isinstance(st, ast.ImportFrom):
            stars += [_abs(src, module, st) for a in st.names if a.name == "*"]
            imports += [(_abs(src, module, st), a.name) for a in st.names if (a.asname or a.name) == name]
        elif isinstance(st, ast.Import):
            imports += [(a.name if a.asname else name, None) for a in st.names
                        if (a.asname or a.name.split(".")[0]) == name]
    for mod, attr in imports:
        if mod.split(".")[0] != "vllm":
            return "external", None
        found = lookup(src, mod, attr, seen) if attr else (mod, None) if src.path(mod) else None
        if found:
            return found
    if src.path(f"{module}.{name}"):
        return f"{module}.{name}", None
    return next((f for mod in stars if (f := lookup(src, mod, name, seen))), None)


def _deref(src: Source, found):
    """Follow an alias (``X = Y``) to what ``Y`` names."""
    mod, node = found
    if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Name):
        return lookup(src, mod, node.value.id) or found
    return found


def _bases(src: Source, module: str, cls: ast.ClassDef) -> list:
    out = []
    for b in cls.bases:
        b, chain = (b.value if isinstance(b, ast.Subscript) else b), []
        while isinstance(b, ast.Attribute):
            b, chain = b.value, [b.attr, *chain]
        found = lookup(src, module, b.id) if isinstance(b, ast.Name) else None
        for part in chain:   # module.Class
            found = lookup(src, found[0], part) if found and found[0] != "external" and not found[1] else None
        found = found and _deref(src, found)
        if found and isinstance(found[1], ast.ClassDef):
            out.append(found)
    return out


def members(src: Source, module: str, cls: ast.ClassDef, seen=None) -> dict:
    """Every member name of a class (its body, ``self.X`` in its methods), then its vLLM bases'."""
    seen = set() if seen is None else seen
    if id(cls) in seen:
        return {}
    seen.add(id(cls))
    out: dict = {}
    for st in _flat(cls.body):
        for n in [st.name] if isinstance(st, DEFS) else _assigned(st) if isinstance(
                st, (ast.Assign, ast.AnnAssign)) else []:
            out.setdefault(n, (module, st))
    for fn in (st for st in cls.body if isinstance(st, FUNCS) and st.args.args):
        me = fn.args.args[0].arg
        for n in ast.walk(fn):
            ts = n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(
                n, (ast.AnnAssign, ast.AugAssign)) else []
            for e in _names(ts):
                if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id == me:
                    out.setdefault(e.attr, (module, n))
    for mod, base in _bases(src, module, cls):
        for k, v in members(src, mod, base, seen).items():
            out.setdefault(k, v)
    return out


def check_symbol(src: Source, sym) -> str | None:
    """What is wrong with ``sym`` in this source, or None."""
    module, _, qual = sym.path.partition(":")
    if src.path(module) is None:
        return f"{sym.path}: module {module} not found"
    found, where = (module, None), module
    for part in filter(None, qual.split(".")):
        mod, node = _deref(src, found)
        if mod == "external":
            return None  # defined outside vLLM: nothing more to read here
        if node is not None and not isinstance(node, ast.ClassDef):
            return f"{sym.path}: {where} is not a class or module"
        found = members(src, mod, node).get(part) if node else lookup(src, mod, part)
        if found is None:
            return f"{sym.path}: {part} not found in {where}" + (" (nor its vLLM bases)" if node else "")
        where += f".{part}" if ":" in where else f":{part}"
    mod, node = _deref(src, found)
    if mod == "external":
        return None
    if sym.params is not None:
        if not isinstance(node, FUNCS):
            return f"{sym.path}: not a function (params declared)"
        a = node.args
        have = tuple(x.arg for x in a.posonlyargs + a.args + a.kwonlyargs)
        if have[:len(sym.params)] != tuple(sym.params):
            return f"{sym.path} params ({', '.join(have)}) do not start with ({', '.join(sym.params)})"
    if sym.attrs:
        if not isinstance(node, ast.ClassDef):
            return f"{sym.path}: not a class (attrs declared)"
        have = members(src, mod, node)
        missing = [x for x in sym.attrs if x not in have]
        if missing:
            return f"{sym.path} attrs missing: {', '.join(missing)}"
    return None


def check_release(src: Source, release: str, V) -> dict:
    """{touchpoint: "-" | [(problem, optional), ...]} for one release (``V``: the versions module)."""
    out = {}
    for t in V.TOUCHPOINTS:
        syms = [s for _, s in V.symbols_for(release, t.name)]
        out[t.name] = [(p, s.optional) for s in syms if (p := check_symbol(src, s))] if (
            syms and V.in_range(release, t.versions)) else "-"
    return out


# -- report -------------------------------------------------------------------------------------
def run(V, releases, cache: Path, allow_missing=False, json_out=None, timeout=20.0) -> int:
    matrix, missing = {}, {}
    for rel in releases:
        try:
            matrix[rel] = check_release(Source.from_sdist(fetch_sdist(rel, cache, timeout)), rel, V)
        except (OSError, LookupError, ValueError, tarfile.TarError) as e:
            missing[rel] = f"{type(e).__name__}: {e}"
            cached = (cache / f"vllm-{rel}.tar.gz").is_file()
            print(f"vllm {rel}: " + (f"the cached sdist is unreadable ({missing[rel]}); delete it" if cached
                                     else f"not in the cache and cannot download ({missing[rel]})"), flush=True)

    def show(r, t) -> str:
        if r not in matrix:
            return "n/c" if V.in_range(r, t.versions) else "-"
        res = matrix[r][t.name]
        return res if res == "-" else "FAIL" if any(not o for _, o in res) else "warn" if res else "ok"

    width = max(len(t.name) for t in V.TOUCHPOINTS) + 2
    print("\n" + "touchpoint".ljust(width) + "".join(r.rjust(8) for r in releases))
    for t in V.TOUCHPOINTS:
        print(t.name.ljust(width) + "".join(show(r, t).rjust(8) for r in releases))
    problems = [(r, t, p, o) for r in matrix for t, res in matrix[r].items() if res != "-" for p, o in res]
    for label, opt in (("failures", False), ("warnings (optional symbols)", True)):
        rows = [f"  {r} {t}: {p}" for r, t, p, o in problems if o == opt]
        if rows:
            print(f"\n{label}:\n" + "\n".join(rows))
    if missing:
        print(f"\nnot checked: {', '.join(missing)}" + (" (--allow-missing)" if allow_missing else ""))
    if json_out:
        Path(json_out).write_text(json.dumps({
            "releases": list(releases), "not_checked": missing,
            "cells": {t.name: {r: show(r, t) for r in releases} for t in V.TOUCHPOINTS},
            "problems": [dict(release=r, touchpoint=t, problem=p, optional=o) for r, t, p, o in problems]},
            indent=1) + "\n")
    bad = any(not o for *_, o in problems) or (bool(missing) and not allow_missing)
    print("\ncheck-vllm: " + ("FAILED" if bad else "ok"))
    return 1 if bad else 0


def main(argv=None) -> int:
    V = load_versions()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--releases", help="comma-separated subset of versions.RELEASES")
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache/vllm-kunserve/vllm-src")
    ap.add_argument("--json", dest="json_out", help="write the matrix as JSON here")
    ap.add_argument("--allow-missing", action="store_true", help="releases that cannot be read are no failure")
    ap.add_argument("--timeout", type=float, default=20.0, help="network timeout per request (s)")
    a = ap.parse_args(argv)
    releases = a.releases.split(",") if a.releases else list(V.RELEASES)
    if bad := [r for r in releases if not V.in_range(r)]:
        ap.error(f"not in the supported range {V.SUPPORTED}: {', '.join(bad)}")
    return run(V, releases, a.cache.expanduser(), a.allow_missing, a.json_out, a.timeout)


if __name__ == "__main__":
    sys.exit(main())
