"""`kunserve serve` killed with SIGKILL (no shutdown of its own) leaves no engine behind: each
engine server sees its launcher gone and stops its process group (vllm_kunserve/runtime/parentwatch.py)."""

from __future__ import annotations

import os
import signal
import time

import pytest

from vllm_kunserve.cluster.fleet.launcher import KunserveCluster
from vllm_kunserve.runtime.parentwatch import ENV_PARENT, running

pytestmark = pytest.mark.vllm

ARGS = ["--dtype", "float32", "--block-size", "32", "--kv-cache-memory-bytes", str(16 << 20),
        "--max-model-len", "256", "--enforce-eager", "--served-model-name", "m"]


def _launched_by(pid: int) -> list[int]:
    """Processes whose environment names ``pid`` as their kunserve launcher."""
    want = f"{ENV_PARENT}={pid}".encode()
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/environ", "rb") as f:
                    env = f.read().split(b"\0")
            except OSError:
                continue
            if want in env:
                out.append(int(name))
    return out


def test_engines_stop_when_the_front_end_is_killed(tiny_model, tmp_path):
    srv = KunserveCluster(str(tiny_model), ARGS, None, log_path=tmp_path / "serve.log", instances=1,
                          startup_timeout_s=400, extra=["--log-dir", str(tmp_path)])
    with srv:
        front = srv._proc.proc.pid
        engines = _launched_by(front)
        # the engine's API server and its engine core (which inherits the variable)
        assert len(engines) >= 2, (engines, (tmp_path / "serve.log").read_text()[-2000:])
        os.kill(front, signal.SIGKILL)  # not the group: the front end alone, as a crash would
        t0 = time.monotonic()
        while [p for p in engines if running(p)] and time.monotonic() - t0 < 120:
            time.sleep(0.5)
        left = [p for p in engines if running(p)]
        for p in left:  # a failure leaves no orphans to the next test
            os.kill(p, signal.SIGKILL)
        assert not left, f"engine processes {left} outlived their front end by {time.monotonic() - t0:.0f} s"
        logs = "".join(p.read_text(errors="replace") for p in tmp_path.glob("*.log"))
        assert "launcher pid" in logs and "is gone" in logs
