"""Start a server from a :class:`~vllm_kunserve.bench.systems.LaunchPlan`, wait for it, stop it.

The server runs in its own process group (so vLLM's engine-core child goes with it), its stdout
and stderr go to a log file in the run directory, readiness is ``GET /health`` returning 200, and
shutdown is SIGINT to the group, then SIGKILL after a grace period.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from vllm_kunserve.bench.systems import LaunchPlan


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _tail(path: Path, n: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


class ServerProcess:
    def __init__(self, plan: LaunchPlan, host: str, port: int, log_path: Path):
        self.plan, self.host, self.port, self.log_path = plan, host, port, log_path
        self.proc: subprocess.Popen | None = None
        self._log = None

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> "ServerProcess":
        env = dict(os.environ)
        for k in self.plan.unset_env:
            env.pop(k, None)
        env.update(self.plan.env)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "wb")
        self._log.write(("$ " + " ".join(self.plan.argv) + "\n").encode())
        self._log.flush()
        self.proc = subprocess.Popen(self.plan.argv, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        return self

    def wait_ready(self, timeout_s: float = 600.0) -> float:
        """Block until /health answers 200; return the seconds it took. Raises RuntimeError if the
        process exits or the timeout passes (with the log's tail)."""
        assert self.proc is not None
        t0 = time.monotonic()
        url = f"{self.endpoint}/health"
        while True:
            rc = self.proc.poll()
            if rc is not None:
                raise RuntimeError(f"server exited with code {rc} before becoming healthy; "
                                   f"log {self.log_path}:\n{_tail(self.log_path)}")
            try:
                with urllib.request.urlopen(url, timeout=2) as r:
                    if r.status == 200:
                        return time.monotonic() - t0
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() - t0 > timeout_s:
                self.stop()
                raise RuntimeError(f"server not healthy after {timeout_s:g} s; log {self.log_path}:\n"
                                   f"{_tail(self.log_path)}")
            time.sleep(0.5)

    def stop(self, grace_s: float = 30.0) -> int | None:
        """SIGINT the process group, SIGKILL it after ``grace_s``; return the exit code."""
        if self.proc is None:
            return None
        rc = self.proc.poll()
        if rc is None:
            pgid = self.proc.pid  # start_new_session: the group id is the child's pid
            try:
                os.killpg(pgid, signal.SIGINT)
                rc = self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                os.killpg(pgid, signal.SIGKILL)
                rc = self.proc.wait(timeout=30)
            except ProcessLookupError:
                rc = self.proc.wait(timeout=30)
            # stragglers of the group (engine-core child) after the leader exited
            try:
                os.killpg(pgid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if self._log:
            self._log.close()
            self._log = None
        return rc

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
