"""Start and stop ``vllm serve`` processes on this machine.

One :class:`VllmServer` is one OpenAI-compatible vLLM instance on 127.0.0.1 with its log captured
to a file. It is the unit the benchmark harness, the demo and (later) ``kunserve serve`` launch.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vllm_executable() -> str:
    exe = Path(sys.executable).with_name("vllm")
    if exe.exists():
        return str(exe)
    found = shutil.which("vllm")
    if not found:
        raise FileNotFoundError("the `vllm` command was not found next to this Python or on PATH")
    return found


@dataclass
class VllmServer:
    """A ``vllm serve`` subprocess. Use as a context manager or call start()/stop()."""

    model: str
    args: list[str] = field(default_factory=list)
    additional_config: dict[str, Any] | None = None
    env: dict[str, str] = field(default_factory=dict)
    log_path: Path | None = None
    port: int = 0
    host: str = "127.0.0.1"
    startup_timeout_s: float = 300.0
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        cmd = [vllm_executable(), "serve", self.model, "--host", self.host, "--port", str(self.port),
               *self.args]
        if self.additional_config is not None:
            cmd += ["--additional-config", json.dumps(self.additional_config)]
        return cmd

    def start(self) -> "VllmServer":
        if not self.port:
            self.port = free_port()
        env = dict(os.environ, VLLM_HOST_IP="127.0.0.1", **self.env)
        if self.log_path is None:
            self.log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"vllm-serve-{self.port}.log"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "w", encoding="utf-8")
        self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        log.close()
        self._wait_healthy()
        return self

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with code {self.proc.returncode} during startup; "
                                   f"last log lines:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"vllm serve not healthy after {self.startup_timeout_s}s; log:\n{self.log_tail()}")

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(Path(self.log_path).read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGINT the server's process group, then SIGKILL after ``timeout_s``. Returns the exit code."""
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        for sig, wait in ((signal.SIGINT, timeout_s), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                return self.proc.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                continue
        return self.proc.poll()

    def __enter__(self) -> "VllmServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
