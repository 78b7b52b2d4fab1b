"""Load a script of ``benchmarks/`` (not a package) as a module, for tests of its analysis code."""

import importlib.util
from pathlib import Path


def load_benchmark(name: str):
    path = Path(__file__).resolve().parents[2] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
