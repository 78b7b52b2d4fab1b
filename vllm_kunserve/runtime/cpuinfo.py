"""The CPU's feature flags, as ``/proc/cpuinfo`` lists them (the first ``flags`` line)."""

from __future__ import annotations

from pathlib import Path


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The flags of ``cpuinfo`` (default: this host's ``/proc/cpuinfo``); empty where it cannot be read."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[-1].split())
    return set()
