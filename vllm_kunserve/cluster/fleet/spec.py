"""What one engine of the fleet is and how it starts: :class:`EngineSpec` (what every engine runs),
:class:`Engine` (one instance as the front end sees it), its environment (CPU binding, niceness)
and :func:`start_engine` (its ``vllm serve`` and control port on free ports), which every backend
(``cluster.fleet.backends``) calls where the engine runs.
"""

from __future__ import annotations

import logging
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_kunserve.cluster.fleet.launcher import (
    ENGINE_NICE,
    LaunchPlan,
    ServerProcess,
    cpu_env,
    engine_nice,
    free_port,
    serve_argv,
)

logger = logging.getLogger("kunserve.fleet")

__all__ = ["ENGINE_CPUS", "ENGINE_NICE", "Engine", "EngineSpec", "cpu_split", "engine_env", "engine_nice", "start_engine"]


@dataclass(frozen=True)
class EngineSpec:
    """What every engine of the fleet runs (all engines are replicas of one model)."""

    model: str
    engine_args: tuple[str, ...] = ()          # vLLM engine arguments, passed through
    kunserve: dict[str, Any] | None = None     # the "kunserve" section (None: stock vLLM engines)
    env: dict[str, str] = field(default_factory=dict)
    startup_timeout_s: float = 600.0
    log_dir: str = ""
    #: relaunches (fresh ports) of an engine whose process exits while it starts: a port another
    #: process took between being handed out and bound, or any other transient start failure. A
    #: timeout is not retried.
    startup_retries: int = 1

    def additional_config(self, control_port: int) -> dict[str, Any] | None:
        if self.kunserve is None:
            return None
        ks = dict(self.kunserve)
        ks["control"] = {**ks.get("control", {}), "port": control_port}
        ks["drop"] = {"group_member": True, **ks.get("drop", {})}  # can join pipeline groups (cluster.control.groups)
        return {"kunserve": ks}


#: ``KUNSERVE_ENGINE_CPUS="0|1"``: engine i runs its model on the i-th entry (vLLM-CPU's
#: ``VLLM_CPU_OMP_THREADS_BIND`` syntax, e.g. ``0|1`` or ``0-1|2-3``), cycling; without it vLLM binds
#: every engine the same way and engines on one host share a core (``kunserve serve`` and the
#: vllm-router baseline set one run of CPUs per local CPU engine unless told otherwise: ``cpu_split``)
ENGINE_CPUS = "KUNSERVE_ENGINE_CPUS"
#: ``KUNSERVE_ENGINE_GPUS="0|1"``: engine i sees the i-th entry as its CUDA devices
#: (``CUDA_VISIBLE_DEVICES``, e.g. ``0|1`` or ``0,1|2,3``), cycling (``kunserve serve`` sets one GPU per
#: engine on a CUDA host unless told otherwise)
ENGINE_GPUS = "KUNSERVE_ENGINE_GPUS"


def _cpu_list(cpus: list[int]) -> str:
    """CPU ids in vLLM's ``VLLM_CPU_OMP_THREADS_BIND`` syntax: runs as ranges (``0-3,6``)."""
    runs: list[list[int]] = []
    for c in sorted(cpus):
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(f"{a}-{b}" if b > a else str(a) for a, b in runs)


def cpu_split(instances: int, *, device: str, backend: str, cpus: list[int], env: dict | None = None
              ) -> tuple[dict[str, str], str]:
    """On a CPU host, cores of their own for each of N local engines: the engine environment that
    binds engine i's compute threads to the i-th of N equal runs of this process's CPUs
    (``KUNSERVE_ENGINE_CPUS``), one CPU each, shared in turn, where there are more engines than CPUs,
    and the line that says so. vLLM-CPU's automatic binding would put every engine on the same cores.
    Left alone where the user chose (``KUNSERVE_ENGINE_CPUS`` or ``VLLM_CPU_OMP_THREADS_BIND`` set),
    for one engine, off CPU and off the local backend (Ray places its engines, attached ones were
    started elsewhere)."""
    env = os.environ if env is None else env
    if (device != "cpu" or backend != "local" or instances < 2 or not cpus or env.get(ENGINE_CPUS)
            or env.get("VLLM_CPU_OMP_THREADS_BIND")):
        return {}, ""
    cpus = sorted(cpus)
    if instances >= len(cpus):
        parts = [str(cpus[i % len(cpus)]) for i in range(instances)]
    else:
        per = len(cpus) // instances
        parts = [_cpu_list(cpus[i * per:(i + 1) * per]) for i in range(instances)]
    return {ENGINE_CPUS: "|".join(parts)}, (f"[kunserve] cpus: engine i computes on the i-th of {'|'.join(parts)} "
                                             f"(of this host's {len(cpus)}); set {ENGINE_CPUS} to choose")


