"""Start and stop one ``vllm serve`` instance on this machine.

:class:`VllmServer` is a convenience over the harness's process handling
(:class:`vllm_kunserve.bench.server.ServerProcess`: own process group, log file, ``/health`` wait,
SIGINT then SIGKILL): give it a model, engine arguments and an optional ``additional_config``. The
demo and the tests use it; ``kunserve compare`` builds the same command through its system specs.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_kunserve.bench.server import ServerProcess, free_port
from vllm_kunserve.bench.systems import LaunchPlan, cpu_env

__all__ = ["VllmServer", "free_port"]


@dataclass
class VllmServer:
    model: str
    args: list[str] = field(default_factory=list)
    additional_config: dict[str, Any] | None = None
    env: dict[str, str] = field(default_factory=dict)
    log_path: Path | None = None
    port: int = 0
    host: str = "127.0.0.1"
    startup_timeout_s: float = 300.0
    _proc: ServerProcess | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def plan(self) -> LaunchPlan:
        argv = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", self.model,
                "--host", self.host, "--port", str(self.port), *self.args]
        if self.additional_config is not None:
            argv += ["--additional-config", json.dumps(self.additional_config)]
        return LaunchPlan(argv, {**cpu_env(), **self.env})

    def start(self) -> "VllmServer":
        self.port = self.port or free_port(self.host)
        if self.log_path is None:
            self.log_path = Path(tempfile.gettempdir()) / f"vllm-serve-{self.port}-{os.getpid()}.log"
        self._proc = ServerProcess(self.plan(), self.host, self.port, Path(self.log_path)).start()
        self._proc.wait_ready(self.startup_timeout_s)
        return self

    def stop(self) -> int | None:
        return self._proc.stop() if self._proc else None

    def __enter__(self) -> "VllmServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
