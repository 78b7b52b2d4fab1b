"""What the mechanism benchmarks' docs share: the machine's name, the raw file's path, the header."""

from __future__ import annotations

import os
import platform
import shlex
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` says."""
    return next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")),
                platform.processor())


def cpu_device(what: str) -> str:
    """``<CPU model>, <n> threads (<what>)`` for a benchmark run without a GPU."""
    return f"{cpu_model()}, {torch.get_num_threads()} threads ({what})"


def device_name(dev: torch.device) -> str:
    """The GPU's name for a CUDA device, else ``cpu_device("CPU, no GPU lent")``."""
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    return cpu_device("CPU, no GPU lent")


def rel(path: Path) -> str:
    """``path`` relative to the repository when inside it (as written in the docs)."""
    return (path.relative_to(ROOT) if path.is_relative_to(ROOT) else path).as_posix()


def command(script: str) -> str:
    """The command line that ran ``script`` (its arguments as given when it runs as a program)."""
    args = sys.argv[1:] if Path(sys.argv[0]).name == script else []
    return " ".join(["python", f"benchmarks/{script}", *map(shlex.quote, args)])


def doc_header(title: str, script: str, device: str, raw: Path, *paragraphs: str,
               load: float | str | None = None) -> list[str]:
    """Title, provenance, the given paragraphs and the machine-load caveat, as markdown lines (``load``:
    the 1-min load average the measuring run recorded, or a note saying it was not; default: now)."""
    lines = [f"# {title}", "",
             f"Produced by `{command(script)}` on **{device}**; raw numbers in `{rel(raw)}`.", ""]
    for p in paragraphs:
        lines += [p, ""]
    load = os.getloadavg()[0] if load is None else load
    cores = os.cpu_count() or 1
    lines += [f"Machine load (1-min load average at the end, {cores} cores): "
              f"{load if isinstance(load, str) else f'{load:.1f}'}"
              + ("; 2 shared cores, so repeat on a quiet machine before trusting small differences." if cores <= 2
                 else "."), ""]
    return lines
