"""N stock ``vllm serve`` engines behind vllm-router (PyPI ``vllm-router``, the vLLM project's Rust
router), started the way a user deploys them: the ``vllm-router`` launcher of ``kunserve compare``.

One process of this module is the "server" the harness starts and stops: it starts the engines
(each pinned like ``kunserve serve`` pins its engines: ``KUNSERVE_ENGINE_CPUS`` and
``KUNSERVE_ENGINE_NICE``, each with a Prometheus directory of its own), waits for each engine's
``/health``, then runs ``vllm-router --worker-urls ...`` on the given port, and stays until the
router or an engine exits or it is signalled; every child is in its process group, so the
harness's stop takes them all. The engines' own ``/metrics`` (preemptions, KV usage) are not behind
the router: their URLs are written to the log.

    python -m vllm_kunserve.bench.router_fleet MODEL --instances 2 --port 8000 [--policy round_robin] -- ENGINE ARGS
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Sequence

from vllm_kunserve.cluster.fleet.spec import ENGINE_CPUS, cpu_split, engine_nice
from vllm_kunserve.cluster.fleet.launcher import cpu_env, free_port, nvidia_host, serve_argv

#: the router's policies (vllm-router 0.1.17 ``--policy``); its default is cache_aware
POLICIES = ("cache_aware", "round_robin", "random", "power_of_two", "consistent_hash", "sticky_least_loaded")


def router_binary() -> str:
    """The ``vllm-router`` console script of this interpreter's environment (or on PATH)."""
    here = Path(sys.executable).parent / "vllm-router"
    found = str(here) if here.exists() else shutil.which("vllm-router")
    if not found:
        raise FileNotFoundError("vllm-router is not installed: pip install vllm-router (the benchmark extra)")
    return found


def engine_environ(index: int, base: dict[str, str]) -> dict[str, str]:
    """Engine ``index``'s environment: ``base`` with its own CPU binding (the ``index``-th entry of
    ``KUNSERVE_ENGINE_CPUS``, cycling) and Prometheus directory."""
    env = {**base, **cpu_env(), "PROMETHEUS_MULTIPROC_DIR": tempfile.mkdtemp(prefix="kunserve-prom-")}
    cpus = env.pop(ENGINE_CPUS, "")
    if cpus:
        parts = [p.strip() for p in cpus.split("|") if p.strip()]
        env["VLLM_CPU_OMP_THREADS_BIND"] = parts[index % len(parts)]
    return env


def router_argv(binary: str, host: str, port: int, workers: Sequence[str], policy: str,
                metrics_port: int) -> list[str]:
    return [binary, "--host", host, "--port", str(port), "--worker-urls", *workers, "--policy", policy,
            "--prometheus-port", str(metrics_port), "--prometheus-host", host]


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    t0 = time.monotonic()
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: the process exited with code {proc.returncode} before it was healthy")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() - t0 > timeout_s:
            raise RuntimeError(f"{url}: not healthy after {timeout_s:g} s")
        time.sleep(0.5)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    engine_args: list[str] = []
    if "--" in argv:
        at = argv.index("--")
        argv, engine_args = argv[:at], argv[at + 1:]
    ap = argparse.ArgumentParser(prog="router_fleet", description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--instances", type=int, default=2)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--policy", choices=POLICIES, default="cache_aware")
    ap.add_argument("--startup-timeout", type=float, default=600.0)
    a = ap.parse_args(argv)
    if a.instances < 1:
        ap.error(f"--instances must be >= 1, got {a.instances}")
    binary = router_binary()
    base = dict(os.environ)
    # unpinned, the engines get cores of their own as kunserve serve's do (vLLM's auto binding shares one)
    base.update(cpu_split(a.instances, device="cuda" if nvidia_host() else "cpu", backend="local",
                          cpus=sorted(os.sched_getaffinity(0)), env=base)[0])
    nice = engine_nice(base)
    procs: list[subprocess.Popen] = []

    def stop(*_):
        for p in reversed(procs):
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        deadline = time.monotonic() + 20
        for p in procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
        sys.exit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    urls = []
    for i in range(a.instances):
        port = free_port(a.host)
        urls.append(f"http://{a.host}:{port}")
        procs.append(subprocess.Popen(nice + serve_argv(a.model, a.host, port, engine_args),
                                      env=engine_environ(i, base)))
    try:
        for url, p in zip(urls, procs):
            wait_healthy(url, p, a.startup_timeout)
    except RuntimeError as e:
        print(f"router_fleet: {e}", file=sys.stderr, flush=True)
        stop()
    print(f"router_fleet: engines healthy at {' '.join(urls)} (their /metrics are there); "
          f"starting vllm-router --policy {a.policy} on port {a.port}", flush=True)
    procs.append(subprocess.Popen(router_argv(binary, a.host, a.port, urls, a.policy, free_port(a.host))))
    while all(p.poll() is None for p in procs):
        time.sleep(0.5)
    dead = [i for i, p in enumerate(procs) if p.poll() is not None]
    print(f"router_fleet: process(es) {dead} exited; stopping the rest", file=sys.stderr, flush=True)
    stop()
    return 1


if __name__ == "__main__":
    sys.exit(main())
