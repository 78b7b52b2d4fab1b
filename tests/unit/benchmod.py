"""Import a script of ``benchmarks/`` (``benchmarks.<name>``, as ``python -m benchmarks.<name>`` runs
it) for tests of its analysis code."""

import importlib


def load_benchmark(name: str):
    return importlib.import_module(f"benchmarks.{name}")
