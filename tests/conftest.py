"""Shared pytest setup: markers, GPU skipping, vLLM CPU environment."""

import os

import pytest

from vllm_kunserve.runtime.quietexit import quiet_exit

_status: list[int] = []

os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """Real-engine modules first (stable: each module's tests stay together, in their order), so that
    under ``make test``'s workers the quick unit modules even out the workers at the end."""
    items.sort(key=lambda item: 0 if item.path.parent.name == "vllm" else 1)
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (no GPU on this machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_sessionfinish(session, exitstatus):
    _status.append(int(exitstatus))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """After the summary and every other plugin's unconfigure: leave without the interpreter's
    teardown, where triton's nanobind prints ~100 "leaked" lines below pytest's summary
    (runtime/quietexit.py; KUNSERVE_QUIET_EXIT=0 keeps the ordinary exit)."""
    if _status and not hasattr(config, "workerinput"):   # not inside an xdist worker
        quiet_exit(_status[-1])