def engine_env(spec: EngineSpec, index: int = 0) -> dict[str, str]:
    """One engine's environment: vLLM's CPU settings, the spec's (with ``KUNSERVE_ENGINE_CPUS``
    turned into this engine's own ``VLLM_CPU_OMP_THREADS_BIND``, ``KUNSERVE_ENGINE_GPUS`` into its
    ``CUDA_VISIBLE_DEVICES``), and a Prometheus directory of its
    own (the engine core's ``kunserve:`` series reach its ``/metrics`` through it; engines sharing
    one would mix their series)."""
    env = {**cpu_env(), **spec.env, "PROMETHEUS_MULTIPROC_DIR": tempfile.mkdtemp(prefix="kunserve-prom-")}
    for key, var in ((ENGINE_CPUS, "VLLM_CPU_OMP_THREADS_BIND"), (ENGINE_GPUS, "CUDA_VISIBLE_DEVICES")):
        raw = env.pop(key, "") or os.environ.get(key, "")
        parts = [p.strip() for p in raw.split("|") if p.strip()]
        if parts:
            env[var] = parts[index % len(parts)]
    return env


#: what an engine may be; those that hold a machine (what instance-seconds count)
ENGINE_STATES = ("parked", "starting", "ready", "draining", "restarting", "stopping", "dead", "stopped")
HELD_STATES = ("starting", "ready", "draining", "restarting", "stopping")


@dataclass
class Engine:
    """One instance as the front end sees it."""

    index: int
    url: str = ""                       # the engine's OpenAI server
    control_url: str = ""               # its control port ("" for stock engines)
    state: str = "starting"             # one of ENGINE_STATES
    restarts: int = 0
    started_s: float = 0.0
    ready_s: float = 0.0
    handle: Any = None                  # backend-specific
    heard_s: float = 0.0                # when it last answered a request (monotonic; the front end sets it)
    node: str = ""                      # the Ray node it runs on ("" off Ray)

    @property
    def accepting(self) -> bool:
        """Takes new requests."""
        return self.state == "ready"

    @property
    def serving(self) -> bool:
        """Runs requests: ready, or draining (no new ones; those it holds finish or move)."""
        return self.state in ("ready", "draining")

    def view(self) -> dict:
        return {"instance": self.index, "url": self.url, "control_url": self.control_url or None,
                "state": self.state, "restarts": self.restarts, **({"node": self.node} if self.node else {}),
                "startup_s": round(self.ready_s - self.started_s, 2) if self.ready_s else None}


def start_engine(spec: EngineSpec, index: int, bind_host: str, url_host: str, tag: str) -> tuple[ServerProcess, str]:
    """Start one engine's ``vllm serve`` (and, for kunserve engines, its control port) bound to
    ``bind_host`` on free ports; returns the process (its URL on ``url_host``) and the control URL."""
    port, cport = free_port(bind_host), free_port(bind_host)
    ctl = spec.additional_config(cport)
    if ctl is not None:
        ctl["kunserve"]["control"]["host"] = bind_host
    env = engine_env(spec, index)
    plan = LaunchPlan(engine_nice(env) + serve_argv(spec.model, bind_host, port, spec.engine_args, ctl), env)
    log = Path(spec.log_dir or tempfile.gettempdir()) / f"kunserve-{tag}{index}-{port}.log"
    proc = ServerProcess(plan, url_host, port, log).start()
    logger.info("instance %d: starting on %s (log %s)", index, proc.endpoint, log)
    return proc, (f"http://{url_host}:{cport}" if ctl is not None else "")
